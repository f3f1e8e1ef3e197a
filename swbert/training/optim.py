"""Optimizer, parameter groups and learning-rate schedule: one set for pretraining and fine-tuning."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

OptimizerKind = Literal["auto", "torch_adamw", "fused_adam", "cpu_adam"]
Schedule = Literal["linear", "cosine", "constant"]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """BERT's rule: decay matrices and embeddings; not biases, LayerNorm weights or other 1-D
    parameters (the shared attention's dq/dk/dv scales act like LayerNorm gains)."""
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
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    kind: OptimizerKind = "auto",
    on_gpu: bool = False,
    offload: bool = False,
) -> torch.optim.Optimizer:
    """AdamW over `param_groups`. auto: DeepSpeed's C++ CPU Adam under ZeRO optimizer offload,
    DeepSpeed's fused kernel on GPU, torch's AdamW on CPU. torch_adamw runs torch's fused kernel on
    GPU (the same update, one kernel for all parameters)."""
    if kind == "auto":
        kind = "cpu_adam" if offload else ("fused_adam" if on_gpu else "torch_adamw")
    if offload and kind != "cpu_adam":
        raise ValueError(
            f"--optimizer {kind} cannot run with ZeRO optimizer offload; use --optimizer cpu_adam (or auto)"
        )
    groups = param_groups(model, weight_decay)
    if kind == "fused_adam":
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True)
    if kind == "cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=lr, betas=betas, eps=eps, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=on_gpu)


def lr_factor(
    total: int, warmup: int, schedule: Schedule = "linear", floor: float = 0.0
) -> Callable[[int], float]:
    """Multiplier of the peak LR at each step: linear warm-up over `warmup` steps, then linear or
    cosine decay to `floor` at `total` (or constant)."""
    warmup = max(0, warmup)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "cosine":
            decay = 0.5 * (1 + math.cos(math.pi * progress))
        else:
            decay = 1.0 - progress
        return floor + (1 - floor) * decay

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    total: int,
    warmup: int,
    schedule: Schedule = "linear",
    floor: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """`lr_factor` as a scheduler stepped once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(total, warmup, schedule, floor))
