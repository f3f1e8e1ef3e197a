"""Sequence parallelism: between the tensor-parallel regions, activations are split along the sequence.

Without it, the LayerNorms, dropouts and residual adds of every layer run on the full (B, S, d)
activations on every rank of a tensor-parallel group; with it each rank keeps (B, S/tp, d) there,
so that activation memory (and the LayerNorm/dropout work) is divided by tp. The all-reduce that
closes a tensor-parallel region becomes a reduce-scatter and the region's entry an all-gather,
which together move the same bytes as the all-reduce (Korthikanti et al., 2022):

    embeddings -> scatter -> [ all-gather -> attention -> reduce-scatter ] -> residual, LN
               -> [ all-gather -> MLP -> reduce-scatter ] -> residual, LN -> ... -> all-gather -> head

megatron-core's sequence-parallel linears gather and scatter along dim 0 of (S, B, d) activations;
swbert's are (B, S, d), so the transitions here act on dim 1, around megatron's layers run in their
plain tensor-parallel mode. Parameters used in the split region (LayerNorms, row-parallel biases)
see only their rank's tokens, so their gradients are summed over the group by a hook.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

_DIM = 1  # the sequence dimension of (B, S, d)


def _all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    tp = group.size()
    out = torch.empty((tp * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # (tp*B, S/tp, d)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out.unflatten(0, (tp, x.shape[0])).transpose(0, 1).flatten(1, 2)  # (B, S, d), rank-major


def _reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    tp = group.size()
    chunks = x.unflatten(_DIM, (tp, x.shape[_DIM] // tp)).transpose(0, 1).flatten(0, 1)  # (tp*B, S/tp, d)
    out = torch.empty((x.shape[0], x.shape[_DIM] // tp, *x.shape[2:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, chunks.contiguous(), group=group)
    return out


def _own_chunk(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x.chunk(group.size(), dim=_DIM)[group.rank()].contiguous()


def _region(name: str, forward: Callable, backward: Callable, doc: str) -> type[torch.autograd.Function]:
    """An autograd function applying `forward(x, group)`, whose backward is `backward(grad, group)`."""

    def fwd(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return forward(x, group)

    def bwd(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return backward(grad, ctx.group), None

    body = {"forward": staticmethod(fwd), "backward": staticmethod(bwd), "__doc__": doc}
    return type(name, (torch.autograd.Function,), {**body, "__module__": __name__})


_Scatter = _region(
    "_Scatter",
    _own_chunk,
    _all_gather_seq,
    "Keep this rank's sequence chunk; backward: all-gather the gradient.",
)
_Gather = _region(
    "_Gather",
    _all_gather_seq,
    _reduce_scatter_seq,
    "All-gather the sequence; backward: reduce-scatter (each rank's copy fed its own heads/columns).",
)
_GatherForHead = _region(
    "_GatherForHead",
    _all_gather_seq,
    _own_chunk,
    "All-gather the sequence for the (replicated) MLM head; backward: this rank's chunk.",
)
_ReduceScatter = _region(
    "_ReduceScatter",
    _reduce_scatter_seq,
    _all_gather_seq,
    "Sum partial results over the group, keeping this rank's chunk; backward: all-gather.",
)


def reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, S, d) partial sums -> (B, S/tp, d) summed: the exit of a tensor-parallel region."""
    return _ReduceScatter.apply(x, group)


def gather_seq_pre_hook(group: dist.ProcessGroup):
    """Forward pre-hook for a tensor-parallel region (attention, MLP): (B, S/tp, d) -> (B, S, d)."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        return (_Gather.apply(x, group), *rest)

    return hook


def scatter_output_hook(group: dist.ProcessGroup):
    """Forward hook on the embeddings: enter the split region with this rank's sequence chunk."""

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        S = out.shape[_DIM]
        if S % group.size():
            raise ValueError(
                f"sequence length {S} is not divisible by --tensor-parallel {group.size()} with sequence "
                f"parallelism: pad batches to a multiple of {group.size()} tokens (e.g. --seq-len)"
            )
        return _Scatter.apply(out, group)

    return hook


def gather_encoder_output_hook(group: dist.ProcessGroup):
    """Forward hook on the encoder: the head gets the full sequence (hidden_states stay split)."""

    def hook(module: nn.Module, args: tuple, out: tuple) -> tuple:
        x, hidden_states = out
        return _GatherForHead.apply(x, group), hidden_states

    return hook


def sum_grad_over_group(param: nn.Parameter, group: dist.ProcessGroup) -> None:
    """A parameter applied to this rank's tokens only: add the other ranks' gradient contributions."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    param.register_hook(hook)
    param.sequence_parallel = True  # megatron's tag for the same kind of parameter
