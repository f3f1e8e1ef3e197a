"""Optimizer and learning-rate schedule, built from the training config."""

from __future__ import annotations

import math

import torch
from torch import nn

from swbert.training.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; not biases, norms or the shared-attention diagonals (1-D)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module, config: TrainConfig, on_gpu: bool, offload: bool
) -> torch.optim.Optimizer:
    """AdamW: DeepSpeed's fused kernel on GPU, its C++ CPU Adam under optimizer offload, else torch's."""
    kind = config.optimizer
    if kind == "auto":
        kind = "cpu_adam" if offload else ("fused_adam" if on_gpu else "torch_adamw")
    if offload and kind != "cpu_adam":
        raise ValueError(
            f"--optimizer {kind} cannot run with ZeRO optimizer offload; use --optimizer cpu_adam (or auto)"
        )
    groups = param_groups(model, config.weight_decay)
    kwargs = dict(lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
    if kind == "fused_adam":
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(groups, adam_w_mode=True, **kwargs)
    if kind == "cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def lr_lambda(config: TrainConfig, total_steps: int):
    """Linear warmup to `lr`, then linear or cosine decay to `min_lr` at `total_steps`."""
    floor = config.min_lr / config.lr if config.lr > 0 else 0.0
    warmup = max(0, config.warmup_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if config.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if config.lr_schedule == "cosine":
            decay = 0.5 * (1 + math.cos(math.pi * progress))
        else:
            decay = 1.0 - progress
        return floor + (1 - floor) * decay

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config, total_steps))
