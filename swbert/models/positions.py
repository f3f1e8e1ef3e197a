"""Rotary positions and local attention masks: the two options beside BERT's learned positions and
global attention (both ours, not the paper's; see docs/models.md).

Rotary positions (RoFormer; transformers' rotate-half convention): each head's queries and keys are
rotated by their token's position, feature i paired with feature i + Dh/2 and turned by the angle
p * theta^(-2i/Dh), so a score depends on the two positions only through their offset. The cos and
sin tables are computed in every forward from the position ids (O(S Dh) work, nothing next to a
layer): no buffers, so nothing to save, broadcast, shard or convert to 16 bits, and a resume with
another `rope_theta` (context extension) computes the new angles from the config.

Local attention (ModernBERT's): a query sees the keys within `local_attention_window // 2` positions
each side, given to the kernel as a boolean band combined with the padding mask, or as a window on
the sequence boundaries of an unpadded stream (`SeqLens.windowed`).
"""

from __future__ import annotations

import torch
from torch import nn

from swbert.models.varlen import SeqLens, band_mask

# what the attention layers receive for rotary positions: (cos, sin), each (B or 1, 1, S, Dh)
Rotary = tuple[torch.Tensor, torch.Tensor]


class RotaryEmbedding(nn.Module):
    """Position ids -> the (cos, sin) tables every layer rotates its queries and keys with."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = float(theta)

    def forward(self, position_ids: torch.Tensor) -> Rotary:
        """position_ids: (B, S) or (1, S) -> cos, sin: (B or 1, 1, S, Dh), in fp32."""
        half = torch.arange(0, self.head_dim, 2, device=position_ids.device, dtype=torch.float32)
        inv_freq = 1.0 / (self.theta ** (half / self.head_dim))  # (Dh/2,)
        angles = position_ids.float()[..., None] * inv_freq  # (B, S, Dh/2)
        angles = torch.cat((angles, angles), dim=-1)[:, None]  # (B, 1, S, Dh): feature i and i + Dh/2
        return angles.cos(), angles.sin()

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta:g}"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys (B, H, S, Dh) rotated by position; per head, so a tensor-parallel rank's
    local heads rotate alike. Keys that are the queries (symmetric attention) are rotated once."""
    cos, sin = (t.to(q.dtype) for t in rotary)  # (B, 1, S, Dh): broadcast over the heads
    q_rot = q * cos + rotate_half(q) * sin
    k_rot = q_rot if k is q else k * cos + rotate_half(k) * sin
    return q_rot, k_rot


def local_attention_mask(
    mask: torch.Tensor | SeqLens | None, seq_len: int, half: int, device: torch.device
) -> torch.Tensor | SeqLens:
    """The kernel's mask for a local attention layer: a padded batch's key padding mask (B, 1, 1, S)
    (or none) and the band |i - j| <= `half`, as one (B or 1, 1, S, S) bool mask; an unpadded stream's
    boundaries with the band on each sequence (positions restart there, so the band does too).

    A band is an arbitrary mask to SDPA, which then leaves the flash kernel for the memory-efficient
    (masked) one on a GPU; only the fused variable-length kernels take a band natively."""
    if isinstance(mask, SeqLens):
        return mask.windowed(half)
    band = band_mask(seq_len, half, device)  # (1, 1, S, S)
    if mask is None:
        return band
    # a padding query farther than `half` from every real token would see no key at all: a written-out
    # softmax (the eager kernel) gives NaN there, which reaches real tokens through the next layer's
    # values. It sees itself instead; real queries' keys are unchanged.
    return band & (mask | band_mask(seq_len, 0, device))  # (B, 1, S, S)
