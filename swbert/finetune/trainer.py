"""The one fine-tuning loop, shared by GLUE and SQuAD.

AdamW (no weight decay on biases, LayerNorm weights and other 1-D scales), linear warm-up then linear
decay, gradient clipping, an evaluation on dev after every epoch, and the best epoch's weights kept and
restored at the end (best-checkpoint selection; optional early stopping with ``patience``). Launched
with a world size above one (``deepspeed`` or ``torchrun``), the same loop runs under
``deepspeed.initialize``; the DeepSpeed config gets its batch size, clipping and precision from here,
so the two cannot disagree.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from swbert.finetune.batching import train_loader
from swbert.finetune.metrics import selection_value
from swbert.runtime.ds_config import BatchShape, Flags, build_ds_config, resolve_precision
from swbert.runtime.optim import build_optimizer, build_scheduler
from swbert.runtime.ranks import ParallelDims

log = logging.getLogger(__name__)


@dataclass
class FinetuneConfig:
    """The hyper-parameters of one fine-tuning run. The sweeps set every field (their flags say where each
    default comes from); these defaults are GLUE's appendix values for the rate, decay and epochs, the
    rest ours."""

    learning_rate: float = 1e-4
    weight_decay: float = 0.1
    epochs: int = 10
    batch_size: int = 32
    """Global batch size: split over ranks, so results do not depend on the number of GPUs."""
    eval_batch_size: int = 128
    warmup_ratio: float = 0.1
    max_grad_norm: float = 1.0
    seed: int = 0
    patience: int = 0
    """Stop after this many epochs without a better dev score (0: run all epochs)."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """auto: bf16 on GPU, fp32 on CPU (as pretraining). Single-process runs use autocast; fp16 needs
    DeepSpeed's loss scaling."""
    max_steps: int | None = None
    """Stop after this many optimiser steps (smoke runs); the schedule is sized to it."""
    deepspeed_config: str | None = None
    group_by_length: bool = False
    """Batches of similar lengths (swbert.finetune.batching), for padded batches: less padding."""


@dataclass
class FitResult:
    best_metrics: dict[str, float]
    best_epoch: int
    history: list[dict[str, float]] = field(default_factory=list)
    steps: int = 0
    steps_per_epoch: int = 0
    """Optimiser steps in one full pass over the training set (on this rank's share of it)."""
    train_seconds: float = 0.0
    """Wall time of the training steps only: the dev evaluations after each epoch are not in it, so
    seconds per epoch compare fine-tuning cost across variants (the paper's Figure 3)."""
    eval_seconds: float = 0.0

    @property
    def epochs_trained(self) -> float:
        """Passes over the training set, fractional when --max-steps cut the last one."""
        return self.steps / self.steps_per_epoch if self.steps_per_epoch else 0.0


def barrier() -> None:
    """Wait for every rank (a no-op in single-process runs)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def default_device(info: ParallelDims | None = None) -> torch.device:
    info = info or ParallelDims.from_env()
    return torch.device(f"cuda:{info.local_rank}") if torch.cuda.is_available() else torch.device("cpu")


def move(batch: dict[str, torch.Tensor | int], device: torch.device) -> dict[str, torch.Tensor | int]:
    # an unpadded batch's max_seqlen is a host int
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }


def progress_bar(total: int, desc: str, **kwargs: object):  # -> tqdm
    """A tqdm bar on rank 0 (a disabled one elsewhere): per run, and over a sweep's runs."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total, desc=desc, disable=not ParallelDims.from_env().is_main, dynamic_ncols=True, **kwargs
    )


# the flags that set what the DeepSpeed config must agree with, named in its errors
FLAGS = Flags(
    global_batch="--batch-size",
    micro_batch="--batch-size (split over ranks)",
    accum="--batch-size (no accumulation)",
    grad_clip="--max-grad-norm",
    lr="the fine-tuning flags (--learning-rates, --warmup-ratio)",
    source="the fine-tuning flags give",
    job="fine-tuning",
)


