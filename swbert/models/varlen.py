"""Unpadded execution: a batch's sequences as one token stream with cumulative lengths.

A padded batch (B, S) computes every padding token in every GEMM, and a key padding mask keeps
GPUs off their flash kernels. Unpadded, the real tokens of the batch are one stream (T, d) with
`cu_seqlens` (int32, B+1: sequence b is tokens cu_seqlens[b] to cu_seqlens[b+1]) and `max_seqlen`;
attention stays within each sequence. This is our engineering choice (the paper says nothing about
padding), as MosaicBERT, ModernBERT and flash-attn's `bert_padding` do it.

The attention kernel is the only place that sees the difference (`varlen_attention`): on CUDA a
variable-length flash kernel (flash-attn's varlen when importable, which has dropout; else
`torch.nn.attention.varlen`, which has none and so serves only where attention dropout is off);
elsewhere the reference, one dense kernel call per sequence, held equal to the padded path by
tests/models/test_unpadded.py. `varlen_kernel(device)` says which one a device gets. Local attention
layers get the boundaries with a band (`SeqLens.windowed`): the fused kernels as their `window_size`,
the reference as a band mask on each sequence.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import NamedTuple

import torch

# (q, k, v, mask) -> out, all (B, H, S, Dh): the kernel's dense attention on one sequence
DenseAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class SeqLens:
    """Sequence boundaries of a token stream; passed to the attention kernel in place of a mask.

    `cu_seqlens` stays on the device; the host copy of the lengths is made once per forward, and
    only by the reference kernel (a fused varlen kernel needs none)."""

    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen: int) -> None:
        if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
            raise ValueError(
                f"cu_seqlens must be 1-D with B+1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}"
            )
        self.cu_seqlens = cu_seqlens
        self.max_seqlen = int(max_seqlen)
        self._bounds: list[int] | None = None
        # local attention: a query sees the keys of its sequence within this many positions each
        # side (None: all of them); set by `windowed`
        self.window: int | None = None
        self._source: SeqLens | None = None  # the unwindowed boundaries whose host copy is shared

    def windowed(self, half: int) -> SeqLens:
        """The same boundaries for local attention layers: within each sequence, keys at most `half`
        positions from the query. Shares the host copy of the bounds (still one sync per forward)."""
        out = SeqLens(self.cu_seqlens, self.max_seqlen)
        out.window = half
        out._source = self
        return out

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    def bounds(self) -> list[int]:
        """cu_seqlens on the host (one sync, once)."""
        if self._source is not None:
            return self._source.bounds()
        if self._bounds is None:
            self._bounds = self.cu_seqlens.tolist()
        return self._bounds

    def seq_index(self, total: int) -> torch.Tensor:
        """(T,) the sequence each token belongs to, computed on the device (no sync)."""
        tokens = torch.arange(total, device=self.cu_seqlens.device, dtype=self.cu_seqlens.dtype)
        return torch.bucketize(tokens, self.cu_seqlens[1:], right=True)

    def position_ids(self, total: int) -> torch.Tensor:
        """(T,) positions restarting at 0 in each sequence, as the padded path numbers them."""
        seq = self.seq_index(total)
        tokens = torch.arange(total, device=self.cu_seqlens.device)
        return tokens - self.cu_seqlens.long()[seq]

    def starts(self) -> torch.Tensor:
        """(B,) the stream index of each sequence's first token ([CLS])."""
        return self.cu_seqlens[:-1].long()

    def check_positions(self, max_positions: int) -> None:
        """A ValueError naming the first sequence longer than the model's learned positions (checked
        on the host's max_seqlen first: a sync only when it is over)."""
        if self.max_seqlen <= max_positions:
            return
        lengths = self.cu_seqlens.diff()
        too_long = (lengths > max_positions).nonzero()
        if too_long.numel():
            index = int(too_long[0, 0])
            raise ValueError(
                f"sequence {index} of the batch has {int(lengths[index])} tokens, more than "
                f"max_position_embeddings={max_positions}; truncate it (e.g. --max-seq-length)"
            )


class Unpadded(NamedTuple):
    """The real tokens of a right-padded batch as one stream."""

    input_ids: torch.Tensor  # (T,)
    cu_seqlens: torch.Tensor  # (B+1,) int32
    max_seqlen: int
    indices: torch.Tensor  # (T,) the flat (b * S + s) position of each token in the padded batch


