"""What every fine-tuning sweep shares: its flags (`SweepConfig`, which `GlueSweep` and `SquadSweep`
extend), and one trial per (checkpoint, task, learning rate setting, seed): fit, log the best epoch,
save; a point of the sweep's study (`swbert.studies`), recorded under <output-dir>/trials/ once its
model is saved, and an MLflow child run of the sweep's parent run."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torch import nn
from transformers import set_seed

from swbert.finetune.batching import COMPILE_BUCKET, resolve_unpad, unpad_collate
from swbert.finetune.checkpoint import Checkpoint, parse_checkpoints, save_finetuned
from swbert.finetune.engine import process_group
from swbert.finetune.glue_data import pad_collate
from swbert.finetune.results import (
    CHECKPOINT,
    TASK,
    VARIANT,
    Summary,
    Trial,
    lr_label,
    nest_metrics,
    prune_models,
    task_summaries,
)
from swbert.finetune.trainer import FinetuneConfig, FitOptions, default_device, fit
from swbert.runtime.ranks import ParallelDims
from swbert.studies.options import StudyOptions
from swbert.studies.records import DATA, Records, check_study, data_identity, point_key, study_options
from swbert.studies.runner import ChildRun, PointRunner, Settled, StudyLog, study_run
from swbert.studies.tracking import KIND, REUSED_FROM, flat_params

log = logging.getLogger("swbert.finetune")

# Flags that only say which trials there are (a new seed leaves the others' records standing) and
# what is evaluated after training: in study.json, not in a trial's record key.
CHOOSES = ("checkpoint", "learning_rates", "seeds", "tasks", "versions", "triviaqa", DATA)
AFTER_TRAINING = ("run_name", "keep", "noise", "noise_levels", "noise_seeds", "noise_scales", "cross_domain",
                  "evaluate_finetuned")  # fmt: skip


@dataclass(kw_only=True)
class SweepConfig(StudyOptions, FitOptions):
    """The flags of every fine-tuning launcher (each launcher sets its own defaults)."""

    # exported model folders as [NAME=]PATH; NAME labels the table row (default: the attention type)
    checkpoint: list[str]
    experiment: str = "swbert-finetune"
    tokenizer: Path | None = None  # tokenizer folder, when not the checkpoint's own
    # fine-tune with a tokenizer whose vocabulary differs from the one the export records (a warning)
    allow_tokenizer_change: bool = False
    # the paper's appendix: "initial" 1e-4, "subsequently" 2e-5 and 2e-6 (paraphrase); --lr-plan says how
    learning_rates: list[float] = field(default_factory=lambda: [1e-4, 2e-5, 2e-6])
    # stepped: each seed runs through --learning-rates in order, every stage continuing from the best dev
    # weights so far (the appendix's "subsequently", read as a sequence); grid: one independent run per
    # rate, and the rate with the best median over seeds is reported (our reading of it as alternatives)
    lr_plan: Literal["stepped", "grid"] = "stepped"
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])  # one run per seed (how many: ours)
    attention_dropout: float = 0.1  # attention_probs_dropout_prob during fine-tuning
    # tokens per example: GLUE pairs as [CLS] a [SEP] b [SEP] (ours); a SQuAD window, question included
    max_seq_length: int = 128
    hidden_dropout: float | None = None  # hidden_dropout_prob during fine-tuning (default: the checkpoint's)
    max_train_samples: int | None = None  # use only the first N training examples
    max_eval_samples: int | None = None  # use only the first N dev examples
    # fine-tuned models kept on disk: the median seed's at the best learning rate, all, or none
    keep: Literal["none", "median", "all"] = "median"
    run_name: str | None = None  # name of the parent MLflow run (default: launcher and time)
    # batches as one token stream, no padding computed (swbert.finetune.batching): auto is on where
    # the device has a variable-length attention kernel (CUDA); off pads batches grouped by length;
    # on without such a kernel runs the per-sequence reference (ours: the paper says nothing of it)
    unpad: Literal["auto", "on", "off"] = "auto"
    # torch.compile the training forward, batches padded up to multiples of 64 tokens so it sees a few
    # shapes (ours): auto is on for CUDA runs with padded batches (an unpadded stream changes length
    # every batch), off on CPU; on needs padded batches (--unpad off)
    compile: Literal["auto", "on", "off"] = "auto"

    def check(self) -> None:
        super().check()
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
        return parse_checkpoints(self.checkpoint)

    def data_files(self) -> list[Path]:
        """The local task files the trials read (none from the Hub): their hashes are the sweep's data."""
        return []

    def lr_settings(self) -> list[tuple[float, ...]]:
        """One setting per learning rate (grid), or all the rates as one setting, a stage each (stepped)."""
        return (
            [tuple(self.learning_rates)]
            if self.lr_plan == "stepped"
            else [(lr,) for lr in self.learning_rates]
        )

    def finetune_config(self, lr: float | None = None, seed: int = 0) -> FinetuneConfig:
        """One run's hyper-parameters (a stepped plan's first stage: `fit` runs the later ones)."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(FitOptions)}
        return FinetuneConfig(**shared, learning_rate=self.learning_rates[0] if lr is None else lr, seed=seed,
                              group_by_length=not self.unpadded(), compile=self.compiled())  # fmt: skip

    def unpadded(self) -> bool:
        """Whether this sweep's runs go unpadded (`--unpad`, on this process's device)."""
        return resolve_unpad(self.unpad, default_device().type, self.attention_dropout)

    def compiled(self) -> bool:
        """Whether this sweep's runs are compiled (`--compile`, on this process's device)."""
        if self.compile == "on" and self.unpadded():
            raise ValueError(
                "--compile on compiles padded batches in length buckets, not unpadded ones: add "
                "--unpad off, or leave --compile auto (on for CUDA runs with padded batches)"
            )
        on_gpu = default_device().type == "cuda"
        return self.compile == "on" or (self.compile == "auto" and on_gpu and not self.unpadded())

    def dropout(self) -> dict[str, float]:
        """The model config's dropouts (hidden: the checkpoint's unless given)."""
        hidden = {} if self.hidden_dropout is None else {"hidden_dropout_prob": self.hidden_dropout}
        return {"attention_probs_dropout_prob": self.attention_dropout, **hidden}

    def collate(self, pad_token_id: int) -> Callable[[list[dict]], dict]:
        """One token stream when unpadded, else padded (to length buckets when compiled)."""
        if self.unpadded():
            return unpad_collate(pad_token_id)
        if self.compiled():
            return pad_collate(pad_token_id, COMPILE_BUCKET, self.max_seq_length)
        return pad_collate(pad_token_id)


@dataclass
class Trials:
    """A sweep's trials as the points of its study: the records, the MLflow runs, the options."""

    sweep: SweepConfig
    log: StudyLog
    options: dict[str, Any]  # study.json's (`swbert.studies.records.study_options`)

    def __post_init__(self) -> None:
        self.runner = PointRunner(trial_records(self.sweep), Trial.of, writes=ParallelDims.from_env().is_main)

    def per_task(self) -> int:
        """Trials of one checkpoint on one task."""
        return len(self.sweep.lr_settings()) * len(self.sweep.seeds)

    def task_trials(
        self, ckpt: Checkpoint, task: str, one: Callable[[tuple[float, ...], int], Trial], bar: Any
    ) -> tuple[list[Trial], Summary]:
        """`one(lrs, seed)` at every learning-rate setting and seed of `ckpt` on `task`, and their
        summary; with ``--keep median`` only the median seed's model stays on disk."""
        done = []
        for lrs in self.sweep.lr_settings():
            for seed in self.sweep.seeds:
                done.append(one(lrs, seed))
                bar.update(1)
        (summary,) = task_summaries(done)
        log.info("%s %s: lr %s, median %s", ckpt.name, task, summary.lr_label, summary.median)
        if self.sweep.keep == "median" and ParallelDims.from_env().is_main:
            prune_models(done, summary.median_trial)
        return done, summary

    def key(self, spec: TrialSpec, **facts: Any) -> dict[str, Any]:
        """What a trial's record stands for: the sweep's options, the trial's own, the checkpoint's
        files and the trial's data."""
        data = self.options.get(DATA, {})
        mine = {f: data[f] for f in (str(Path(p).resolve()) for p in spec.files) if f in data}
        fingerprint = checkpoint_fingerprint(spec.ckpt.path)
        return point_key(self.options, CHOOSES, checkpoint=fingerprint, data=mine, **facts)


