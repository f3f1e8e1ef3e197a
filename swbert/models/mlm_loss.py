"""The masked-LM decoder and its cross entropy in vocabulary chunks, never all (N, V) logits at once (ours).

The paper trains with the ordinary masked-LM cross entropy; computing it chunk by chunk is our
memory optimisation, with the same loss and gradients. `logit_stats` returns, for each of the N
predicted rows of `x @ W.T + b`, the log-sum-exp over the vocabulary, the target's logit, the
largest logit and its id: the loss is `lse - target logit`, the prediction the id. The backward
recomputes each chunk's logits from `x` and `W` instead of keeping them, so what is saved for it is
`x` (N, d) and one fp32 number a row, whatever the vocabulary.

Chunks split the vocabulary, not the rows: each chunk's weight gradient is then one GEMM over all
rows (written once, no (V, d) accumulator) and only the input gradient (N, d) is summed over
chunks, in fp32. Logits are computed in the compute dtype (the weights'), their softmax in fp32,
as `F.cross_entropy(logits.float(), ...)` does; the gradient of the logits is cast back to the
compute dtype for the GEMMs, as autograd casts it through `.float()`.

Under tensor parallelism each rank runs this on its vocabulary shard and the ranks combine the
per-row numbers (`swbert.parallel.layers.VocabParallelDecoder.chunked_mlm_loss`): three (N,)
all-reduces instead of gathering (N, V) logits. Static shapes: the chunks depend on (N, V) only,
so the loop unrolls into one graph under torch.compile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The fp32 logits of one chunk at most (ours): large enough for full-speed GEMMs on a GPU, small
# enough that the transient stays far below the activations of a micro-batch.
MLM_CHUNK_BYTES = 64 * 2**20


def vocab_chunks(rows: int, vocab: int, chunk_bytes: int = MLM_CHUNK_BYTES) -> tuple[tuple[int, int], ...]:
    """(start, end) of equal column chunks of `vocab` whose (rows, width) fp32 logits fit `chunk_bytes`."""
    if vocab <= 0:
        return ()
    width = max(1, chunk_bytes // (4 * max(rows, 1)))
    count = -(-vocab // width)
    width = -(-vocab // count)  # balanced: every chunk but the last the same width
    return tuple((s, min(s + width, vocab)) for s in range(0, vocab, width))


def logit_stats(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    vocab: int,
    chunk_bytes: int = MLM_CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of logits `x @ weight[:vocab].T + bias[:vocab]` (rows past `vocab`, a padded table's,
    are left out): fp32 log-sum-exp (N,), fp32 logit of `target` (N,) (0 where the target is not in
    [0, vocab), e.g. IGNORE_INDEX or another rank's shard), fp32 largest logit (N,) and its id (N,),
    the first one on ties as `argmax`. The first two are differentiable; the logits are never held.
    x: (N, d); weight: (V_padded, d); target: (N,) ids into this table."""
    bounds = vocab_chunks(x.shape[0], vocab, chunk_bytes)
    return _ChunkedLogitStats.apply(x, weight, bias, target, bounds)


def _logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, s: int, e: int) -> torch.Tensor:
    """The fp32 logits of columns [s, e), computed in the compute dtype: (N, e - s)."""
    return F.linear(x, weight[s:e], None if bias is None else bias[s:e]).float()


def _in_chunk(target: torch.Tensor, s: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The targets' columns in chunk [s, e) (clamped into it) and whether they lie there."""
    local = target - s
    return local.clamp(0, e - s - 1).unsqueeze(1), (local >= 0) & (local < e - s)


class _ChunkedLogitStats(torch.autograd.Function):
    """`logit_stats` with a backward that recomputes each chunk's logits (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, bounds):  # noqa: ANN001, ANN205 (autograd's signature)
        n = x.shape[0]
        picked = x.new_zeros(n, dtype=torch.float32)
        if not bounds:  # a shard of padding rows only: no logit
            lse = x.new_full((n,), float("-inf"), dtype=torch.float32)
            best = lse.clone()
            index = torch.zeros(n, dtype=torch.long, device=x.device)
        else:
            lses, maxes, indices = [], [], []
            for s, e in bounds:
                f = _logits(x, weight, bias, s, e)  # (N, chunk)
                m, i = f.max(-1)  # the first maximum, as argmax
                maxes.append(m)
                indices.append(i + s)
                column, inside = _in_chunk(target, s, e)
                picked = picked + torch.where(inside, f.gather(1, column).squeeze(1), 0.0)
                lses.append(m + f.sub_(m.unsqueeze(1)).exp_().sum(-1).log_())  # in place: one buffer
                del f  # before the next chunk's
            lse = lses[0] if len(lses) == 1 else torch.logsumexp(torch.stack(lses), 0)
            maxes, indices = torch.stack(maxes), torch.stack(indices)  # (chunks, N)
            first = maxes.argmax(0, keepdim=True)  # chunks in order: the first chunk holding the max
            best, index = maxes.gather(0, first).squeeze(0), indices.gather(0, first).squeeze(0)
        ctx.bounds = bounds
        ctx.save_for_backward(x, weight, bias, target, lse)
        ctx.mark_non_differentiable(best, index)
        return lse, picked, best, index

    @staticmethod
    def backward(ctx, grad_lse, grad_picked, _best, _index):  # noqa: ANN001, ANN205
        x, weight, bias, target, lse = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = None
        dw = torch.zeros_like(weight) if need_w else None  # padded rows: no gradient, as sliced logits
        db = torch.zeros_like(bias) if need_b else None
        for s, e in ctx.bounds:
            # d lse / d logits = softmax; d picked / d logits = one-hot of the target. In place on the
            # recomputed logits: one (N, chunk) fp32 buffer
            g = _logits(x, weight, bias, s, e).sub_(lse.unsqueeze(1)).exp_().mul_(grad_lse.unsqueeze(1))
            column, inside = _in_chunk(target, s, e)
            g = g.scatter_add_(1, column, torch.where(inside, grad_picked, 0.0).unsqueeze(1)).to(x.dtype)
            if need_x:
                part = (g @ weight[s:e]).float()
                dx = part if dx is None else dx + part
            if need_w:  # into its rows of dw (zeros): no (chunk, d) temporary
                dw[s:e].addmm_(g.t(), x)
            if need_b:
                db[s:e].copy_(g.sum(0))
            del g  # before the next chunk's
        if need_x and dx is None:  # no column in this shard: a zero input gradient
            # made from the incoming gradient, not from nothing: compiled (AOT autograd), a constant
            # one lets the input's backward all-reduce under tensor parallelism (the copy_to region)
            # run apart from the graph's gradients, out of step with the other ranks
            dx = grad_lse.unsqueeze(1) * x.new_zeros(1, x.shape[1], dtype=torch.float32)
        return None if dx is None else dx.to(x.dtype), dw, db, None, None