def unpad_input(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Unpadded:
    """(B, S) ids and their 1/0 mask -> the stream of real tokens. Each row's real tokens must come
    first (right padding): the padded path numbers positions from the row's start, and so does the
    stream. Other per-token tensors follow with `unpad_like(t, indices)`."""
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)  # (B,)
    prefix = torch.arange(mask.shape[1], device=mask.device)[None] < lengths[:, None]
    if not torch.equal(mask, prefix):
        row = int((mask != prefix).any(dim=1).nonzero()[0, 0])
        raise ValueError(
            f"attention_mask row {row} is not right-padded (real tokens must come first); "
            "pad on the right to unpad the batch"
        )
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    indices = mask.reshape(-1).nonzero().reshape(-1)
    max_seqlen = int(lengths.max()) if lengths.numel() else 0
    return Unpadded(unpad_like(input_ids, indices), cu_seqlens, max_seqlen, indices)


def unpad_like(t: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(B, S, ...) -> (T, ...): the entries of the real tokens, in stream order."""
    return t.reshape(-1, *t.shape[2:])[indices]


def pad_output(
    x: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int, fill: float = 0.0
) -> torch.Tensor:
    """(T, ...) -> (B, S, ...): the inverse of `unpad_input`, `fill` at the padding. Differentiable."""
    out = x.new_full((batch * seqlen, *x.shape[1:]), fill)
    return out.index_put((indices,), x).view(batch, seqlen, *x.shape[1:])


def pad_by_seqlens(x: torch.Tensor, seqlens: SeqLens, fill: float = 0.0) -> torch.Tensor:
    """(T, ...) -> (B, max_seqlen, ...) from the sequence boundaries alone (no indices, no sync)."""
    total = x.shape[0]
    seq = seqlens.seq_index(total)
    pos = seqlens.position_ids(total)
    out = x.new_full((seqlens.num_seqs, seqlens.max_seqlen, *x.shape[1:]), fill)
    return out.index_put((seq, pos), x)


def band_mask(length: int, half: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(1, 1, L, L) bool, True where key j is within `half` positions of query i: local attention's
    band (ModernBERT's `|i - j| <= window // 2`), for a kernel's boolean mask."""
    index = torch.arange(length, device=device)
    return ((index[:, None] - index[None, :]).abs() <= half)[None, None]


# ---- the kernel -------------------------------------------------------------------------------------
@functools.cache
def _has_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None  # looked up once: every layer asks


@functools.cache
def _torch_varlen() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_kernel(device: torch.device | str, dropout: float = 0.0) -> str | None:
    """The fused variable-length kernel a device has for attention dropout `dropout` (in training),
    or None (the per-sequence reference runs). What `--unpad auto` asks."""
    if torch.device(device).type != "cuda":
        return None
    if _has_flash_attn():
        return "flash_attn"
    if _torch_varlen() is not None and dropout == 0.0:
        return "torch.nn.attention.varlen"
    return None


def _fused(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: SeqLens, dropout_p: float
) -> torch.Tensor:
    """The fused kernel on (T, H, Dh) inputs."""
    cu, m = seqlens.cu_seqlens.int(), seqlens.max_seqlen
    # both kernels take a band as (left, right): key j is seen by query i when i - left <= j <= i + right
    window = (-1, -1) if seqlens.window is None else (seqlens.window, seqlens.window)
    if varlen_kernel(q.device, dropout_p) == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(q, k, v, cu, cu, m, m, dropout_p=dropout_p, window_size=window)
    return _torch_varlen()(q, k, v, cu, cu, m, m, window_size=window)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlens: SeqLens,
    dropout_p: float,
    dense: DenseAttention,
) -> torch.Tensor:
    """Attention within each sequence of a stream. q, k, v: (1, H, T, Dh), the stream as a batch of
    one (so the variants' `qkv` and head split run unchanged) -> (1, H, T, Dh).

    A fused kernel where the device has one for this dtype and dropout; otherwise `dense` (the
    module's own padded-path kernel, unmasked) on each sequence's slice: the same arithmetic as the
    padded path on that sequence, the padding left out."""
    half = q.dtype in (torch.float16, torch.bfloat16)
    if half and varlen_kernel(q.device, dropout_p) is not None:
        out = _fused(*(t[0].transpose(0, 1) for t in (q, k, v)), seqlens, dropout_p)  # (T, H, Dh)
        return out.transpose(0, 1)[None]
    return per_sequence_attention(q, k, v, seqlens, dense)


def per_sequence_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: SeqLens, dense: DenseAttention
) -> torch.Tensor:
    """The reference: `dense` on each sequence's slice of the (1, H, T, Dh) stream, unmasked, or with
    the band of a local attention layer (`SeqLens.windowed`)."""
    bounds = seqlens.bounds()
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            key = k[:, :, a:b]
            band = None if seqlens.window is None else band_mask(b - a, seqlens.window, q.device)
            outs.append(dense(q[:, :, a:b], key, key if v is k else v[:, :, a:b], band))  # (1, H, L, Dh)
    return torch.cat(outs, dim=2) if outs else q.new_empty(q.shape)