def trial_records(sweep: SweepConfig) -> Records:
    """The trials' records, <output-dir>/trials/<variant>/<task>/<setting>.json: beside, not inside,
    the model folders (pruning removes those)."""
    return Records(sweep.output_dir / "trials", "swbert-trial/2")


def checkpoint_fingerprint(folder: Path) -> list[list[Any]]:
    """(name, size, mtime_ns) of the checkpoint's top-level files: a re-exported checkpoint differs."""
    files = sorted(p for p in Path(folder).iterdir() if p.is_file()) if Path(folder).is_dir() else []
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def run_sweep(sweep: SweepConfig, kind: str, run: Callable[[Any, Trials], object]) -> int:
    """A fine-tuning launcher's sweep: its options checked against the folder's, a new parent MLflow
    run around `run` (a killed sweep's runs marked KILLED), then the tables. Returns the exit status."""
    from swbert.logs import setup_logging

    setup_logging()
    is_main = ParallelDims.from_env().is_main
    sweep.output_dir.mkdir(parents=True, exist_ok=True)
    if is_main:
        text = json.dumps(dataclasses.asdict(sweep), indent=2, default=str)
        path = sweep.output_dir / f"args-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(text + "\n")
        log.info("resolved arguments: %s", path)  # a line, not the ~80 of the file
    options = study_options(sweep, AFTER_TRAINING, data_identity(sweep.data_files()))
    if not getattr(sweep, "evaluate_finetuned", False):  # an evaluation of fine-tuned models has no trials
        check_study(
            sweep.output_dir, f"{kind}_sweep", options, sweep.allow_study_change, trial_records(sweep)
        )
    how = dict(name=sweep.run_name, resume=False, enabled=is_main, system_metrics=True)
    # one process group for the sweep's runs (a 1-rank one in a plain process: see `process_group`)
    with process_group(), study_run(sweep.output_dir, sweep.store(), sweep.experiment, f"{kind}_sweep",
                                    dataclasses.asdict(sweep), **how) as study:  # fmt: skip
        run(sweep, Trials(sweep, study, options))
    report_sweep(study, sweep)
    return 0


