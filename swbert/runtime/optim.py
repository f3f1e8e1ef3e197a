"""Optimizer, parameter groups and learning-rate schedule: one set for pretraining and fine-tuning."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from swbert.runtime.extensions import StaleBuildLock, load_op

OptimizerKind = Literal["auto", "torch_adamw", "fused_adam", "cpu_adam"]
Schedule = Literal["linear", "cosine", "constant", "wsd", "one_minus_sqrt"]
# Schedules that hold the peak LR after the warm-up and decay only in the last fraction of the run
# (ours: the paper's schedule is BERT's linear decay). wsd decays linearly (warmup-stable-decay, as
# MiniCPM: Hu et al. 2024); one_minus_sqrt decays as 1 - sqrt(progress) (Hägele et al. 2024, "Scaling
# Laws and Compute-Optimal Training Beyond Fixed Training Durations").
STABLE_THEN_DECAY = ("wsd", "one_minus_sqrt")
DEFAULT_DECAY_FRACTION = 0.2  # ours: the last 20% of the steps, Hägele et al.'s usual choice


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
    """AdamW over `param_groups`. auto: DeepSpeed's C++ CPU Adam under ZeRO optimizer offload, else
    torch_adamw. torch_adamw is torch's AdamW, its fused kernel on GPU (one kernel for all
    parameters, its step counts on the device: no host sync, nothing to build). fused_adam is
    DeepSpeed's FusedAdam, compiled with nvcc at first use (see `fused_adam`)."""
    kind = resolve_optimizer(kind, offload)
    if offload and kind != "cpu_adam":
        raise ValueError(
            f"--optimizer {kind} cannot run with ZeRO optimizer offload; use --optimizer cpu_adam (or auto)"
        )
    groups = param_groups(model, weight_decay)
    if kind == "fused_adam":
        return fused_adam()(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True)
    if kind == "cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder

        load_op(CPUAdamBuilder(), "--optimizer cpu_adam")
        return DeepSpeedCPUAdam(groups, lr=lr, betas=betas, eps=eps, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=on_gpu)


def resolve_optimizer(kind: OptimizerKind, offload: bool) -> OptimizerKind:
    """What `auto` means: DeepSpeed's CPU Adam under ZeRO optimizer offload, else torch's AdamW."""
    if kind == "auto":
        return "cpu_adam" if offload else "torch_adamw"
    return kind


def apply_hyperparameters(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
) -> list[str]:
    """Set the run's optimizer settings on an optimizer and schedule restored from a checkpoint;
    returns what changed ("lr: 0.002 -> 0.001").

    A checkpoint restores the optimizer's groups (betas, eps, weight decay) and the schedule's peak
    LR (`base_lrs`) as they were saved, so a new `--lr` or `--weight-decay` given on resume was
    silently ignored. The schedule's shape (warm-up, decay, floor) is never saved: it always comes
    from the config. Groups are `param_groups`' order: decayed first, then the undecayed ones."""
    changes: list[str] = []

    def put(group: dict, key: str, value: object) -> None:
        if key in group and group[key] != value:
            changes.append(f"{key}: {group[key]!r} -> {value!r}")
        group[key] = value

    for i, group in enumerate(optimizer.param_groups):
        put(group, "betas", tuple(betas))
        put(group, "eps", eps)
        if i == 0:
            put(group, "weight_decay", weight_decay)
        group["initial_lr"] = lr
    old = scheduler.base_lrs
    if any(b != lr for b in old):
        changes.append(f"lr: {old[0]!r} -> {lr!r}")
    scheduler.base_lrs = [lr] * len(old)
    factors = [fn(scheduler.last_epoch) for fn in scheduler.lr_lambdas]
    for group, factor in zip(optimizer.param_groups, factors):
        group["lr"] = lr * factor  # in effect from the next step on
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    return list(dict.fromkeys(changes))  # once each, not per group


