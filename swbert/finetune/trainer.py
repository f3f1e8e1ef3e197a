"""The one fine-tuning loop (GLUE, SQuAD, TriviaQA): AdamW without decay on 1-D parameters, linear
warm-up and decay, clipping, a dev evaluation after every epoch and the best epoch's weights kept
(optional early stopping). Every run is a DeepSpeed engine, one process too (a 1-rank group), so
precision, optimizer wrapping and clipping are the same on 1 GPU as on N. A step reads nothing back
from the device but on logging steps."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

from swbert.finetune.batching import LengthGroupedBatchSampler, train_loader
from swbert.finetune.metrics import selection_value
from swbert.runtime.ds_config import BatchShape, Flags, build_ds_config, resolve_precision
from swbert.runtime.optim import build_optimizer, build_scheduler
from swbert.runtime.ranks import ParallelDims

log = logging.getLogger(__name__)

# the variables `swbert.runtime.dist.map_launcher_env` sets for a process no launcher started
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_DS_CONFIG = "zero2.json"  # pretraining's default too; stage 2 sums bf16 gradients in fp32


@dataclass
class FitOptions:
    """The hyper-parameters a sweep passes to every run as they are (the sweeps' flags; defaults ours
    unless a sweep's own say otherwise)."""

    epochs: int = 3  # passes over the training set per run (per stage with --lr-plan stepped)
    batch_size: int = 32  # global batch size (split over GPUs, so results do not depend on their number)
    eval_batch_size: int = 128  # sequences per evaluation batch
    weight_decay: float = 0.1  # AdamW weight decay, the appendix's (not on biases, norms, 1-D scales)
    # fraction of a run's steps with linear warm-up, then linear decay (ours: the appendix gives no
    # schedule); a stepped plan warms up in its first stage only: the later ones continue a tuned model
    warmup_ratio: float = 0.1
    max_grad_norm: float = 1.0  # gradient clipping (ours)
    patience: int = 0  # stop after N epochs without a better dev score (0: never; per stage when stepped)
    max_steps: int | None = None  # cap on optimiser steps per run (smoke tests); the schedule is sized to it
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    # DeepSpeed JSON (a path or a ds_configs/ name, stages 0-2); every run is a DeepSpeed engine, one
    # process too (default: zero2.json)
    deepspeed: str | None = None
    # DataLoader processes per rank that collate training batches (0: on the training thread)
    num_workers: int = 1


@dataclass
class FinetuneConfig(FitOptions):
    """The hyper-parameters of one fine-tuning run: a sweep's `FitOptions` and the run's own."""

    learning_rate: float = 1e-4
    seed: int = 0
    log_every: int = 50  # optimiser steps between logged losses: the only steps that read one back
    group_by_length: bool = False  # padded batches of similar lengths (swbert.finetune.batching)
    # torch.compile the training forward (`CompiledInTraining`); the collate should pad to
    # length buckets (`pad_collate(..., bucket=COMPILE_BUCKET)`), as the sweeps' does
    compile: bool = False
    compile_backend: Any = "inductor"  # a name, or a callable (tests record the graphs with one)


@dataclass
class FitResult:
    best_metrics: dict[str, float]
    best_epoch: int  # counted over every stage's epochs (a stepped plan's)
    best_stage: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    steps: int = 0
    steps_per_epoch: int = 0  # optimiser steps in one pass over this rank's share of the training set
    # the training steps' wall time, dev evaluations excluded: seconds per epoch compare fine-tuning
    # cost across variants (the paper's Figure 3)
    train_seconds: float = 0.0
    eval_seconds: float = 0.0

    @property
    def epochs_trained(self) -> float:
        """Passes over the training set, fractional when --max-steps cut the last one."""
        return self.steps / self.steps_per_epoch if self.steps_per_epoch else 0.0

    def summary(self) -> dict[str, float]:
        """What a trial's run logs besides its best metrics."""
        names = ("best_epoch", "best_stage", "train_seconds", "eval_seconds", "epochs_trained")
        per_epoch = {"seconds_per_epoch": self.train_seconds / max(self.epochs_trained, 1e-9)}
        return {name: getattr(self, name) for name in names} | per_epoch | {"steps": self.steps}


@contextmanager
def process_group() -> Iterator[ParallelDims]:
    """The job's process group for the duration of the block, with this process's place in it.

    Under a launcher (torchrun, deepspeed, srun) the group is the job's, left up. A plain ``python``
    process gets a 1-rank group, destroyed on leaving with the launcher variables it set, so the
    process is left as it was (its threads may outlive it: start later ranks from a fresh process,
    not by forking this one). A sweep holds one group around all its runs."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        yield ParallelDims.from_env()
        return
    from swbert.runtime.dist import init_distributed

    launched = "RANK" in os.environ
    saved = {k: os.environ.get(k) for k in LAUNCH_ENV}
    init_distributed()  # NCCL on GPU, gloo on CPU; sets this rank's GPU
    try:
        yield ParallelDims.from_env()
    finally:
        if not launched:  # DeepSpeed's references, then torch's group (its teardown leaves it up)
            import deepspeed.comm

            deepspeed.comm.destroy_process_group()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            for key, value in saved.items():  # the launcher variables it set
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def default_device(info: ParallelDims | None = None) -> torch.device:
    info = info or ParallelDims.from_env()
    return torch.device(f"cuda:{info.local_rank}") if torch.cuda.is_available() else torch.device("cpu")


def move(batch: dict[str, torch.Tensor | int], device: torch.device) -> dict[str, torch.Tensor | int]:
    return {  # an unpadded batch's max_seqlen is a host int
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }


@torch.no_grad()
def predict(
    model: nn.Module,
    dataset: Dataset,
    collate: Callable,
    batch_size: int = 128,
    outputs: tuple[str, ...] = ("logits",),
) -> list[np.ndarray]:
    """The model's `outputs` for a whole dataset, in order (labels not passed in), float32; a batch
    narrower than the widest (an unpadded one: its longest sequence) is padded at the lowest logit."""
    device = next(model.parameters()).device
    rows: list[list[torch.Tensor]] = [[] for _ in outputs]
    for batch in DataLoader(dataset, batch_size=batch_size, collate_fn=collate):
        result = model(**move({k: v for k, v in batch.items() if k != "labels"}, device))
        for kept, name in zip(rows, outputs):
            kept.extend(getattr(result, name).float().cpu())
    lowest = torch.finfo(torch.float32).min
    return [pad_sequence(kept, batch_first=True, padding_value=lowest).numpy() for kept in rows]


def progress_bar(total: int, desc: str, **kwargs: object):  # -> tqdm
    """A tqdm bar on rank 0 (a disabled one elsewhere, and for nothing to count)."""
    from tqdm.auto import tqdm

    shown = total > 0 and ParallelDims.from_env().is_main
    return tqdm(total=total, desc=desc, disable=not shown, dynamic_ncols=True, **kwargs)


class CompiledInTraining:
    """A model's ``forward`` for a stage (`fit` with ``compile``), compiled for its training steps only:
    evaluation (other batch sizes, no gradients) runs eagerly, so the graphs are the training batches'
    shapes, one per length bucket, each compiled once (``dynamic=False``, as pretraining's units)."""

    def __init__(self, module: nn.Module, backend: Any) -> None:
        self.module, self.eager = module, module.forward
        self.compiled = torch.compile(module.forward, backend=backend, dynamic=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return (self.compiled if self.module.training else self.eager)(*args, **kwargs)


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
    """The DeepSpeed JSON (a path or a ``ds_configs/`` name) filled from ``cfg`` (`build_ds_config`). ZeRO-3
    is refused: the best epoch's weights are kept as a full state dict, which stage 3 holds on no rank."""
    if cfg.batch_size % world_size:
        raise ValueError(f"--batch-size {cfg.batch_size} is not divisible by the world size {world_size}")
    batch = BatchShape(cfg.batch_size, cfg.batch_size // world_size, 1)
    return build_ds_config(path, batch, cfg.max_grad_norm, precision, FLAGS, max_zero_stage=2)


def stage_config(cfg: FinetuneConfig, stage: int, lr: float) -> FinetuneConfig:
    """Stage `stage` of a stepped plan at `lr`: a warm-up in the first stage only (the later ones
    continue a tuned model)."""
    return dataclasses.replace(cfg, learning_rate=lr, warmup_ratio=0.0 if stage else cfg.warmup_ratio)


class FitRun:
    """A `fit`, one stage at a time: its result and best dev epoch's weights (on the CPU) over every stage;
    the running stage's engine, loader, step budget and loss since the last logged step (on the device)."""

    def __init__(
        self,
        train_set: Dataset,
        collate: Callable,
        evaluate: Callable[[nn.Module], dict[str, float]],
        select: str,
        log_metrics: Callable[[dict[str, float], int], None] | None,
        dims: ParallelDims,
    ) -> None:
        self.train_set, self.collate, self.dims = train_set, collate, dims
        self.evaluate, self.select = evaluate, select
        self.log_metrics = log_metrics if dims.is_main else None
        self.result = FitResult(best_metrics={}, best_epoch=-1)
        self.best_value, self.best_state = -math.inf, None
        self.steps = 0  # logged steps continue across stages

    def run_stage(self, model: nn.Module, cfg: FinetuneConfig, stage: int, desc: str) -> None:
        """Fit `model` at `cfg`'s rate in a new engine; it ends holding the best weights so far, the
        engine's hooks dropped (the next stage of a stepped plan fits the same model)."""
        import deepspeed

        from swbert.runtime.dist import bound_every_group

        on_gpu, world = torch.cuda.is_available(), self.dims.world
        precision = resolve_precision(cfg.precision, on_gpu)
        ds_cfg = deepspeed_config(cfg.deepspeed or DEFAULT_DS_CONFIG, cfg, world, precision)
        self.loader = train_loader(
            self.train_set,
            self.collate,
            cfg.batch_size // world,
            self.dims,
            cfg.seed,
            cfg.num_workers,
            cfg.group_by_length,
        )
        if len(self.loader) == 0:
            raise ValueError("the training split is empty")
        budget = cfg.epochs * len(self.loader)
        budget = budget if cfg.max_steps is None else min(cfg.max_steps, budget)
        model.to(default_device(self.dims))
        # AdamW over pretraining's parameter groups, its linear schedule stepped once per optimizer step
        optimizer = build_optimizer(
            model, cfg.learning_rate, cfg.weight_decay, kind="torch_adamw", on_gpu=on_gpu
        )
        scheduler = build_scheduler(optimizer, budget, warmup=int(cfg.warmup_ratio * budget))
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_cfg, dist_init_required=False
        )
        bound_every_group()  # SWBERT_DIST_TIMEOUT_MIN for DeepSpeed's groups too
        if cfg.compile:
            model.forward = CompiledInTraining(model, cfg.compile_backend)
        self.cfg, self.total, self.window_steps = cfg, self.steps + budget, 0
        self.result.steps_per_epoch = len(self.loader)
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=self.engine.device)
        self.bar = progress_bar(budget, desc, unit="step", leave=False)
        self.stage_best, self.stale = None, 0  # this stage's best and its epochs since (--patience)
        try:
            for epoch in range(cfg.epochs):
                self.train_epoch(epoch)
                if self.end_epoch(epoch, stage):
                    break
        finally:
            self.bar.close()
            if isinstance(model.__dict__.get("forward"), CompiledInTraining):
                del model.forward  # a fitted model is evaluated, saved and fitted again as it was
        self.result.steps = self.steps
        if self.best_state is not None:
            model.load_state_dict(self.best_state)
        self.engine.destroy()

    @property
    def done(self) -> bool:
        return self.steps >= self.total

    def train_epoch(self, epoch: int) -> None:
        """One pass over this rank's share (or up to the step budget), timed with its kernels (one
        synchronisation at the end)."""
        from deepspeed.accelerator import get_accelerator

        grouped = isinstance(self.loader.batch_sampler, LengthGroupedBatchSampler)
        (self.loader.batch_sampler if grouped else self.loader.sampler).set_epoch(epoch)
        self.engine.train()
        started = time.perf_counter()
        for batch in self.loader:
            self.step(batch)
            if self.done:
                break
        get_accelerator().synchronize()
        self.result.train_seconds += time.perf_counter() - started

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        loss = self.engine(**move(batch, self.engine.device)).loss
        self.engine.backward(loss)
        self.engine.step()
        self.loss_sum += loss.detach().float()
        self.steps += 1
        self.window_steps += 1
        self.bar.update(1)
        if self.steps % self.cfg.log_every == 0 or self.done:
            self.log_window()

    def log_window(self) -> None:
        """The window's mean training loss (this rank's: no collective) and the learning rate."""
        if self.log_metrics is not None:
            loss, lr = self.loss_sum.item() / self.window_steps, self.engine.lr_scheduler.get_last_lr()[0]
            self.log_metrics({"train/loss": loss, "train/lr": lr}, self.steps)
        self.loss_sum.zero_()
        self.window_steps = 0

    def end_epoch(self, epoch: int, stage: int) -> bool:
        """Evaluate on dev, keep the weights of the best epoch; True to stop (the step budget is spent,
        or ``patience`` epochs passed without a better score in this stage)."""
        module, select = self.engine.module, self.select
        started = time.perf_counter()
        module.eval()
        with torch.no_grad():
            metrics = self.evaluate(module)
        self.result.eval_seconds += time.perf_counter() - started
        metrics["epoch"] = float(epoch)
        self.result.history.append(metrics)
        if self.log_metrics is not None:
            dev = {f"dev/{k}": v for k, v in metrics.items() if k != "epoch" and not math.isnan(v)}
            self.log_metrics(dev, self.steps)
        self.bar.set_postfix({select: f"{metrics[select]:.4f}", "epoch": epoch})
        value = selection_value(metrics[select])
        improved = self.stage_best is None or value > self.stage_best
        self.stage_best, self.stale = (value, 0) if improved else (self.stage_best, self.stale + 1)
        if self.best_state is None or value > self.best_value:
            self.best_value = value
            self.best_state = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
            self.result.best_metrics, self.result.best_stage = dict(metrics), stage
            self.result.best_epoch = len(self.result.history) - 1
        log.info(
            "epoch %d step %d: %s=%.4f (best %.4f at epoch %d)",
            *(epoch, self.steps, select, metrics[select], self.best_value, self.result.best_epoch),
        )
        return self.done or bool(self.cfg.patience and self.stale >= self.cfg.patience)


def fit(
    model: nn.Module,
    train_set: Dataset,
    collate: Callable,
    evaluate: Callable[[nn.Module], dict[str, float]],
    select: str,
    cfg: FinetuneConfig,
    log_metrics: Callable[[dict[str, float], int], None] | None = None,
    desc: str = "fine-tune",
    later_lrs: tuple[float, ...] = (),
) -> FitResult:
    """Fine-tune ``model`` in place; on return it holds the weights of the best dev epoch.

    ``evaluate(model)`` returns dev metrics; ``select`` names the one to maximise. ``log_metrics``
    (rank 0) gets the training loss and learning rate every ``cfg.log_every`` steps and the dev
    metrics (``dev/...``) after every epoch, at the optimiser step. ``later_lrs``: a stepped plan's
    later stages, each in a new engine at its rate (no warm-up) from the best weights so far."""
    stages = (cfg.learning_rate, *later_lrs)
    with process_group() as dims:
        run = FitRun(train_set, collate, evaluate, select, log_metrics, dims)
        for stage, lr in enumerate(stages):
            label = desc + (f" stage {stage + 1}/{len(stages)}" if stage else "")
            run.run_stage(model, stage_config(cfg, stage, lr), stage, label)
            log.info("%s: stage %d at lr %g, best %s=%.4f", desc, stage, lr, select, run.best_value)
    return run.result
