"""Self-attention variants of the paper, one small class each, and the inner kernels.

Every variant maps hidden states to per-head queries, keys and values; the kernel, the output
projection and everything around them are common. Head counts are read off tensor shapes, so a
tensor-parallel wrapper that shards the projections by heads needs no change here.

    standard   Q = X Wq + bq,  K = X Wk + bk,  V = X Wv + bv
    shared     S = X Ws + bs;  Q = S * dq,  K = S * dk,  V = S * dv     (dq, dk, dv in R^d)
    symmetric  Q = X Wq + bq,  K = Q,  V = X Wv + bv
    pairwise   Q = X Wq + bq,  V = X Wv + bv;  scores Q U Q^T with one Dh x Dh U per head
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from swbert.models.config import SWBertConfig

# positions to keep: (batch indices, sequence indices), row-major, as `mask.nonzero(as_tuple=True)`
Rows = tuple[torch.Tensor, torch.Tensor]


class _CPUDropout(torch.autograd.Function):
    """Dropout whose mask comes from 16-bit random integers, four to one 64-bit draw.

    On CPU, `bernoulli_` draws a double per element (two 32-bit generator calls) and
    `native_dropout` multiplies by a float mask; here one 64-bit draw gives four elements their
    16-bit uniforms and `torch.where` applies a bool mask (multiplying a float by a bool tensor
    goes through a slow type-promoting loop). Dropout costs a third of `native_dropout`'s time.
    The drop probability is p rounded to a multiple of 2^-16 (0.1 becomes 0.1000061), and the
    scale is 1 / (1 - that), so the expectation stays exact.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        threshold = min(round(p * 2**16), 2**16 - 1)  # p just below 1 still keeps something
        words = torch.empty((x.numel() + 3) // 4, dtype=torch.int64).random_(-(2**63), None)  # all 64 bits
        uniform16 = words.view(torch.int16)[: x.numel()].view(x.shape)  # uniform on [-2^15, 2^15)
        keep = uniform16 >= threshold - 2**15  # P(keep) = 1 - threshold / 2^16
        scale = 1.0 / (1.0 - threshold / 2**16)
        ctx.save_for_backward(keep)  # a bool mask: 1 byte per element
        ctx.scale = scale
        return torch.where(keep, x, 0.0).mul_(scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (keep,) = ctx.saved_tensors
        return torch.where(keep, grad, 0.0).mul_(ctx.scale), None


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Inverted dropout that keeps a bool mask for backward on every device.

    GPUs use the fused `native_dropout` (counter-based random numbers, one kernel), and so does
    torch.compile, which generates its own. In eager mode on CPU, `F.dropout` keeps a float mask
    (4 bytes per element) and its `bernoulli_` is slow; there a bool mask from 16-bit integers
    is drawn instead.
    """
    if not training or p == 0.0:
        return x
    if p >= 1.0:
        return x * 0.0
    if x.device.type == "cpu" and not torch.compiler.is_compiling():  # compiled: inductor's own RNG
        return _CPUDropout.apply(x, p)
    return torch.native_dropout(x, p, True)[0]


def unfused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float
) -> torch.Tensor:
    """Softmax attention from batched matrix products, for where no fused kernel applies.

    It computes what SDPA's own math fallback computes but keeps less for backward: no scaled
    copies of Q and K (1/sqrt(Dh) rides on the product) and a bool dropout mask (see `dropout`)
    instead of a float one. Inputs laid out head-major (contiguous (B, H, S, Dh)) are read in
    place; others are copied once.
    """
    B, H, S, Dh = q.shape
    Sk = k.shape[-2]
    qf, kf, vf = (t.reshape(B * H, t.shape[-2], Dh) for t in (q, k, v))  # views when head-major
    if mask is None:
        bias, beta = qf.new_empty(1, 1, 1), 0.0  # beta=0: baddbmm does not read it
    else:
        # The mask enters as an additive bias that the product accumulates onto (half the time of
        # filling the scores in place, and nothing to undo in backward). The most negative finite
        # value rather than -inf: a query whose keys are all masked gets uniform weights instead of
        # NaN (key padding never masks every key of a real sequence); a finite score added to it
        # rounds back to it.
        mask = mask.expand(B, H, mask.shape[-2], Sk)
        lowest = torch.finfo(qf.dtype).min
        if torch.is_autocast_enabled(qf.device.type):  # the product runs in the autocast dtype
            lowest = max(lowest, torch.finfo(torch.get_autocast_dtype(qf.device.type)).min)
        bias = qf.new_zeros(mask.shape).masked_fill_(~mask, lowest)
        bias, beta = bias.view(B * H, -1, Sk), 1.0
    scores = torch.baddbmm(bias, qf, kf.transpose(1, 2), beta=beta, alpha=Dh**-0.5)  # (B*H, S, Sk)
    probs = scores.softmax(dim=-1)
    if dropout_p > 0.0:
        probs = dropout(probs, dropout_p, True)
    return torch.bmm(probs, vf).view(B, H, S, Dh)


class SDPAKernel(nn.Module):
    """`scaled_dot_product_attention`: flash / memory-efficient kernels on GPU, fused on CPU.

    PyTorch has no fused CPU kernel with dropout: there SDPA falls back to its math path, and this
    kernel runs `unfused_attention` instead, which computes the same and keeps less for backward.
    """

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def unfused(self, device: torch.device) -> bool:
        """Whether a call on this device computes from batched matrix products (no fused kernel)."""
        return self.training and self.dropout > 0.0 and device.type == "cpu"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        # q, k, v: (B, H, S, Dh); mask: (B, 1, 1, S) bool, True where a key may be attended
        if self.unfused(q.device):
            return unfused_attention(q, k, v, mask, self.dropout)
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)


class EagerKernel(nn.Module):
    """The same computation written out, as a reference and for debugging."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def unfused(self, device: torch.device) -> bool:
        return True

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, S, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.dropout(scores.softmax(dim=-1)) @ v  # (B, H, S, Dh)


KERNELS: dict[str, type[nn.Module]] = {"sdpa": SDPAKernel, "eager": EagerKernel}


class RebuildFromS:
    """Saved-tensor hooks for one kernel call: a tensor that is S scaled by a vector, or a view of
    one, is kept as (S, vector) and rebuilt by one elementwise product in backward, so autograd
    keeps S instead of Q (shared attention's V is S itself). Tensors it does not recognise are kept
    as they are.

    It composes with saved-tensor hooks already active (activation checkpointing, CPU offload):
    S and every tensor it does not rebuild go through those. Under torch.compile, or where the
    hooks are disabled, it does nothing; the compiler makes the same trade by itself.
    """

    def __init__(self, s: torch.Tensor, scaled: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        hooks = torch._C._autograd
        self.active = (
            torch.is_grad_enabled()
            and s.requires_grad
            and not torch.compiler.is_compiling()
            and hasattr(hooks, "_top_saved_tensors_default_hooks")  # private API: do without it
            and hooks._saved_tensors_hooks_is_enabled()
        )
        if not self.active:
            return
        self.s: torch.Tensor | None = s
        # Keyed by storage: the kernel may save a view (a reshape, a transpose) of Q or V. The
        # vectors are kept as they are (a parameter stays a parameter, so a sharded-parameter
        # engine that gathers it for this module's backward serves the rebuild as well).
        self.scales = {t.untyped_storage().data_ptr(): scale for t, scale in scaled if t is not s}
        outer = hooks._top_saved_tensors_default_hooks(True)
        self.outer_pack, self.outer_unpack = outer if outer is not None else (None, None)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def _pack_outer(self, t: torch.Tensor) -> object:
        # detached: a saved output would otherwise point back at its own node, a reference
        # cycle through C++ that keeps a discarded graph (never run backward) alive
        return t.detach() if self.outer_pack is None else self.outer_pack(t)

    def _unpack_outer(self, packed: object) -> torch.Tensor:
        return packed if self.outer_unpack is None else self.outer_unpack(packed)

    def pack(self, t: torch.Tensor) -> tuple:
        scale = self.scales.get(t.untyped_storage().data_ptr())
        if scale is None:
            return (None, self._pack_outer(t))
        # S * scale is laid out like the original product, so the same strides address the view
        return ((scale, t.shape, t.stride(), t.storage_offset()), self._pack_outer(self.s))

    def unpack(self, packed: tuple) -> torch.Tensor:
        recipe, inner = packed
        t = self._unpack_outer(inner)
        if recipe is None:
            return t
        scale, shape, stride, offset = recipe
        return (t * scale).as_strided(shape, stride, offset)

    def __enter__(self) -> RebuildFromS:
        if self.active:
            self.hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.active:
            self.hooks.__exit__(*exc)
            # The unpack hook lives as long as the graph: it must not hold S, which is packed
            # (through the outer hooks, if any) into every record that needs it.
            self.s = None


class _ScaledInputLinear(torch.autograd.Function):
    """F.linear(x, weight * scale, bias), keeping weight and scale for backward, not their product."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight, scale)
        ctx.has_bias = bias is not None
        return F.linear(x, weight * scale, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, scale = ctx.saved_tensors
        # in the gradient's dtype (bf16 under autocast, as F.linear's backward); autograd casts each
        # parameter gradient back to its parameter's dtype
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad @ (weight * scale).to(grad.dtype) if ctx.needs_input_grad[0] else None
        grad_ws = g2.t() @ x.reshape(-1, x.shape[-1]).to(grad.dtype)  # (out, in): d loss / d(weight * scale)
        grad_w = grad_ws * scale if ctx.needs_input_grad[1] else None
        grad_s = (grad_ws * weight).sum(0) if ctx.needs_input_grad[2] else None
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return grad_x, grad_w, grad_s, grad_b


class OutProjection(nn.Linear):
    """The attention output projection. `input_scale` scales the input features through the weight:
    (y diag(s)) W^T = y (W diag(s))^T, one pass over the d x d weight instead of over every token,
    and backward keeps W and s (parameters) rather than their product.

    The scaled weight is formed inside this module's forward, so an engine that gathers a module's
    parameters around its forward (ZeRO-3) gathers it here. A tensor-parallel replacement takes
    the same argument (`swbert.parallel.layers.RowLinear`).
    """

    def forward(self, x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
        if input_scale is None:
            return F.linear(x, self.weight, self.bias)
        return _ScaledInputLinear.apply(x, self.weight, input_scale, self.bias)


class SelfAttention(nn.Module):
    """Common part: split heads, run the kernel, merge heads, project out."""

    def __init__(self, config: SWBertConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.kernel = KERNELS[config.attention_kernel](config.attention_probs_dropout_prob)
        self.out_proj = OutProjection(config.hidden_size, config.hidden_size)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values, each (B, H, S, Dh)."""
        raise NotImplementedError

    def fold_for_inference(self) -> None:
        """Rewrite parameters into a cheaper form computing the same function (a no-op by default)."""

    def split_heads(self, t: torch.Tensor) -> torch.Tensor:
        B, S, _ = t.shape
        return t.view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, H, S, Dh)

    def merge_heads(self, y: torch.Tensor, rows: Rows | None) -> torch.Tensor:
        """(B, H, S, Dh) -> (B, S, H*Dh), or (N, H*Dh) at the `rows` positions."""
        y = y.transpose(1, 2)  # (B, S, H, Dh)
        if rows is not None:
            return y[rows].flatten(1)  # (N, H*Dh): gathers only the kept rows
        return y.reshape(*y.shape[:2], -1)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, rows: Rows | None = None
    ) -> torch.Tensor:
        """x: (B, S, d) -> (B, S, d). With `rows`, only those positions come out, (N, d): every
        position is still a key and a value, but the output projection runs on N rows."""
        q, k, v = self.qkv(x)
        y = self.kernel(q, k, v, mask)  # (B, H, S, Dh)
        return self.out_proj(self.merge_heads(y, rows))


class StandardAttention(SelfAttention):
    """Separate Wq, Wk, Wv with biases: BERT's attention."""

    def __init__(self, config: SWBertConfig) -> None:
        super().__init__(config)
        d = config.hidden_size
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            self.split_heads(self.q_proj(x)),
            self.split_heads(self.k_proj(x)),
            self.split_heads(self.v_proj(x)),
        )


