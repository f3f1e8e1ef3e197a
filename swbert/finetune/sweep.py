"""What every fine-tuning sweep shares: its flags (`SweepConfig`, which `GlueSweep` and `SquadSweep`
extend), and one trial per (checkpoint, task, learning rate setting, seed): fit, log the best epoch,
save; a point of the sweep's study (`swbert.studies`), recorded under <output-dir>/trials/ once its
model is saved, and an MLflow child run of the sweep's parent run."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from torch import nn
from transformers import set_seed

from swbert.finetune.batching import COMPILE_BUCKET, resolve_unpad, unpad_collate
from swbert.finetune.checkpoint import Checkpoint, parse_checkpoints, save_finetuned
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
from swbert.finetune.trainer import (
    FinetuneConfig,
    FitOptions,
    default_device,
    fit,
    process_group,
    progress_bar,
)
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

    LABEL: ClassVar[str] = "fine-tuning"  # the sweep's name on its progress bar
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
        """The `--checkpoint` folders; fine-tuned ones share a name per variant (one folder per task)."""
        return parse_checkpoints(self.checkpoint, unique=self.tasks_per_checkpoint() > 0)

    def data_files(self) -> list[Path]:
        """The local task files the trials read (none from the Hub): their hashes are the sweep's data."""
        return []

    def tasks_per_checkpoint(self) -> int:
        """The tasks each checkpoint is fine-tuned on (the progress bar's total); 0: the checkpoints are
        fine-tuned models, only evaluated (no trials)."""
        raise NotImplementedError

    def lr_settings(self) -> list[tuple[float, ...]]:
        """One setting per learning rate (grid), or all the rates as one setting, a stage each (stepped)."""
        if self.lr_plan == "stepped":
            return [tuple(self.learning_rates)]
        return [(lr,) for lr in self.learning_rates]

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
class TrialTask:
    """One checkpoint on one task: what each of its trials trains and evaluates on (the model is made
    after seeding: the head's init depends on it) and how its MLflow runs are labelled."""

    ckpt: Checkpoint
    task: str  # its MLflow task: a GLUE task, squad1.1, squad2.0, triviaqa
    build_model: Callable[[], nn.Module]
    train_set: Any
    collate: Callable
    evaluate: Callable[[nn.Module], dict[str, float]]
    select: str  # the dev metric that picks the best epoch
    tokenizer: Any
    params: dict[str, Any]  # logged besides the hyper-parameters
    files: tuple[Path, ...] = ()  # the local data files it reads (`SweepConfig.data_files`)