def report_sweep(study: StudyLog, sweep: SweepConfig) -> None:
    """The sweep's tables (rank 0) under <output-dir>/report, logged to the parent run and printed."""
    from swbert.finetune.report import build_report, collect

    if not ParallelDims.from_env().is_main:
        return
    folder = sweep.output_dir / "report"
    tables = build_report(collect(study.tracker.uri, sweep.experiment, [study.parent]), folder)
    study.tracker.log_artifacts(study.parent, folder, "report")  # tables and figures
    for table in tables.values():
        print(table.markdown())
    log.info("tables written to %s (re-create them with launchers/report.py)", folder)


@dataclass(frozen=True)
class TrialSpec:
    """One (checkpoint, task, learning-rate setting, seed) of a sweep, and how its MLflow run is labelled."""

    ckpt: Checkpoint
    task: str
    lrs: tuple[float, ...]  # one rate, or a stepped plan's rates in the order its stages run
    seed: int
    kind: str  # the MLflow tag swbert.kind: glue_trial, squad_trial
    params: dict[str, Any]  # logged besides the hyper-parameters
    files: tuple[Path, ...] = ()  # the local data files it reads (`SweepConfig.data_files`)

    @property
    def lr(self) -> float:
        return self.lrs[0]

    @property
    def name(self) -> str:
        return f"{self.ckpt.name}/{self.task}/lr{lr_label(self.lrs)}/seed{self.seed}"

    @property
    def folder(self) -> str:  # the fine-tuned model's, under <output-dir>/<checkpoint>/<task>/
        return f"lr{'-'.join(f'{lr:g}' for lr in self.lrs)}-seed{self.seed}"


@dataclass
class TrialTask:
    """What a trial trains and evaluates on, and how its model is made (after seeding: the head's
    init depends on it)."""

    build_model: Callable[[], nn.Module]
    train_set: Any
    collate: Callable
    evaluate: Callable[[nn.Module], dict[str, float]]
    select: str  # the dev metric that picks the best epoch
    tokenizer: Any


