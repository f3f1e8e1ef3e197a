"""What every fine-tuning sweep shares: its flags, and one trial (fit, log the best epoch, save).

A sweep is a typed config (`swbert.cli`: `--key value` flags, or a YAML/TOML file with
`--config`): GLUE's `GlueSweep` and SQuAD's `SquadSweep` extend `SweepConfig` with their own fields.
Every (checkpoint, task, learning rate, seed) is one `run_trial`: an MLflow child run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torch import nn

from swbert.finetune.batching import COMPILE_BUCKET, resolve_unpad, unpad_collate
from swbert.finetune.checkpoint import Checkpoint, parse_checkpoints, save_finetuned
from swbert.finetune.engine import process_group
from swbert.finetune.glue_data import pad_collate
from swbert.finetune.metrics import selection_value
from swbert.finetune.results import Trial, nest_metrics
from swbert.finetune.resume import log_reused, trial_from_record, trial_key, trial_payload, trial_records
from swbert.finetune.tracking import DEFAULT_EXPERIMENT, Tracker
from swbert.finetune.trainer import FinetuneConfig, default_device, fit, set_seed
from swbert.models.plugins import load_plugins
from swbert.runtime.ranks import ParallelDims
from swbert.runtime.tracking import tracking_uri
from swbert.studies.tracking import flat_params

log = logging.getLogger("swbert.finetune")


@dataclass
class SweepConfig:
    """The flags of every fine-tuning launcher (each launcher sets its own defaults)."""

    # exported model folders as [NAME=]PATH; NAME labels the table row (default: the attention type)
    checkpoint: list[str]
    output_dir: Path  # fine-tuned models, the resolved config and (by default) mlflow.db
    tokenizer: Path | None = None  # tokenizer folder, when not the checkpoint's own
    # the paper's appendix: "initial" 1e-4, "subsequently" 2e-5 and 2e-6 (paraphrase); --lr-plan says how
    learning_rates: list[float] = field(default_factory=lambda: [1e-4, 2e-5, 2e-6])
    # stepped: each seed runs through --learning-rates in order, every stage continuing from the best dev
    # weights so far (the appendix's "subsequently", read as a sequence); grid: one independent run per
    # rate, and the rate with the best median over seeds is reported (our reading of it as alternatives)
    lr_plan: Literal["stepped", "grid"] = "stepped"
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])  # one run per seed (how many: ours)
    epochs: int = 3  # passes over the training set per run (per stage with --lr-plan stepped)
    batch_size: int = 32  # global batch size (split over GPUs)
    eval_batch_size: int = 128  # sequences per evaluation batch
    weight_decay: float = 0.1  # AdamW weight decay, the appendix's (not on biases, norms, 1-D scales)
    # fraction of a run's steps with linear warm-up, then linear decay (ours: the appendix gives no
    # schedule); a stepped plan warms up in its first stage only: the later ones continue a tuned model
    warmup_ratio: float = 0.1
    max_grad_norm: float = 1.0  # gradient clipping (ours)
    patience: int = 0  # stop after N epochs without a better dev score (0: never; per stage when stepped)
    max_steps: int | None = None  # cap on optimiser steps per run (smoke tests)
    attention_dropout: float = 0.1  # attention_probs_dropout_prob during fine-tuning
    hidden_dropout: float | None = None  # hidden_dropout_prob during fine-tuning (default: the checkpoint's)
    max_train_samples: int | None = None  # use only the first N training examples
    max_eval_samples: int | None = None  # use only the first N dev examples
    # fine-tuned models kept on disk: the median seed's at the best learning rate, all, or none
    keep: Literal["none", "median", "all"] = "median"
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    # DeepSpeed JSON (a path or a ds_configs/ name, stages 0-2); every run is a DeepSpeed engine, one
    # process too (default: zero2.json)
    deepspeed: str | None = None
    # DataLoader processes per rank that collate training batches (0: on the training thread)
    num_workers: int = 1
    experiment: str = DEFAULT_EXPERIMENT  # MLflow experiment name
    # MLflow store (default: $MLFLOW_TRACKING_URI, else <output-dir>/mlflow.db)
    tracking_uri: str | None = None
    run_name: str | None = None  # name of the parent MLflow run (default: launcher and time)
    # modules imported first that register attention variants the checkpoints use (ours; see
    # swbert.models.plugins): dotted module names or .py files
    plugins: list[str] = field(default_factory=list)
    # batches as one token stream, no padding computed (swbert.finetune.batching): auto is on where
    # the device has a variable-length attention kernel (CUDA); off pads batches grouped by length;
    # on without such a kernel runs the per-sequence reference (ours: the paper says nothing of it)
    unpad: Literal["auto", "on", "off"] = "auto"
    # torch.compile the training forward, batches padded up to multiples of 64 tokens so it sees a few
    # shapes (ours): auto is on for CUDA runs with padded batches (an unpadded stream changes length
    # every batch), off on CPU; on needs padded batches (--unpad off)
    compile: Literal["auto", "on", "off"] = "auto"

    def check(self) -> None:
        load_plugins(self.plugins)
        for name in ("epochs", "batch_size", "eval_batch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.num_workers < 0:
            raise ValueError(
                f"--num-workers {self.num_workers} must be 0 or more (0: collate on the training thread)"
            )
        if not self.learning_rates or not self.seeds:
            raise ValueError("--learning-rates and --seeds each need at least one value")

    def checkpoints(self) -> list[Checkpoint]:
        """The `--checkpoint` folders, checked and named."""
        return parse_checkpoints(self.checkpoint)

    def lr_settings(self) -> list[tuple[float, ...]]:
        """What each seed is run with: one setting per learning rate (grid), or the whole sequence of
        rates as one setting, a stage each (stepped)."""
        if self.lr_plan == "stepped":
            return [tuple(self.learning_rates)]
        return [(lr,) for lr in self.learning_rates]

    def finetune_config(
        self, learning_rate: float | None = None, seed: int = 0, stage: int = 0
    ) -> FinetuneConfig:
        """The hyper-parameters of one run (or one stage of a stepped run) of this sweep."""
        return FinetuneConfig(
            learning_rate=self.learning_rates[0] if learning_rate is None else learning_rate,
            weight_decay=self.weight_decay,
            epochs=self.epochs,
            batch_size=self.batch_size,
            eval_batch_size=self.eval_batch_size,
            warmup_ratio=self.warmup_ratio if stage == 0 else 0.0,
            max_grad_norm=self.max_grad_norm,
            seed=seed,
            patience=self.patience,
            precision=self.precision,
            max_steps=self.max_steps,
            deepspeed_config=self.deepspeed,
            group_by_length=not self.unpadded(),
            compile=self.compiled(),
            num_workers=self.num_workers,
        )

    def unpadded(self) -> bool:
        """Whether this sweep's runs go unpadded (`--unpad`, on this process's device)."""
        return resolve_unpad(self.unpad, default_device().type, self.attention_dropout)

    def batching(self) -> str:
        """How this sweep's batches are formed, as trials record it (the Figure 3 table says it)."""
        return "unpadded" if self.unpadded() else "grouped"

    def compiled(self) -> bool:
        """Whether this sweep's runs are compiled (`--compile`, on this process's device)."""
        if self.compile == "on" and self.unpadded():
            raise ValueError(
                "--compile on compiles padded batches in length buckets, not unpadded ones: add "
                "--unpad off, or leave --compile auto (on for CUDA runs with padded batches)"
            )
        on_gpu = default_device().type == "cuda"
        return self.compile == "on" or (self.compile == "auto" and on_gpu and not self.unpadded())

    def collate(self, pad_token_id: int) -> Callable[[list[dict]], dict]:
        """The batches of this sweep's runs: one token stream when unpadded, else padded (to length
        buckets when compiled, at most the launcher's --max-seq-length)."""
        if self.unpadded():
            return unpad_collate(pad_token_id)
        if self.compiled():
            return pad_collate(pad_token_id, COMPILE_BUCKET, getattr(self, "max_seq_length", None))
        return pad_collate(pad_token_id)

    def params(self) -> dict[str, str]:
        """The flags as MLflow params of the parent run (lists joined with spaces)."""
        return flat_params(dataclasses.asdict(self))