@dataclass
class Trials:
    """A sweep's trials as the points of its study (records, MLflow runs) and its progress bar."""

    sweep: SweepConfig
    log: StudyLog
    options: dict[str, Any]  # study.json's (`swbert.studies.records.study_options`)
    kind: str  # glue, squad: its trials' MLflow tag swbert.kind is <kind>_trial

    def __post_init__(self) -> None:
        self.runner = PointRunner(trial_records(self.sweep), Trial.of, writes=ParallelDims.from_env().is_main)
        per_task = len(self.sweep.lr_settings()) * len(self.sweep.seeds)
        total = len(self.sweep.checkpoint) * self.sweep.tasks_per_checkpoint() * per_task
        self.bar = progress_bar(total, f"{self.sweep.LABEL} sweep", unit="run")

    def task_trials(self, work: TrialTask, keep: str | None = None) -> Summary:
        """A trial of `work` at every learning-rate setting and seed, and their summary (`keep`: --keep's)."""
        keep = keep or self.sweep.keep
        settings = itertools.product(self.sweep.lr_settings(), self.sweep.seeds)
        done = [self.trial(work, lrs, seed, save=keep != "none") for lrs, seed in settings]
        (summary,) = task_summaries(done)
        log.info("%s %s: lr %s, median %s", work.ckpt.name, work.task, summary.lr_label, summary.median)
        if keep == "median" and ParallelDims.from_env().is_main:
            prune_models(done, summary.median_trial)
        return summary

    def trial(self, work: TrialTask, lrs: tuple[float, ...], seed: int, save: bool) -> Trial:
        """One trial (`lrs`: a rate, or a stepped plan's in stage order) as a point: fine-tuned in a child
        run, its model saved (`save`), recorded; a recorded one is logged with its training run's id."""
        ckpt, cfg = work.ckpt, self.sweep.finetune_config(lrs[0], seed)
        run_name = f"{ckpt.name}/{work.task}/lr{lr_label(lrs)}/seed{seed}"
        name = f"{ckpt.name}/{work.task}/lr{'-'.join(f'{lr:g}' for lr in lrs)}-seed{seed}"
        params = self.params(work, cfg, lrs)
        tags = {KIND: f"{self.kind}_trial", VARIANT: ckpt.name, TASK: work.task, CHECKPOINT: str(ckpt.path)}

        def attempt() -> Trial:
            with self.log.live(run_name, tags, params) as run_id:
                set_seed(seed)
                model = work.build_model()
                log_metrics = functools.partial(self.log.tracker.log, run_id)  # (metrics, step)
                data = (work.train_set, work.collate, work.evaluate, work.select)
                result = fit(model, *data, cfg, log_metrics, run_name.replace("/", " "), lrs[1:])
                best = {k: v for k, v in result.best_metrics.items() if k != "epoch"}
                logged = {f"best/{k}": v for k, v in best.items()} | result.summary()
                self.log.tracker.log(run_id, logged)
                model_dir = str(self.sweep.output_dir / name) if save else ""
                if save:
                    save_finetuned(model, work.tokenizer, model_dir)
            metrics = nest_metrics(best)
            return Trial(
                ckpt.name, work.task, lrs[0], seed, metrics, model_dir, lrs[1:], run_id=run_id, logged=logged
            )

        legacy = legacy_trial(self, name, params, tags)
        # what its record stands for: the sweep's options, the trial's own, the checkpoint's files, its data
        hashes = self.options.get(DATA, {})
        mine = {f: hashes[f] for f in (str(Path(p).resolve()) for p in work.files) if f in hashes}
        facts = dict(
            checkpoint=checkpoint_fingerprint(ckpt.path), data=mine, params=flat_params(params), tags=tags
        )
        key = point_key(self.options, CHOOSES, **facts)
        settled = Settled(name, legacy, False) if legacy else self.runner.settle(name, attempt, key=key)
        if not settled.trained:
            log.info("%s: finished before (%s), not trained again", run_name, self.runner.records.path(name))
            reused = {**tags, REUSED_FROM: str(settled.result.run_id)}
            self.log.point(run_name, False, ChildRun(reused, params, settled.result.logged))
        self.bar.update(1)
        return settled.result

    def params(self, work: TrialTask, cfg: FinetuneConfig, lrs: tuple[float, ...]) -> dict[str, Any]:
        """A trial's hyper-parameters, as its MLflow run's params and its record's key hold them."""
        sweep, copied = self.sweep, ("max_seq_length", "attention_dropout", "hidden_dropout")
        return {
            **dataclasses.asdict(cfg),
            "lr_plan": sweep.lr_plan if len(lrs) > 1 else "single",
            "later_learning_rates": " ".join(f"{lr:g}" for lr in lrs[1:]),
            "attention_type": getattr(work.ckpt.config, "attention_type", ""),
            **{name: getattr(sweep, name) for name in copied},
            "batching": "unpadded" if sweep.unpadded() else "grouped",  # the Figure 3 table says it
            **work.params,
        }


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
    run around `run` (a killed sweep's runs marked KILLED), then rank 0's tables. Returns the exit status."""
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
    if sweep.tasks_per_checkpoint():  # an evaluation of fine-tuned models has no trials
        check_study(
            sweep.output_dir, f"{kind}_sweep", options, sweep.allow_study_change, trial_records(sweep)
        )
    how = dict(name=sweep.run_name, resume=False, enabled=is_main, system_metrics=True)
    # one process group for the sweep's runs (a 1-rank one in a plain process: see `process_group`)
    with process_group(), study_run(sweep.output_dir, sweep.store(), sweep.experiment, f"{kind}_sweep",
                                    dataclasses.asdict(sweep), **how) as study:  # fmt: skip
        trials = Trials(sweep, study, options, kind)
        with trials.bar:  # closed on an error too
            run(sweep, trials)
    if not is_main:
        return 0
    # the tables under <output-dir>/report, logged to the parent run and printed
    from swbert.finetune.report import build_report, collect

    folder = sweep.output_dir / "report"
    tables = build_report(collect(study.tracker.uri, sweep.experiment, [study.parent]), folder)
    study.tracker.log_artifacts(study.parent, folder, "report")  # tables and figures
    for table in tables.values():
        print(table.markdown())
    log.info("tables written to %s (re-create them with launchers/report.py)", folder)
    return 0


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
