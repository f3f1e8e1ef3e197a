"""Self-attention variants of the paper, one small class each, and the inner kernels.

Every variant maps hidden states to per-head queries, keys and values; the kernel, the output
projection and everything around them are common. Head counts are read off tensor shapes, so a
tensor-parallel wrapper that shards the projections by heads needs no change here.

    standard   Q = X Wq + bq,  K = X Wk + bk,  V = X Wv + bv
    shared     S = X Ws + bs;  Q = S * dq,  K = S * dk,  V = S * dv     (dq, dk, dv in R^d)
               (bs is ours: the paper's Table 3 has no bias; `shared_bias=False` is its exact form)
    symmetric  Q = X Wq + bq,  K = Q,  V = X Wv + bv
    pairwise   Q = X Wq + bq,  V = X Wv + bv;  scores Q U Q^T with one Dh x Dh U per head

Projections that read the same input are one GEMM: standard's Wq, Wk, Wv are one (3d x d) matrix,
symmetric's and pairwise's Wq, Wv one (2d x d) matrix (`in_proj`), as Megatron and NVIDIA's BERT do.
Its rows are head-interleaved, (H, parts, Dh): head h's rows of Wq, then of Wk, then of Wv, then
head h+1's. So a split by contiguous rows is a split by heads (tensor parallelism needs nothing
new), and the separate matrices are a reshape away (`pack_heads` / `unpack_heads`): Hugging Face
folders and BERT's weights hold them separately (`swbert.models.hf_weights`, `swbert.convert`).

One path for every device: PyTorch's own ops, the fused `scaled_dot_product_attention` kernel.
Device-specific kernels are swapped in from outside (`swbert.runtime.cpu`), never chosen here.

A variant is one class that knows itself: `@register_attention(name)` makes its name a valid
`attention_type`, and the class carries every fact the rest of swbert needs (its tensor-parallel
plan, parameter and FLOP counts, activation memory, initialisation, whether it is BERT's), so
nothing outside this file keys on a variant's name. Counts are read off a module built on the
meta device (`meta_attention`), never written a second time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar, Literal, TypeVar, get_args

import torch
import torch.nn.functional as F
from torch import nn

from swbert.models.plugins import ENTRY_POINT_GROUP, load_installed
from swbert.models.positions import Rotary, apply_rotary
from swbert.models.varlen import SeqLens, per_sequence_attention, varlen_attention

if TYPE_CHECKING:  # a type only: config.py imports this module to validate `attention_type`
    from swbert.models.config import SWBertConfig

# positions to keep: (batch indices, sequence indices), row-major, as `mask.nonzero(as_tuple=True)`
Rows = tuple[torch.Tensor, torch.Tensor]
# what the kernel is told about which keys a query sees: a (B, 1, 1, S) key padding mask, nothing
# (every key), or the sequence boundaries of an unpadded stream given as a batch of one
Mask = torch.Tensor | SeqLens | None

# How tensor parallelism splits a submodule or parameter of an attention layer (swbert.parallel.plan):
#   column  an nn.Linear by output features, i.e. by heads (`split_heads` is head-major)
#   row     an nn.Linear by input features, its output all-reduced (the bias added once, after)
#   heads   a per-head parameter, by its first dimension (head-major, like the features)
Split = Literal["column", "row", "heads"]


def pack_heads(parts: Sequence[torch.Tensor], head_dim: int) -> torch.Tensor:
    """Separate projections' weights (or biases), each (H*Dh, ...), as one head-interleaved tensor
    (H*n*Dh, ...) with rows ordered (H, n, Dh): head h of part 0, of part 1, ..., then head h+1."""
    stacked = torch.stack([p.reshape(-1, head_dim, *p.shape[1:]) for p in parts], dim=1)  # (H, n, Dh, ...)
    return stacked.reshape(-1, *parts[0].shape[1:])


def unpack_heads(packed: torch.Tensor, n: int, head_dim: int) -> list[torch.Tensor]:
    """The inverse of `pack_heads`: n tensors (H*Dh, ...), each contiguous."""
    per_head = packed.reshape(-1, n, head_dim, *packed.shape[1:])  # (H, n, Dh, ...)
    return [t.reshape(-1, *packed.shape[1:]).contiguous() for t in per_head.unbind(dim=1)]


class SDPAKernel(nn.Module):
    """`scaled_dot_product_attention`: flash / memory-efficient / cuDNN kernels on GPU. Given the
    sequence boundaries of an unpadded stream instead of a mask, attention within each sequence
    (`swbert.models.varlen.varlen_attention`: a fused varlen kernel on GPU, else `dense` per sequence)."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor:
        # q, k, v: (B, H, S, Dh); mask: (B, 1, 1, S) bool, True where a key may be attended; or
        # SeqLens with B = 1 and S the stream's tokens
        if isinstance(mask, SeqLens):
            return varlen_attention(q, k, v, mask, self.dropout if self.training else 0.0, self.dense)
        return self.dense(q, k, v, mask)

    def dense(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention over a padded batch (the kernel a device-specific subclass replaces)."""
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)


class EagerKernel(nn.Module):
    """The same computation written out, its dropout an `nn.Dropout` module (unpadded: per sequence).

    Not a model setting: every model builds `SDPAKernel`. Tensor parallelism runs this one in
    training with attention dropout, its dropout replaced (`swbert.parallel.layers.TensorParallelKernel`),
    and tests hold the fused kernel to it."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor:
        if isinstance(mask, SeqLens):
            return per_sequence_attention(q, k, v, mask, self.dense)  # (1, H, T, Dh)
        return self.dense(q, k, v, mask)

    def dense(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, S, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.dropout(scores.softmax(dim=-1)) @ v  # (B, H, S, Dh)


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
    """Common part: split heads, run the kernel, merge heads, project out.

    A variant subclasses this, implements `qkv`, declares the class facts below and registers
    with `@register_attention(name)`. What it must declare: `qkv_plan`. What it may override:
    `output_scale` and `paper_qkv` (a cheaper computed form), `packed`, `activation_units`,
    `table_forms`, `bert_equivalent`, `init_parameters`, `extra_flops_per_token`,
    `closed_form_qkv_params`, `fold_for_inference`. Parameter and GEMM counts are derived; every
    variant runs the one `forward`.
    """

    attention_type: ClassVar[str] = ""  # the registered name, set by `register_attention`
    # Tensor-parallel split of every submodule/parameter that produces Q, K and V, by attribute
    # name. Every parameter must be placed: one left whole would get a gradient from this rank's
    # heads only. `tp_plan()` adds the common output projection.
    qkv_plan: ClassVar[Mapping[str, Split]] = {}
    # Fused projections: attribute -> the separate projections (attribute names) it packs, in row
    # order, head-interleaved (`pack_heads`). Hugging Face folders store the separate form
    # (swbert.models.hf_weights); checkpoints hold the fused one.
    packed: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    # Activation bytes per token per layer kept for backward, in units of d at 16 bits (Korthikanti
    # et al., 2022; see swbert.scaling.memory): 34 for attention that keeps Q, K and V apart (6 of
    # the 34) as BERT's does. A variant that keeps fewer tensors says so.
    activation_units: ClassVar[int] = 34
    # Other configurations of the variant that parameter tables list next to its default: a row
    # label -> the SWBertConfig fields that make it (shared: without its bias bs, the paper's form).
    table_forms: ClassVar[Mapping[str, Mapping[str, object]]] = {}
    # True when the variant is transformers' BERT attention, so the model converts to BertFor*
    # (swbert.convert) with the same numerics.
    bert_equivalent: ClassVar[bool] = False

    def __init__(self, config: SWBertConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        # the one kernel; a CPU's or tensor parallelism's replacement is put in from outside
        self.kernel = SDPAKernel(config.attention_probs_dropout_prob)
        self.out_proj = OutProjection(config.hidden_size, config.hidden_size)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The queries, keys and values the kernel reads, each (B, H, S, Dh). A variant may compute
        them in a cheaper form than its paper writes them, moving a per-feature scale of the values
        to `output_scale` (`paper_qkv` then gives the literal form)."""
        raise NotImplementedError

    def output_scale(self) -> torch.Tensor | None:
        """A per-feature scale of the attention output (of the values, which it commutes with),
        applied through the output projection's d x d weight instead of every token (None: none)."""
        return None

    def paper_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K and V as the variant's paper writes them, with the values scaled: the reference the
        tests hold `forward` to (the same as `qkv` unless the variant computes a cheaper form)."""
        return self.qkv(x)

    @torch.no_grad()
    def init_parameters(self) -> None:
        """Set the parameters this class holds directly to their initial values.

        The model's `_init_weights` calls it; the nn.Linear children are initialised there like every
        other linear layer. Nothing to do by default."""

    @classmethod
    def tp_plan(cls) -> dict[str, Split]:
        """The tensor-parallel split of every submodule/parameter: `qkv_plan` and the row-parallel
        output projection (one all-reduce per layer)."""
        return {**cls.qkv_plan, "out_proj": "row"}

    def qkv_parameters(self) -> int:
        """Parameters that produce Q, K and V (this module's, less the common output projection)."""
        return sum(p.numel() for name, p in self.named_parameters() if not name.startswith("out_proj."))

    def projection_weights(self) -> int:
        """Weight entries of the column-split linears: the Q/K/V GEMMs that every token goes through."""
        return sum(getattr(self, attr).weight.numel() for attr, s in self.qkv_plan.items() if s == "column")

    def extra_flops_per_token(self) -> int:
        """Forward FLOPs per token of other products that MFU counts (elementwise work is not counted)."""
        return 0

    @classmethod
    def closed_form_qkv_params(cls, config: SWBertConfig) -> int | None:
        """The documented formula for `qkv_parameters`, held equal to it by tests; None if there is none.

        A new variant needs none: every count is read off the module itself."""
        return None

    def fold_for_inference(self) -> None:
        """Rewrite parameters into a cheaper form computing the same function (a no-op by default)."""

    def split_heads(self, t: torch.Tensor) -> torch.Tensor:
        B, S, _ = t.shape
        return t.view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, H, S, Dh)

    def split_packed_heads(self, t: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
        """The output of a head-interleaved projection of n parts, (B, S, H*n*Dh), as n tensors
        (B, H, S, Dh): views, no copy (the kernel reads strided inputs)."""
        B, S, _ = t.shape
        return t.view(B, S, -1, n, self.head_dim).transpose(1, 2).unbind(dim=3)  # n x (B, H, S, Dh)

    def merge_heads(self, y: torch.Tensor, rows: Rows | None) -> torch.Tensor:
        """(B, H, S, Dh) -> (B, S, H*Dh), or (N, H*Dh) at the `rows` positions."""
        y = y.transpose(1, 2)  # (B, S, H, Dh)
        if rows is not None:
            return y[rows].flatten(1)  # (N, H*Dh): gathers only the kept rows
        return y.reshape(*y.shape[:2], -1)

    def forward(
        self, x: torch.Tensor, mask: Mask = None, rows: Rows | None = None, rotary: Rotary | None = None
    ) -> torch.Tensor:
        """x: (B, S, d) -> (B, S, d). With `rows`, only those positions come out, (N, d): every
        position is still a key and a value, but the output projection runs on N rows. Every
        variant runs this forward; it differs only in `qkv` and `output_scale`.

        With `rotary` (cos, sin) the queries and keys are rotated by position before the kernel. They
        are then `paper_qkv`'s, the variant's own: a rotation does not commute with a per-feature scale
        moved from the keys to the queries (shared's `qkv` moves dk), so the cheaper form would be
        another model. The values come scaled, and there is no output scale."""
        if rotary is None:
            q, k, v = self.qkv(x)
            scale = self.output_scale()
        else:
            q, k, v = self.paper_qkv(x)
            q, k = apply_rotary(q, k, rotary)
            scale = None
        y = self.kernel(q, k, v, mask)  # (B, H, S, Dh)
        return self.out_proj(self.merge_heads(y, rows), input_scale=scale)


def pack_state_dict(
    state: dict[str, torch.Tensor], prefix: str, packed: Mapping[str, Sequence[str]], head_dim: int
) -> None:
    """In place: where `state` holds every separate projection a fused one packs (under `prefix`),
    replace them by the fused entry. Partial sets are left alone (load_state_dict names them)."""
    for fused, parts in packed.items():
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{part}.{kind}" for part in parts]
            if all(k in state for k in keys):
                state[f"{prefix}{fused}.{kind}"] = pack_heads([state.pop(k) for k in keys], head_dim)


def unpack_state_dict(
    state: dict[str, torch.Tensor], prefix: str, packed: Mapping[str, Sequence[str]], head_dim: int
) -> None:
    """In place: the inverse of `pack_state_dict` (the fused entries become the separate ones)."""
    for fused, parts in packed.items():
        for kind in ("weight", "bias"):
            key = f"{prefix}{fused}.{kind}"
            if key in state:
                for part, t in zip(parts, unpack_heads(state.pop(key), len(parts), head_dim)):
                    state[f"{prefix}{part}.{kind}"] = t


_REGISTRY: dict[str, type[SelfAttention]] = {}
# name -> class, in registration order; a read-only view (register with `register_attention`)
ATTENTION_CLASSES: Mapping[str, type[SelfAttention]] = MappingProxyType(_REGISTRY)
A = TypeVar("A", bound=type[SelfAttention])


def register_attention(name: str) -> Callable[[A], A]:
    """Class decorator: `name` becomes a valid `attention_type` building this class.

    Registering the same class again under its name is a no-op; another class under a taken name is
    an error (unregister the old one first).
    """

    def register(cls: A) -> A:
        if not (isinstance(cls, type) and issubclass(cls, SelfAttention)):
            raise TypeError(f"register_attention({name!r}): {cls!r} is not a subclass of SelfAttention")
        if not name or not isinstance(name, str):
            raise ValueError(f"register_attention: the name must be a non-empty string, got {name!r}")
        if _REGISTRY.get(name, cls) is not cls:
            raise ValueError(
                f"attention_type {name!r} is already registered to {_REGISTRY[name].__qualname__}; "
                f"unregister_attention({name!r}) first or choose another name"
            )
        bad = {attr: split for attr, split in cls.tp_plan().items() if split not in get_args(Split)}
        if bad:
            raise ValueError(f"{cls.__qualname__}.qkv_plan: {bad} are not among {get_args(Split)}")
        cls.attention_type = name
        _REGISTRY[name] = cls
        return cls

    return register


def unregister_attention(name: str) -> None:
    """Remove a registered variant (for tests and plugins that registered one for a while)."""
    attention_class(name)  # the same error as an unknown name elsewhere
    del _REGISTRY[name]


def attention_types() -> tuple[str, ...]:
    """The registered variant names, in registration order (the four of the paper first)."""
    return tuple(_REGISTRY)


def attention_class(name: str) -> type[SelfAttention]:
    """The class registered as `name` (after importing the installed plugins, when it is not yet);
    a ValueError listing the registered names otherwise."""
    if name not in _REGISTRY:
        load_installed()
    if name not in _REGISTRY:
        raise ValueError(
            f"attention_type={name!r} is not one of {', '.join(_REGISTRY)} (the registered attention "
            "variants; a new one registers with @swbert.models.attention.register_attention, in a module "
            "the launchers import with --plugins MODULE_OR_FILE or from an installed package's "
            f"{ENTRY_POINT_GROUP!r} entry point)"
        )
    return _REGISTRY[name]


def build_attention(config: SWBertConfig) -> SelfAttention:
    """The one place where `config.attention_type` picks a class."""
    return attention_class(config.attention_type)(config)


def meta_attention(config: SWBertConfig) -> SelfAttention:
    """The attention layer of `config` built on the meta device: shapes and counts, no memory."""
    with torch.device("meta"):
        return build_attention(config)


@register_attention("standard")
class StandardAttention(SelfAttention):
    """Wq, Wk, Wv with biases: BERT's attention, computed as one (3d x d) GEMM (`in_proj`, head-
    interleaved: see the module docstring)."""

    qkv_plan = {"in_proj": "column"}  # by heads: each rank's rows hold whole heads' Wq, Wk, Wv
    packed = {"in_proj": ("q_proj", "k_proj", "v_proj")}  # BERT's query, key, value
    bert_equivalent = True

    @classmethod
    def closed_form_qkv_params(cls, config: SWBertConfig) -> int:
        d = config.hidden_size
        return 3 * (d * d + d)  # Wq, Wk, Wv and their biases

    def __init__(self, config: SWBertConfig) -> None:
        super().__init__(config)
        d = config.hidden_size
        self.in_proj = nn.Linear(d, 3 * d)  # [Wq; Wk; Wv] head-interleaved, (H, 3, Dh) rows

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.split_packed_heads(self.in_proj(x), 3)  # (B, S, 3d) -> 3 x (B, H, S, Dh)
        return q, k, v


@register_attention("shared")
class SharedAttention(SelfAttention):
    """One projection S = X Ws + bs; Q, K, V are S scaled elementwise by dq, dk, dv.

    The bias bs is our choice (config.shared_bias, default True, which checkpoints trained so far
    have); the paper's Table 3 counts d^2 + 3d parameters, Ws and the diagonals, without it.

    The diagonal matrices of the paper are stored as vectors (initialised to ones, so training
    starts from Q = K = V = S). Since Q K^T = S diag(dq * dk) S^T, the pre-softmax scores are
    symmetric in the tokens.
    """

    # rank r holds the rows of Ws, bs, dq, dk, dv for its heads: Q, K, V with no communication
    qkv_plan = {"proj": "column", "dq": "heads", "dk": "heads", "dv": "heads"}
    # keeps S and Q = S * (dq*dk) for backward (see `qkv`): the keys and values are S itself
    activation_units = 32
    table_forms = {"shared, no bs": {"shared_bias": False}}  # the paper's Table 3: d^2 + 3d per layer

    @classmethod
    def closed_form_qkv_params(cls, config: SWBertConfig) -> int:
        d = config.hidden_size
        bias = d if config.shared_bias else 0  # bs is ours; the paper's Table 3 has d^2 + 3d
        return d * d + bias + 3 * d  # Ws, bs and the diagonals dq, dk, dv

    def __init__(self, config: SWBertConfig) -> None:
        super().__init__(config)
        d = config.hidden_size
        # bs: our addition (the paper counts none); config.shared_bias=False is the paper's exact form
        self.proj = nn.Linear(d, d, bias=config.shared_bias)
        self.dq = nn.Parameter(torch.empty(d))
        self.dk = nn.Parameter(torch.empty(d))
        self.dv = nn.Parameter(torch.empty(d))
        self.init_parameters()

    @torch.no_grad()
    def init_parameters(self) -> None:
        """The diagonals start at ones: Q = K = V = S."""
        for p in (self.dq, self.dk, self.dv):
            p.fill_(1.0)

    def paper_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K, V as the paper writes them: S = X Ws + bs, Q = S diag(dq), K = S diag(dk), V = S diag(dv)."""
        s = self.proj(x)  # (B, S, d): one GEMM instead of three
        return self.split_heads(s * self.dq), self.split_heads(s * self.dk), self.split_heads(s * self.dv)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The paper's attention computed with less work. Two identities, both exact:
            Q K^T = S diag(dq) diag(dk) S^T = (S diag(dq * dk)) S^T  -> keys are S, queries S * (dq * dk)
            A V   = A S diag(dv)            = (A S) diag(dv)        -> values are S, dv the output scale
        so one (B, S, d) product S serves as keys and values, and dv costs a d x d pass, not a
        (B, S, d) one."""
        s = self.split_heads(self.proj(x))  # (B, H, S, Dh)
        return s * (self.dq * self.dk).view(-1, 1, self.head_dim), s, s  # scales: (H, 1, Dh)

    def output_scale(self) -> torch.Tensor:
        return self.dv

    @torch.no_grad()
    def fold_for_inference(self) -> None:
        """Fold the diagonals into the projections and become a class that computes the same
        function with less work (`_FoldedQuery` or `_FoldedProjection`).

        dv moves into the output projection (the second identity of `qkv`). When every entry of
        p = dq*dk is positive, S diag(p) S^T = S' S'^T with S' = S diag(sqrt(p)), so sqrt(p) moves
        into `proj` (and 1/sqrt(p) into the output projection): Q = K = V = S', no elementwise work
        at all. Otherwise p stays on the query side. Afterwards the diagonals that moved are ones, so
        the parameters still describe a valid shared layer (a saved state dict loads into an unfolded
        model with the same outputs). Meant for inference: a folded layer leaves them unused.
        """
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
            self.__class__ = _FoldedProjection
        else:
            self.dq.copy_(p)
            self.__class__ = _FoldedQuery
        scale_(self.out_proj.weight, out_scale)  # (out, in): scales the input columns
        self.dk.fill_(1.0)
        self.dv.fill_(1.0)


class _FoldedQuery(SharedAttention):
    """A shared layer after `fold_for_inference` with dq*dk in dq (some entry not positive) and dv
    in the output projection: queries S * dq, keys and values S. Not registered: its config is
    `shared`, and its parameters load into one."""

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.split_heads(self.proj(x))  # (B, H, S, Dh)
        return s * self.dq.view(-1, 1, self.head_dim), s, s

    def output_scale(self) -> None:
        return None

    def fold_for_inference(self) -> None:
        """Already folded."""


class _FoldedProjection(_FoldedQuery):
    """A shared layer after `fold_for_inference` with every scale in the projections: Q = K = V = S'."""

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.split_heads(self.proj(x))  # (B, H, S, Dh)
        return s, s, s


@register_attention("symmetric")
class SymmetricAttention(SelfAttention):
    """Keys are the queries (no Wk): scores Q Q^T are symmetric. Wq, Wv are one (2d x d) GEMM."""

    qkv_plan = {"in_proj": "column"}
    packed = {"in_proj": ("q_proj", "v_proj")}
    activation_units = 32  # no separate keys to keep

    @classmethod
    def closed_form_qkv_params(cls, config: SWBertConfig) -> int:
        d = config.hidden_size
        return 2 * (d * d + d)  # Wq, Wv and their biases (K = Q)

    def __init__(self, config: SWBertConfig) -> None:
        super().__init__(config)
        d = config.hidden_size
        self.in_proj = nn.Linear(d, 2 * d)  # [Wq; Wv] head-interleaved, (H, 2, Dh) rows

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, v = self.split_packed_heads(self.in_proj(x), 2)  # 2 x (B, H, S, Dh)
        return q, q, v


@register_attention("pairwise")
class PairwiseAttention(SelfAttention):
    """Scores Q U Q^T with a learned Dh x Dh matrix U per head (no bias), i.e. K = Q U^T.

    U starts as the identity, so training starts from symmetric attention. Wq, Wv are one (2d x d)
    GEMM, as in symmetric.
    """

    qkv_plan = {"in_proj": "column", "pair": "heads"}
    packed = {"in_proj": ("q_proj", "v_proj")}
    # keeps Q, K = Q U^T and V, as standard keeps Q, K and V: the default 34 units

    @classmethod
    def closed_form_qkv_params(cls, config: SWBertConfig) -> int:
        d, h, dh = config.hidden_size, config.num_attention_heads, config.head_dim
        return 2 * (d * d + d) + h * dh * dh  # Wq, Wv and one Dh x Dh U per head

    def __init__(self, config: SWBertConfig) -> None:
        super().__init__(config)
        d, h, dh = config.hidden_size, config.num_attention_heads, config.head_dim
        self.in_proj = nn.Linear(d, 2 * d)  # [Wq; Wv] head-interleaved, (H, 2, Dh) rows
        self.pair = nn.Parameter(torch.empty(h, dh, dh))  # (H, Dh, Dh)
        self.init_parameters()

    @torch.no_grad()
    def init_parameters(self) -> None:
        """Every U starts as the identity: the layer starts as symmetric attention."""
        eye = torch.eye(self.pair.shape[-1], device=self.pair.device, dtype=self.pair.dtype)
        self.pair.copy_(eye.expand_as(self.pair))

    def extra_flops_per_token(self) -> int:
        """K = Q U^T: a Dh x Dh product per head and token, 2 H Dh^2 = 2 d Dh FLOPs."""
        return 2 * self.pair.numel()

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, v = self.split_packed_heads(self.in_proj(x), 2)  # 2 x (B, H, S, Dh)
        k = q @ self.pair.transpose(-1, -2)  # (B, H, S, Dh): q_i . k_j = q_i U q_j^T
        return q, k, v


# ---- baselines of later QKV-sharing work (ours: not variants of the paper) ----------------------


@register_attention("qkv_single")
class SingleProjectionAttention(SelfAttention):
    """Q = K = V = S = X Ws + bs: one projection and no diagonal scales, i.e. the shared variant
    with dq = dk = dv fixed at 1 (ours: a baseline from later QKV-sharing work, not the paper's).

    The bias follows `config.shared_bias`, as the shared variant's, so a shared layer with ones
    on its diagonals computes the same function from the same Ws and bs."""

    qkv_plan = {"proj": "column"}  # rank r holds the rows of Ws, bs for its heads
    # keeps S only for backward: the queries, keys and values are one tensor
    activation_units = 30
    table_forms = {"qkv_single, no bs": {"shared_bias": False}}

    @classmethod
    def closed_form_qkv_params(cls, config: SWBertConfig) -> int:
        d = config.hidden_size
        return d * d + (d if config.shared_bias else 0)  # Ws and bs

    def __init__(self, config: SWBertConfig) -> None:
        super().__init__(config)
        d = config.hidden_size
        self.proj = nn.Linear(d, d, bias=config.shared_bias)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.split_heads(self.proj(x))  # (B, H, S, Dh)
        return s, s, s


@register_attention("kv_shared")
class SharedKeyValueAttention(SymmetricAttention):
    """Q = X Wq + bq;  K = V = X Wkv + bkv: the queries keep their own projection, the keys and
    values share one (ours: a baseline from later QKV-sharing work, not the paper's). Symmetric's
    layout and counts (Wq and one more d x d projection as one head-interleaved GEMM, split by heads
    under TP) with the second projection feeding keys and values instead of values alone."""

    packed = {"in_proj": ("q_proj", "kv_proj")}

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, kv = self.split_packed_heads(self.in_proj(x), 2)  # 2 x (B, H, S, Dh)
        return q, kv, kv