def trial_params(sweep: SweepConfig, spec: TrialSpec) -> dict[str, Any]:
    """A trial's hyper-parameters, as its MLflow run's params and its record's key hold them."""
    return {
        **dataclasses.asdict(sweep.finetune_config(spec.lr, spec.seed)),
        "lr_plan": sweep.lr_plan if len(spec.lrs) > 1 else "single",
        "later_learning_rates": " ".join(f"{lr:g}" for lr in spec.lrs[1:]),
        "attention_type": getattr(spec.ckpt.config, "attention_type", ""),
        "max_seq_length": sweep.max_seq_length,
        "attention_dropout": sweep.attention_dropout,
        "hidden_dropout": sweep.hidden_dropout,
        "batching": "unpadded" if sweep.unpadded() else "grouped",  # the Figure 3 table says it
        **spec.params,
    }


def run_trial(trials: Trials, spec: TrialSpec, task: TrialTask) -> Trial:
    """One trial, settled as a point of the sweep's study: fine-tuned in a child run (best dev epoch
    kept), its model saved (unless --keep none), then recorded; a recorded one is logged as a child
    tagged with the run that trained it."""
    sweep, params = trials.sweep, trial_params(trials.sweep, spec)
    tags = {KIND: spec.kind, VARIANT: spec.ckpt.name, TASK: spec.task, CHECKPOINT: str(spec.ckpt.path)}

    def attempt() -> Trial:
        with trials.log.live(spec.name, tags, params) as run_id:
            set_seed(spec.seed)
            model = task.build_model()
            result = fit(
                model,
                task.train_set,
                task.collate,
                task.evaluate,
                task.select,
                sweep.finetune_config(spec.lr, spec.seed),
                lambda m, step: trials.log.tracker.log(run_id, m, step),
                spec.name.replace("/", " "),
                spec.lrs[1:],
            )
            best = {k: v for k, v in result.best_metrics.items() if k != "epoch"}
            logged = {f"best/{k}": v for k, v in best.items()} | result.summary()
            trials.log.tracker.log(run_id, logged)
            model_dir = ""
            if sweep.keep != "none":
                model_dir = str(sweep.output_dir / spec.ckpt.name / spec.task / spec.folder)
                save_finetuned(model, task.tokenizer, model_dir)
        return Trial(
            spec.ckpt.name,
            spec.task,
            spec.lr,
            spec.seed,
            nest_metrics(best),
            model_dir,
            spec.lrs[1:],
            run_id=run_id,
            logged=logged,
        )

    name = f"{spec.ckpt.name}/{spec.task}/{spec.folder}"
    legacy = legacy_trial(trials, name, params, tags)
    key = trials.key(spec, params=flat_params(params), tags=tags)
    settled = Settled(name, legacy, False) if legacy else trials.runner.settle(name, attempt, key=key)
    trial = settled.result
    if not settled.trained:
        log.info("%s: finished before (%s), not trained again", spec.name, trials.runner.records.path(name))
        trials.log.point(
            spec.name, False, ChildRun({**tags, REUSED_FROM: str(trial.run_id)}, params, trial.logged)
        )
    return trial


# The trial records of sweeps before the study layer (`swbert-trial/1`): read as finished, never written.
# Their key held the trial's hyper-parameters, tags and checkpoint files, and the sweep's flags less
# these; `deepspeed_config` is now `deepspeed`, and the allow_* flags came later (they change no trial).
LEGACY_FORMAT = "swbert-trial/1"
LEGACY_NOT_IN_KEY = frozenset(
    "checkpoint learning_rates seeds tasks versions output_dir tracking_uri experiment run_name keep noise "
    "noise_levels noise_seeds noise_scales cross_domain evaluate_finetuned plugins allow_study_change "
    "allow_tokenizer_change".split()
)


def legacy_trial(trials: Trials, name: str, params: dict[str, Any], tags: dict[str, str]) -> Trial | None:
    """Trial `name` as a record of the previous format holds it, when that record stands for this
    trial (the same key, in the previous format's terms); else None."""
    sweep = flat_params(dataclasses.asdict(trials.sweep))
    key = {
        "params": {("deepspeed_config" if k == "deepspeed" else k): str(v) for k, v in params.items()},
        "tags": tags,
        "checkpoint": checkpoint_fingerprint(Path(tags[CHECKPOINT])),
        "sweep": {k: v for k, v in sweep.items() if k not in LEGACY_NOT_IN_KEY},
    }
    record = Records(trials.runner.records.folder, LEGACY_FORMAT).load(name, key)
    if record is None:
        return None
    return Trial.of({**record["trial"], "run_id": record.get("run_id"), "logged": record.get("metrics", {})})