def deepspeed_config(path: str | Path, cfg: FinetuneConfig, world_size: int, precision: str) -> dict:
    """The DeepSpeed JSON (a path or a shipped ``ds_configs/`` name) filled from ``cfg`` by the builder
    pretraining uses: batch sizes, clipping and ``bf16``/``fp16`` where "auto" or absent, an error for a
    value that disagrees with the flags or an ``optimizer``/``scheduler`` section. ZeRO-3 is refused:
    best-epoch weights are kept as a full state dict, which stage 3 does not hold on any one rank."""
    if cfg.batch_size % world_size:
        raise ValueError(f"--batch-size {cfg.batch_size} is not divisible by the world size {world_size}")
    batch = BatchShape(cfg.batch_size, cfg.batch_size // world_size, 1)
    return build_ds_config(path, batch, cfg.max_grad_norm, precision, FLAGS, max_zero_stage=2)


def _state_on_cpu(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


@dataclass
class _Setup:
    """What `fit` trains with, set up once: the loader, the step's optimiser (DeepSpeed's engine when
    launched with more than one rank) and the precision context."""

    info: ParallelDims
    device: torch.device
    loader: DataLoader
    sampler: Any
    total: int  # optimiser steps of the whole fit
    optimizer: torch.optim.Optimizer
    scheduler: Any
    engine: Any  # deepspeed.DeepSpeedEngine, or None in a single process
    module: nn.Module  # the bare model: evaluation, state dicts
    autocast: torch.autocast

    def train_step(self, batch: dict, max_grad_norm: float) -> float:
        """One optimiser step on `batch`; its loss."""
        batch = move(batch, self.device)
        with self.autocast:
            loss = (self.engine or self.module)(**batch).loss
        if self.engine is not None:
            self.engine.backward(loss)
            self.engine.step()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def _set_up(model: nn.Module, train_set: Dataset, collate: Callable, cfg: FinetuneConfig) -> _Setup:
    info = ParallelDims.from_env()
    if info.world > 1 and not cfg.deepspeed_config:
        raise ValueError(
            f"launched with world size {info.world}: pass --deepspeed CONFIG for multi-GPU fine-tuning"
        )
    use_ds = info.world > 1
    if use_ds:
        from swbert.runtime.dist import init_distributed

        init_distributed()  # NCCL on GPU, gloo on CPU; sets this rank's GPU; a no-op when already up
    device = default_device(info)
    precision = resolve_precision(cfg.precision, device.type == "cuda")
    if precision == "fp16" and not use_ds:
        raise ValueError(
            "--precision fp16 needs DeepSpeed's loss scaling; use bf16, or launch with --deepspeed"
        )
    model.to(device)
    micro = cfg.batch_size // info.world
    loader, sampler = train_loader(
        train_set, collate, micro, info.world, info.rank, cfg.seed, cfg.group_by_length
    )
    if len(loader) == 0:
        raise ValueError("the training split is empty")
    total = (
        cfg.epochs * len(loader) if cfg.max_steps is None else min(cfg.max_steps, cfg.epochs * len(loader))
    )
    optimizer = build_optimizer(
        model, cfg.learning_rate, cfg.weight_decay, kind="torch_adamw", on_gpu=device.type == "cuda"
    )
    scheduler = build_scheduler(optimizer, total, warmup=int(cfg.warmup_ratio * total))
    engine = None
    if use_ds:
        import deepspeed

        ds_cfg = deepspeed_config(cfg.deepspeed_config, cfg, info.world, precision)
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_cfg
        )
    # DeepSpeed casts the model itself; a single process gets bf16 autocast (fp32 master weights).
    autocast = torch.autocast(
        device.type, dtype=torch.bfloat16, enabled=engine is None and precision == "bf16"
    )
    module = engine.module if engine is not None else model
    return _Setup(info, device, loader, sampler, total, optimizer, scheduler, engine, module, autocast)


def _train_epoch(
    run: _Setup, cfg: FinetuneConfig, epoch: int, step: int, bar: Any, log_metrics: Callable | None
) -> int:
    """One pass (or what is left of `run.total`) over the training set; the step count after it."""
    if run.sampler is not None:
        run.sampler.set_epoch(epoch)
    run.module.train()
    running, seen = 0.0, 0
    for batch in run.loader:
        running += run.train_step(batch, cfg.max_grad_norm)
        step, seen = step + 1, seen + 1
        bar.update(1)
        if log_metrics and run.info.is_main and (step % 50 == 0 or step == run.total):
            log_metrics({"train/loss": running / seen, "train/lr": run.scheduler.get_last_lr()[0]}, step)
            running, seen = 0.0, 0
        if step >= run.total:
            break
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)  # the epoch's kernels belong to its training time
    return step


