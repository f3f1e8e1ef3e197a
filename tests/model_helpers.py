"""What the model tests share that the product does not ship: the paper's variant names and the
written-out attention kernel swapped into a model."""

from __future__ import annotations

from typing import TypeVar

from torch import nn

from swbert.models.attention import EagerKernel, SDPAKernel, SelfAttention

# The paper's four attention variants, in its order. The registry (`attention_types()`) holds these
# first; a test that registers a fifth variant compares against this tuple.
PAPER_VARIANTS: tuple[str, ...] = ("standard", "shared", "symmetric", "pairwise")
# Every variant swbert registers: the paper's four, then the baselines of later QKV-sharing work (ours).
BUILTIN_VARIANTS: tuple[str, ...] = (*PAPER_VARIANTS, "qkv_single", "kv_shared")

M = TypeVar("M", bound=nn.Module)


def with_eager_kernels(model: M) -> M:
    """`model` with every attention layer's SDPA kernel replaced by `EagerKernel` (the same
    computation written out, the same dropout rate, the same train/eval mode), in place."""
    for module in model.modules():
        if isinstance(module, SelfAttention) and type(module.kernel) is SDPAKernel:
            module.kernel = EagerKernel(module.kernel.dropout).train(module.kernel.training)
    return model
