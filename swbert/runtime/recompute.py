"""What selective activation checkpointing keeps: one set, read by the wrapper that applies it
(`swbert.training.wrappers`) and by the memory estimate that counts it (`swbert.scaling.activations`).

The outputs of the matrix products and of the attention kernel (the costly ops) are kept; the rest
of a block (LayerNorms, GELU, dropout masks, residual adds) is recomputed in the backward: most of
the activation memory of the cheap ops for a few % more compute (the policy of torchtitan's
op-level selective AC; ours).
"""

from __future__ import annotations

import torch

SELECTIVE_SAVED_OPS = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten.linear.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
)