def fused_adam() -> type[torch.optim.Optimizer]:
    """DeepSpeed's FusedAdam class with its op built (or loaded from the extension cache).

    The op is compiled with nvcc at first use, by every rank at once: without a CUDA toolkit
    matching torch's CUDA each rank fails with pages of compiler output. That becomes one error that
    names the fix; a build killed midway is handled by `extensions.load_op`."""
    instead = "or run with --optimizer torch_adamw (torch's fused AdamW: nothing to build)"
    try:
        from deepspeed.ops.adam import FusedAdam
        from deepspeed.ops.op_builder import FusedAdamBuilder

        load_op(FusedAdamBuilder(), "--optimizer fused_adam")
    except StaleBuildLock as err:
        raise ValueError(f"{err}, {instead}") from None
    except Exception as err:  # noqa: BLE001 - any import or build failure is reported the same way
        cause = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        needs = (
            f"with nvcc, from a CUDA toolkit matching torch's CUDA {torch.version.cuda} (CUDA_HOME)"
            if torch.version.cuda
            else "with a C++ compiler (this torch has no CUDA)"
        )
        raise ValueError(
            f"--optimizer fused_adam: DeepSpeed's FusedAdam could not be built ({type(err).__name__}: "
            f"{cause}); it is compiled at first use {needs}: install that, {instead}"
        ) from None
    return FusedAdam


def decay_start(total: int, warmup: int, schedule: Schedule, decay_fraction: float) -> int:
    """The first step of the decay: right after the warm-up for linear and cosine; for the
    stable-then-decay schedules, `round(decay_fraction x total)` steps before the end (at least one
    step, never inside the warm-up)."""
    if schedule not in STABLE_THEN_DECAY:
        return warmup
    return max(warmup, total - max(1, round(decay_fraction * total)))


def lr_factor(
    total: int,
    warmup: int,
    schedule: Schedule = "linear",
    floor: float = 0.0,
    decay_fraction: float = DEFAULT_DECAY_FRACTION,
) -> Callable[[int], float]:
    """Multiplier of the peak LR at each step: linear warm-up over `warmup` steps, then linear or
    cosine decay to `floor` at `total` (or constant); wsd and one_minus_sqrt stay at the peak until
    `decay_start`, then decay to `floor` at `total`, linearly or as 1 - sqrt(progress)."""
    warmup = max(0, warmup)
    start = decay_start(total, warmup, schedule, decay_fraction)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant" or step < start:
            return 1.0
        progress = min(1.0, (step - start) / max(1, total - start))
        if schedule == "cosine":
            decay = 0.5 * (1 + math.cos(math.pi * progress))
        elif schedule == "one_minus_sqrt":
            decay = 1.0 - math.sqrt(progress)
        else:  # linear, wsd
            decay = 1.0 - progress
        return floor + (1 - floor) * decay

    return factor


def schedule_change(
    old_total: int,
    new_total: int,
    step: int,
    lr: float,
    warmup: int,
    schedule: Schedule,
    floor: float,
    decay_fraction: float = DEFAULT_DECAY_FRACTION,
) -> str:
    """What a resume that changes the run's length (`--train-steps`, `--train-tokens`) does to the LR,
    in words: the schedule is a function of the total, so from the checkpoint's step on the LR follows
    the new one. The schedule does not restart; but a finished linear run resumed to go longer had
    decayed to its floor and is lifted back to where the longer schedule stands at that step."""
    if step >= new_total:
        return f"{new_total} steps instead of {old_total}, and the checkpoint is at step {step}: no step runs"
    before = lr * lr_factor(old_total, warmup, schedule, floor, decay_fraction)(step)
    after = lr * lr_factor(new_total, warmup, schedule, floor, decay_fraction)(step)
    start = decay_start(new_total, warmup, schedule, decay_fraction)
    decay = {
        "linear": "decays linearly",
        "cosine": "follows the cosine",
        "wsd": f"stays until step {start}, decays linearly from there",
        "one_minus_sqrt": f"stays until step {start}, decays as 1 - sqrt(progress) from there",
    }.get(schedule)
    then = (
        f"then {decay} to {lr * floor:.3g} at step {new_total}" if decay else "then stays (constant schedule)"
    )
    return (
        f"the LR schedule now spans {new_total} steps instead of {old_total}: step {step + 1} runs at LR "
        f"{after:.3g} (the saved schedule's {before:.3g}), {then}"
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    total: int,
    warmup: int,
    schedule: Schedule = "linear",
    floor: float = 0.0,
    decay_fraction: float = DEFAULT_DECAY_FRACTION,
) -> torch.optim.lr_scheduler.LambdaLR:
    """`lr_factor` as a scheduler stepped once per optimizer step."""
    factor = lr_factor(total, warmup, schedule, floor, decay_fraction)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