class SharedAttention(SelfAttention):
    """One projection S = X Ws + bs; Q, K, V are S scaled elementwise by dq, dk, dv.

    The diagonal matrices of the paper are stored as vectors (initialised to ones, so training
    starts from Q = K = V = S). Since Q K^T = S diag(dq * dk) S^T, the pre-softmax scores are
    symmetric in the tokens.
    """

    def __init__(self, config: SWBertConfig) -> None:
        super().__init__(config)
        d = config.hidden_size
        self.proj = nn.Linear(d, d)
        self.dq = nn.Parameter(torch.ones(d))
        self.dk = nn.Parameter(torch.ones(d))
        self.dv = nn.Parameter(torch.ones(d))
        # set by fold_for_inference(): "query" (dq holds dq*dk, dv lives in out_proj) or
        # "projection" (all three live in proj and out_proj: Q = K = V = S)
        self.folded = ""

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K, V as the paper writes them; `forward` computes the same attention with less work."""
        s = self.proj(x)  # (B, S, d); one GEMM instead of three
        return self.split_heads(s * self.dq), self.split_heads(s * self.dk), self.split_heads(s * self.dv)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, rows: Rows | None = None
    ) -> torch.Tensor:
        # Q K^T = S diag(dq*dk) S^T: only the product matters, so the keys can be S itself. Attention
        # is linear in V column by column, A (S diag(dv)) = (A S) diag(dv), so the values are S too
        # and dv scales the output projection's d x d weight instead of a (B, S, d) activation.
        # Q is S scaled by a vector: autograd keeps S and rebuilds Q in backward instead of holding
        # another (B, S, d) activation.
        s = self.split_heads(self.proj(x))  # (B, H, S, Dh), a view of the (B, S, d) product
        unfused = getattr(self.kernel, "unfused", None)  # a wrapped kernel may not say: then fused
        if unfused is not None and unfused(s.device):
            # batched matrix products read head-major operands in place: one copy of S here
            # instead of copies of Q, K and V inside the kernel (the result is the same either way)
            s = s.contiguous()
        qk = (self.dq if self.folded else self.dq * self.dk).view(-1, 1, self.head_dim)  # (H, 1, Dh)
        q = s if self.folded == "projection" else s * qk
        with RebuildFromS(s, [(q, qk)]):
            y = self.kernel(q, s, s, mask)  # (B, H, S, Dh)
        y = self.merge_heads(y, rows)  # (B, S, d), or (N, d)
        return self.out_proj(y, input_scale=None if self.folded else self.dv)  # folded: dv is in the weight

    @torch.no_grad()
    def fold_for_inference(self) -> None:
        """Fold the diagonals into the projections; the layer computes the same function.

        Attention is linear in V column by column, A (S diag(dv)) = (A S) diag(dv), so dv moves
        into the output projection. When every entry of p = dq*dk is positive,
        S diag(p) S^T = S' S'^T with S' = S diag(sqrt(p)), so sqrt(p) moves into `proj` (and
        1/sqrt(p) into the output projection): Q = K = V = S', no elementwise work at all.
        Otherwise p stays on the query side. Afterwards the diagonals that moved are ones, so the
        parameters still describe a valid shared layer (a saved state dict loads into an unfolded
        model with the same outputs). Meant for inference: a folded layer leaves them unused.
        """
        if self.folded:
            return
        # the scales in fp32, so a 16-bit model rounds each rewritten weight once
        p = self.dq.float() * self.dk.float()
        out_scale = self.dv.float()

        def scale_(t: torch.Tensor, by: torch.Tensor) -> None:
            t.copy_(t.float() * by)

        if bool((p > 0).all()):
            root = p.sqrt()
            scale_(self.proj.weight, root[:, None])  # (out, in): scales the rows, i.e. the outputs
            if self.proj.bias is not None:
                scale_(self.proj.bias, root)
            out_scale = out_scale / root
            self.dq.fill_(1.0)
            self.folded = "projection"
        else:
            self.dq.copy_(p)
            self.folded = "query"
        scale_(self.out_proj.weight, out_scale)  # (out, in): scales the input columns
        self.dk.fill_(1.0)
        self.dv.fill_(1.0)


class SymmetricAttention(SelfAttention):
    """Keys are the queries (no Wk): scores Q Q^T are symmetric."""

    def __init__(self, config: SWBertConfig) -> None:
        super().__init__(config)
        d = config.hidden_size
        self.q_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = self.split_heads(self.q_proj(x))
        return q, q, self.split_heads(self.v_proj(x))


class PairwiseAttention(SelfAttention):
    """Scores Q U Q^T with a learned Dh x Dh matrix U per head (no bias), i.e. K = Q U^T.

    U starts as the identity, so training starts from symmetric attention.
    """

    def __init__(self, config: SWBertConfig) -> None:
        super().__init__(config)
        d, h, dh = config.hidden_size, config.num_attention_heads, config.head_dim
        self.q_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.pair = nn.Parameter(torch.eye(dh).repeat(h, 1, 1))  # (H, Dh, Dh)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = self.split_heads(self.q_proj(x))  # (B, H, S, Dh)
        k = q @ self.pair.transpose(-1, -2)  # (B, H, S, Dh): q_i . k_j = q_i U q_j^T
        return q, k, self.split_heads(self.v_proj(x))


ATTENTION_CLASSES: dict[str, type[SelfAttention]] = {
    "standard": StandardAttention,
    "shared": SharedAttention,
    "symmetric": SymmetricAttention,
    "pairwise": PairwiseAttention,
}


def build_attention(config: SWBertConfig) -> SelfAttention:
    """The one place where `config.attention_type` picks a class."""
    return ATTENTION_CLASSES[config.attention_type](config)
