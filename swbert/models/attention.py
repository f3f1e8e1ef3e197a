"""Self-attention variants of the paper, one small class each, and the inner kernels.

Every variant maps hidden states to per-head queries, keys and values; the kernel, the output
projection and everything around them are common. Head counts are read off tensor shapes, so a
tensor-parallel wrapper that shards the projections by heads needs no change here.

    standard   Q = X Wq + bq,  K = X Wk + bk,  V = X Wv + bv
    shared     S = X Ws + bs;  Q = S * dq,  K = S * dk,  V = S * dv     (dq, dk, dv in R^d)
    symmetric  Q = X Wq + bq,  K = Q,  V = X Wv + bv
    pairwise   Q = X Wq + bq,  V = X Wv + bv;  scores Q U Q^T with one Dh x Dh U per head

One path for every device: PyTorch's own ops, the fused `scaled_dot_product_attention` kernel.
Device-specific kernels are swapped in from outside (`swbert.cpu`), never chosen here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from swbert.models.config import SWBertConfig

# positions to keep: (batch indices, sequence indices), row-major, as `mask.nonzero(as_tuple=True)`
Rows = tuple[torch.Tensor, torch.Tensor]


class SDPAKernel(nn.Module):
    """`scaled_dot_product_attention`: flash / memory-efficient / cuDNN kernels on GPU."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        # q, k, v: (B, H, S, Dh); mask: (B, 1, 1, S) bool, True where a key may be attended
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)


class EagerKernel(nn.Module):
    """The same computation written out, as a reference and for debugging."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, S, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.dropout(scores.softmax(dim=-1)) @ v  # (B, H, S, Dh)


KERNELS: dict[str, type[nn.Module]] = {"sdpa": SDPAKernel, "eager": EagerKernel}


class OutProjection(nn.Linear):
    """The attention output projection. `input_scale` scales the input features through the weight,
    (y diag(s)) W^T = y (W diag(s))^T: one pass over the d x d weight instead of over every token.

    The scaled weight is formed inside this module's forward, so an engine that gathers a module's
    parameters around its forward (ZeRO-3) gathers it here. A tensor-parallel replacement takes
    the same argument (`swbert.parallel.layers.RowLinear`).
    """

    def forward(self, x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if input_scale is None else self.weight * input_scale  # (out, in)
        return F.linear(x, weight, self.bias)


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
        self.folded = ""  # set by fold_for_inference(): "query" or "projection"

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K, V as the paper writes them (`SelfAttention.forward` on these is the reference)."""
        s = self.proj(x)  # (B, S, d): one GEMM instead of three
        return self.split_heads(s * self.dq), self.split_heads(s * self.dk), self.split_heads(s * self.dv)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, rows: Rows | None = None
    ) -> torch.Tensor:
        """The paper's attention on `qkv`, computed with less work. Two identities, both exact:
            Q K^T = S diag(dq) diag(dk) S^T = (S diag(dq * dk)) S^T  -> keys are S, queries S * (dq * dk)
            A V   = A S diag(dv)            = (A S) diag(dv)        -> values are S, dv scales out_proj
        so one (B, S, d) product S serves as keys and values, and dv costs a d x d pass, not a
        (B, S, d) one. After `fold_for_inference` the scales already live in the projections."""
        s = self.split_heads(self.proj(x))  # (B, H, S, Dh)
        qk = self.dq if self.folded else self.dq * self.dk  # folded: dq holds dq * dk
        q = s if self.folded == "projection" else s * qk.view(-1, 1, self.head_dim)  # (H, 1, Dh)
        y = self.merge_heads(self.kernel(q, s, s, mask), rows)  # (B, S, d), or (N, d)
        return self.out_proj(y, input_scale=None if self.folded else self.dv)

    @torch.no_grad()
    def fold_for_inference(self) -> None:
        """Fold the diagonals into the projections; the layer computes the same function.

        dv moves into the output projection (the second identity of `forward`). When every entry of
        p = dq*dk is positive, S diag(p) S^T = S' S'^T with S' = S diag(sqrt(p)), so sqrt(p) moves
        into `proj` (and 1/sqrt(p) into the output projection): Q = K = V = S', no elementwise work
        at all. Otherwise p stays on the query side. Afterwards the diagonals that moved are ones, so
        the parameters still describe a valid shared layer (a saved state dict loads into an unfolded
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