def run_sweep(sweep: SweepConfig, kind: str, run: Callable[[Any, Tracker], object]) -> int:
    """What a fine-tuning launcher does with its parsed sweep: a parent MLflow run around `run`,
    then the tables (`report_sweep`). Returns the exit status."""
    from swbert.logs import setup_logging

    setup_logging()
    tracker = open_tracker(sweep)
    name = sweep.run_name or f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    # one process group for the sweep's runs (a 1-rank one in a plain process: see `process_group`);
    # a new parent run, the killed sweep's (named in the folder) marked KILLED where still RUNNING
    with process_group(), tracker.sweep(name, f"{kind}_sweep", sweep.params(), sweep.output_dir) as parent:
        run(sweep, tracker)
    report_sweep(tracker, sweep, parent)
    return 0


def report_sweep(tracker: Tracker, sweep: SweepConfig, parent: str | None) -> None:
    """After a sweep (rank 0): its tables under <output-dir>/report, logged to the parent run, and
    printed as markdown."""
    from swbert.finetune.report import build_report, collect

    if not ParallelDims.from_env().is_main:
        return
    folder = sweep.output_dir / "report"
    tables = build_report(collect(tracker.uri, sweep.experiment, [parent]), folder)
    tracker.log_artifacts(parent, folder, "report")  # tables and figures
    for table in tables.values():
        print(table.markdown())
    log.info("tables written to %s (re-create them with launchers/report.py)", folder)