@dataclass
class _Best:
    """The best dev epoch so far, its weights on the CPU, and the epochs since it."""

    value: float = -math.inf
    state: dict[str, torch.Tensor] | None = None
    stale: int = 0

    def update(self, module: nn.Module, metrics: dict[str, float], select: str, result: FitResult) -> None:
        value = selection_value(metrics[select])
        if self.state is None or value > self.value:
            self.value, self.state, self.stale = value, _state_on_cpu(module), 0
            result.best_metrics, result.best_epoch = dict(metrics), int(metrics["epoch"])
        else:
            self.stale += 1


def fit(
    model: nn.Module,
    train_set: Dataset,
    collate: Callable,
    evaluate: Callable[[nn.Module], dict[str, float]],
    select: str,
    cfg: FinetuneConfig,
    log_metrics: Callable[[dict[str, float], int], None] | None = None,
    desc: str = "fine-tune",
) -> FitResult:
    """Fine-tune ``model`` in place; on return it holds the weights of the best dev epoch.

    ``evaluate(model)`` returns dev metrics; ``select`` names the one to maximise. ``log_metrics``
    (rank 0 only) receives the training loss and learning rate every few steps and the dev metrics
    after every epoch (keys prefixed ``dev/``), with the optimiser step as ``step``. Rank 0 shows a
    progress bar over the steps, labelled ``desc``.
    """
    run = _set_up(model, train_set, collate, cfg)
    result = FitResult(best_metrics={}, best_epoch=-1, steps_per_epoch=len(run.loader))
    best, step = _Best(), 0
    bar = progress_bar(run.total, desc, unit="step", leave=False)
    for epoch in range(cfg.epochs):
        started = time.perf_counter()
        step = _train_epoch(run, cfg, epoch, step, bar, log_metrics)
        result.train_seconds += time.perf_counter() - started
        started = time.perf_counter()
        run.module.eval()
        with torch.no_grad():
            metrics = evaluate(run.module)
        result.eval_seconds += time.perf_counter() - started
        metrics["epoch"] = float(epoch)
        result.history.append(metrics)
        if log_metrics and run.info.is_main:
            log_metrics(
                {f"dev/{k}": v for k, v in metrics.items() if k != "epoch" and not math.isnan(v)}, step
            )
        bar.set_postfix({select: f"{metrics[select]:.4f}", "epoch": epoch})
        best.update(run.module, metrics, select, result)
        log.info(
            "epoch %d step %d: %s=%.4f (best %.4f at epoch %d)",
            epoch, step, select, metrics[select], best.value, result.best_epoch,
        )  # fmt: skip
        if step >= run.total or (cfg.patience and best.stale >= cfg.patience):
            break
    bar.close()
    result.steps = step
    if best.state is not None:
        run.module.load_state_dict(best.state)
    if run.engine is not None:
        # drop the engine's gradient hooks: a stepped learning-rate plan fits the same model again
        run.engine.destroy()
    return result