def open_tracker(sweep: SweepConfig) -> Tracker:
    """The MLflow tracker (rank 0 only) after logging and saving the resolved flags."""
    info = ParallelDims.from_env()
    if info.is_main:
        sweep.output_dir.mkdir(parents=True, exist_ok=True)
        text = json.dumps(dataclasses.asdict(sweep), indent=2, default=str)
        path = sweep.output_dir / f"args-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(text + "\n")
        log.info("resolved arguments: %s", path)  # a line, not the ~80 of the file
    uri = sweep.tracking_uri or tracking_uri(sweep.output_dir)
    return Tracker(uri, sweep.experiment, enabled=info.is_main)


def lr_label(lrs: tuple[float, ...] | list[float]) -> str:
    """``0.0001`` for one rate, ``0.0001>2e-05>2e-06`` for a stepped sequence (run names, tables)."""
    return ">".join(f"{lr:g}" for lr in lrs)


@dataclass(frozen=True)
class TrialSpec:
    """One (checkpoint, task, learning-rate setting, seed) of a sweep, and how its MLflow run is labelled."""

    ckpt: Checkpoint
    task: str
    lrs: tuple[float, ...]  # one rate, or a stepped plan's rates in the order its stages run
    seed: int
    kind: str  # the MLflow tag swbert.kind: glue_trial, squad_trial
    params: dict[str, Any]  # logged besides the hyper-parameters

    @property
    def lr(self) -> float:
        return self.lrs[0]

    @property
    def name(self) -> str:
        return f"{self.ckpt.name}/{self.task}/lr{lr_label(self.lrs)}/seed{self.seed}"

    @property
    def folder(self) -> str:
        """The fine-tuned model's folder under <output-dir>/<checkpoint>/<task>/."""
        return f"lr{'-'.join(f'{lr:g}' for lr in self.lrs)}-seed{self.seed}"


@dataclass
class StagedResult:
    """A trial's outcome over its stages (one stage unless the plan is stepped)."""

    best_metrics: dict[str, float]
    best_stage: int
    best_epoch: int  # counted over every stage's epochs
    train_seconds: float = 0.0
    eval_seconds: float = 0.0
    steps: int = 0
    epochs_trained: float = 0.0

    def summary(self) -> dict[str, float]:
        """What a trial's run logs besides its best metrics."""
        return {
            "best_epoch": self.best_epoch,
            "best_stage": self.best_stage,
            "train_seconds": self.train_seconds,  # training steps only, evaluations excluded
            "eval_seconds": self.eval_seconds,
            "epochs_trained": self.epochs_trained,
            "seconds_per_epoch": self.train_seconds / max(self.epochs_trained, 1e-9),
            "steps": self.steps,
        }


def fit_stages(
    sweep: SweepConfig,
    spec: TrialSpec,
    model: nn.Module,
    train_set: Any,
    collate: Callable,
    evaluate: Callable[[nn.Module], dict[str, float]],
    select: str,
    log_metrics: Callable[[dict[str, float], int], None],
) -> StagedResult:
    """Fit ``model`` at each of ``spec.lrs`` in turn. Every stage starts from the best dev weights seen
    so far (a stage that never beats the previous best hands those weights on); on return the model
    holds the best weights of all stages. Logged steps continue across stages."""
    out = StagedResult({}, -1, -1)
    best_value, best_state, epochs_before = -math.inf, None, 0
    for stage, lr in enumerate(spec.lrs):
        cfg = sweep.finetune_config(lr, spec.seed, stage)
        offset = out.steps
        result = fit(
            model,
            train_set,
            collate,
            evaluate=evaluate,
            select=select,
            cfg=cfg,
            log_metrics=lambda m, step, offset=offset: log_metrics(m, step + offset),
            desc=spec.name.replace("/", " ") + (f" stage {stage + 1}/{len(spec.lrs)}" if stage else ""),
        )
        out.steps += result.steps
        out.train_seconds += result.train_seconds
        out.eval_seconds += result.eval_seconds
        out.epochs_trained += result.epochs_trained
        value = selection_value(result.best_metrics.get(select, float("nan")))
        if best_state is None or value > best_value:
            best_value, out.best_stage = value, stage
            out.best_metrics = {k: v for k, v in result.best_metrics.items() if k != "epoch"}
            out.best_epoch = epochs_before + result.best_epoch
            if stage + 1 < len(spec.lrs):  # a later stage may do worse: keep these weights to go back to
                best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            else:
                best_state = None
        elif best_state is not None:
            model.load_state_dict(best_state)  # the next stage (or the caller) gets the best weights
        epochs_before += len(result.history)
        log.info("%s: stage %d at lr %g, best %s=%.4f", spec.name, stage, lr, select, best_value)
    return out


def run_trial(
    sweep: SweepConfig,
    spec: TrialSpec,
    tracker: Tracker,
    build_model: Callable[[], nn.Module],
    train_set: Any,
    collate: Callable,
    evaluate: Callable[[nn.Module], dict[str, float]],
    select: str,
    tokenizer: Any,
) -> Trial:
    """Fine-tune one trial as a child run: fit (best dev epoch kept; every stage of a stepped plan), log
    the best metrics and the time spent training, save the model (unless --keep none), record it as
    finished (`swbert.finetune.resume`). A trial recorded by an earlier run of the sweep with the same
    flags and checkpoint is not trained again. `build_model` runs after seeding: the head's init
    depends on it."""
    from swbert.finetune.tracking import CHECKPOINT, KIND, TASK, VARIANT

    tags = {KIND: spec.kind, VARIANT: spec.ckpt.name, TASK: spec.task, CHECKPOINT: str(spec.ckpt.path)}
    params = {
        **dataclasses.asdict(sweep.finetune_config(spec.lr, spec.seed)),
        "lr_plan": sweep.lr_plan if len(spec.lrs) > 1 else "single",
        "later_learning_rates": " ".join(f"{lr:g}" for lr in spec.lrs[1:]),
        "attention_type": getattr(spec.ckpt.config, "attention_type", ""),
        **spec.params,
    }
    records, record = trial_records(sweep.output_dir), f"{spec.ckpt.name}/{spec.task}/{spec.folder}"
    key = trial_key(params, tags, spec.ckpt.path, sweep.params())
    finished = records.load(record, key)
    if finished is not None:  # a re-run of the sweep: this trial's result is already recorded
        log.info("%s: finished before (%s), not trained again", spec.name, records.path(record))
        log_reused(tracker, spec.name, tags, params, finished)
        return trial_from_record(finished)
    with tracker.run(spec.name, tags, params) as run_id:
        set_seed(spec.seed)
        model = build_model()
        result = fit_stages(
            sweep,
            spec,
            model,
            train_set,
            collate,
            evaluate,
            select,
            lambda m, step: tracker.log(run_id, m, step),
        )
        best = result.best_metrics
        logged = {f"best/{k}": v for k, v in best.items()} | result.summary()
        tracker.log(run_id, logged)
        model_dir = ""
        if sweep.keep != "none":
            model_dir = str(sweep.output_dir / spec.ckpt.name / spec.task / spec.folder)
            save_finetuned(model, tokenizer, model_dir)
    trial = Trial(
        spec.ckpt.name, spec.task, spec.lr, spec.seed, nest_metrics(best), model_dir, tuple(spec.lrs[1:])
    )
    if ParallelDims.from_env().is_main:  # last: the record says the trial (and its model) is complete
        records.save(record, trial_payload(trial, run_id, logged), key)
    return trial
