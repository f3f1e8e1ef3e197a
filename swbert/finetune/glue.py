"""GLUE fine-tuning sweeps (the paper's Table 1), with robustness (Table 5) and cross-domain (Table 6).

For every checkpoint (a variant), task, learning rate and seed: fine-tune, keep the best dev epoch,
log to MLflow. Per task, the reported number is the median over seeds at the learning rate with the
best median (see :mod:`swbert.finetune.results`); the median seed's model is kept on disk for the noise
and cross-domain evaluations.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from swbert import SWBertConfig, SWBertForSequenceClassification
from swbert.finetune import cross_domain, robustness
from swbert.finetune.checkpoint import (
    Checkpoint,
    CheckpointError,
    load_tokenizer,
    parse_checkpoints,
    tokenizer_fingerprint,
    uses_token_types,
)
from swbert.finetune.glue_data import (
    EncodedDataset,
    GlueExamples,
    check_fits,
    encode_glue,
    load_glue_split,
    pad_collate,
    split_file,
)
from swbert.finetune.metrics import glue_metrics
from swbert.finetune.results import CHECKPOINT, TASK, VARIANT, Summary, Trial, prune_models, summarize
from swbert.finetune.robustness import DEFAULT_LEVELS, NOISE_SCALES, NoiseScale
from swbert.finetune.sweep import SweepConfig, Trials, TrialSpec, TrialTask, run_trial
from swbert.finetune.tasks import GLUE_TASKS, PAPER_GLUE_TASKS, GlueTask, get_task
from swbert.finetune.trainer import default_device, move, progress_bar
from swbert.runtime.ranks import ParallelDims
from swbert.studies.tracking import KIND, Tracker

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class GlueSweep(SweepConfig):
    """Everything one ``finetune_glue.py`` invocation does (its flags; see `SweepConfig` for the rest)."""

    seeds: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])  # one run per seed (ours)
    epochs: int = 10  # the appendix's GLUE epochs (per stage with --lr-plan stepped)
    attention_dropout: float = 0.1  # the appendix's GLUE attention dropout
    # GLUE tasks (mnli: matched and mismatched); the paper's eight by default, WNLI only when named
    tasks: list[str] = field(default_factory=lambda: list(PAPER_GLUE_TASKS))
    # GLUE's TSV files, GLUE's layout (CoLA/train.tsv, MNLI/dev_matched.tsv, ...): offline data;
    # default: the Hub's nyu-mll/glue (or the local datasets cache)
    data_dir: Path | None = None
    max_seq_length: int = 128  # tokens per example, pairs as [CLS] a [SEP] b [SEP] (ours)
    noise: bool = False  # evaluate kept models under embedding noise at the default levels (Table 5)
    noise_levels: list[float] = field(default_factory=list)  # custom noise levels (implies --noise)
    noise_seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # one noise draw per seed
    # what a noise level means (both by default, each its own table): norm = the level times the mean
    # embedding norm (the paper's levels, section 3); unit = a standard-deviation-1 draw times the level (ours)
    noise_scales: list[Literal["unit", "norm"]] = field(default_factory=lambda: list(NOISE_SCALES))
    cross_domain: bool = False  # evaluate kept MNLI/QNLI/QQP/MRPC models on each other's dev sets (Table 6)
    # --checkpoint folders are already fine-tuned GLUE models: only run --noise / --cross-domain
    evaluate_finetuned: bool = False

    def checkpoints(self) -> list[Checkpoint]:
        """The `--checkpoint` folders; fine-tuned ones share a name per variant (one folder per task)."""
        return parse_checkpoints(self.checkpoint, unique=not self.evaluate_finetuned)

    def task_files(self, name: str) -> list[Path]:
        """The TSV files of task `name` under --data-dir (none from the Hub)."""
        if self.data_dir is None:
            return []
        task = get_task(name)
        paths = [self.data_dir / task.tsv_dir / split_file(task, s) for s in ("train", *task.dev_splits)]
        return [p for p in paths if p.is_file()]  # a missing one is named when it is read

    def data_files(self) -> list[Path]:
        return [f for name in self.tasks for f in self.task_files(name)]

    def check(self) -> None:
        super().check()
        for name in self.tasks:
            get_task(name)
        if self.noise and not self.noise_levels:
            self.noise_levels = list(DEFAULT_LEVELS)
        if self.evaluate_finetuned:
            if not (self.noise_levels or self.cross_domain):
                raise ValueError("--evaluate-finetuned needs --noise, --noise-levels or --cross-domain")
            return
        if (self.noise_levels or self.cross_domain) and self.keep == "none":
            raise ValueError(
                "--noise-levels and --cross-domain evaluate saved models: use --keep median or all"
            )
        if self.cross_domain and len(set(self.tasks) & set(cross_domain.CROSS_DOMAIN_TASKS)) < 2:
            raise ValueError(
                f"--cross-domain needs at least two of {', '.join(cross_domain.CROSS_DOMAIN_TASKS)} in --tasks"
            )


@dataclass
class TaskData:
    task: GlueTask
    train: EncodedDataset | None
    dev: dict[str, tuple[GlueExamples, EncodedDataset]]


def load_task_data(
    task: GlueTask,
    tokenizer,
    data_dir: Path | None,
    max_length: int,
    token_types: bool,
    max_train: int | None = None,
    max_eval: int | None = None,
    with_train: bool = True,
    positions: int | None = None,
) -> TaskData:
    """The task's splits, encoded; every example checked to fit the model's `positions`."""

    def encoded(ex: GlueExamples) -> EncodedDataset:
        data = encode_glue(ex, tokenizer, max_length, token_types)
        return data if positions is None else check_fits(data, positions, ex.source)

    train = encoded(load_glue_split(task, "train", data_dir).head(max_train)) if with_train else None
    dev = {}
    for split in task.dev_splits:
        ex = load_glue_split(task, split, data_dir).head(max_eval)
        dev[split] = (ex, encoded(ex))
    return TaskData(task, train, dev)


def load_classifier(
    path: Path, task: GlueTask, attention_dropout: float | None = None, hidden_dropout: float | None = None
) -> nn.Module:
    """A sequence classifier for ``task`` from a pretrained (new head) or fine-tuned (same task) folder."""
    done = getattr(SWBertConfig.from_pretrained(path), "glue_task", None)
    if done and done != task.name:
        raise CheckpointError(
            f"{path} was fine-tuned on {done}, not {task.name}; its head does not fit {task.name}"
        )
    overrides: dict = {}
    if attention_dropout is not None:
        overrides["attention_probs_dropout_prob"] = attention_dropout
    if hidden_dropout is not None:
        overrides["hidden_dropout_prob"] = hidden_dropout
    labels = list(task.label_names) or ["score"]
    model = SWBertForSequenceClassification.from_pretrained(
        path,
        num_labels=task.num_labels,
        problem_type="regression" if task.is_regression else "single_label_classification",
        id2label=dict(enumerate(labels)),
        label2id={n: i for i, n in enumerate(labels)},
        **overrides,
    )
    model.config.glue_task = task.name  # saved with the model: what its head was trained for
    return model


@torch.no_grad()
def predict(model: nn.Module, dataset: EncodedDataset, collate, batch_size: int = 128) -> np.ndarray:
    """Logits for a whole dataset, in order."""
    device = next(model.parameters()).device
    out = []
    for batch in DataLoader(dataset, batch_size=batch_size, collate_fn=collate):
        batch = move({k: v for k, v in batch.items() if k != "labels"}, device)
        out.append(model(**batch).logits.float().cpu())
    return torch.cat(out).numpy()


def to_predictions(task: GlueTask, logits: np.ndarray) -> np.ndarray:
    return logits[:, 0] if task.is_regression else logits.argmax(-1)


def evaluate_task(model: nn.Module, data: TaskData, collate, batch_size: int = 128) -> dict[str, float]:
    """GLUE metrics on every dev split, flat as ``<split>/<metric>``."""
    metrics = {}
    for split, (ex, enc) in data.dev.items():
        preds = to_predictions(data.task, predict(model, enc, collate, batch_size))
        metrics.update({f"{split}/{k}": v for k, v in glue_metrics(data.task, preds, ex.labels).items()})
    return metrics


def glue_trial(
    trials: Trials, ckpt: Checkpoint, data: TaskData, tokenizer, lrs: tuple[float, ...], seed: int
) -> Trial:
    """Fine-tune one (checkpoint, task, learning-rate setting, seed) and log it as a child run."""
    sweep, task = trials.sweep, data.task
    params = {
        "max_seq_length": sweep.max_seq_length,
        "attention_dropout": sweep.attention_dropout,
        "hidden_dropout": sweep.hidden_dropout,
        "train_examples": len(data.train),
        "batching": sweep.batching(),
    }
    collate = sweep.collate(tokenizer.pad_token_id)
    files = tuple(sweep.task_files(task.name))
    return run_trial(
        trials,
        TrialSpec(ckpt, task.name, lrs, seed, "glue_trial", params, files),
        TrialTask(
            lambda: load_classifier(ckpt.path, task, sweep.attention_dropout, sweep.hidden_dropout),
            data.train,
            collate,
            lambda m: evaluate_task(m, data, collate, sweep.eval_batch_size),
            f"{task.main_split}/score",
            tokenizer,
        ),
    )


def glue_summaries(trials: list[Trial]) -> list[Summary]:
    tasks = {t.task for t in trials}
    return summarize(trials, {n: get_task(n).main_split for n in tasks}, {n: "score" for n in tasks})


def noise_evaluation(
    name: str,
    model_dir: Path,
    data: TaskData,
    levels,
    seeds,
    tracker: Tracker,
    batch_size: int = 128,
    scales: list[NoiseScale] | tuple[NoiseScale, ...] = NOISE_SCALES,
) -> dict:
    """Table 5: evaluate a fine-tuned model under embedding noise; one MLflow run per (noise definition,
    noise seed), the level in percent as the step."""
    task = data.task
    model = load_classifier(model_dir, task).to(default_device()).eval()
    collate = pad_collate(model.config.pad_token_id)
    _, main_enc = data.dev[task.main_split]
    mean_norm = robustness.mean_embedding_norm(
        model, DataLoader(main_enc, batch_size=batch_size, collate_fn=collate)
    )
    out = {}
    for scale in scales:
        results = robustness.evaluate_under_noise(
            model, lambda m: evaluate_task(m, data, collate, batch_size), mean_norm, levels, seeds, scale
        )
        for seed in seeds:
            tags = {KIND: "noise", VARIANT: name, TASK: task.name, CHECKPOINT: str(model_dir)}
            params = {"noise_seed": seed, "noise_scale": scale, "mean_embedding_norm": mean_norm}
            with tracker.run(f"{name}/{task.name}/noise-{scale}-seed{seed}", tags, params) as rid:
                for level in levels:
                    tracker.log(rid, results[(level, seed)], step=round(level * 100))
        out[scale] = results
    return out


def cross_domain_evaluation(
    name: str, models: dict[str, Path], data: dict[str, TaskData], tracker: Tracker, batch_size: int = 128
) -> dict:
    """Table 6: each trained-on task's model on every evaluated-on task's dev sets. Off the diagonal the
    predicted and gold classes are mapped to one binary question (binary accuracy); on the diagonal the
    model is scored with its own task's labels (MNLI: 3-way accuracy), and the binary score is logged
    beside it as ``binary_accuracy``."""
    out = {}
    for source, model_dir in models.items():
        source_task = get_task(source)
        model = load_classifier(model_dir, source_task).to(default_device()).eval()
        collate = pad_collate(model.config.pad_token_id)
        metrics = {}
        for target, td in data.items():
            for split, (ex, enc) in td.dev.items():
                # the source model's classes; cross_domain maps them and the target's gold labels
                preds = to_predictions(source_task, predict(model, enc, collate, batch_size))
                binary = cross_domain.cross_domain_accuracy(source, preds, target, ex.labels)
                if target == source:
                    metrics[f"{target}/{split}/accuracy"] = float(np.mean(preds == np.asarray(ex.labels)))
                    metrics[f"{target}/{split}/binary_accuracy"] = binary
                else:
                    metrics[f"{target}/{split}/accuracy"] = binary
        tags = {KIND: "cross_domain", VARIANT: name, TASK: source, CHECKPOINT: str(model_dir)}
        with tracker.run(f"{name}/{source}/cross-domain", tags, {"diagonal": "own_labels"}) as rid:
            tracker.log(rid, metrics)
        out[source] = metrics
    return out


def run_glue(sweep: GlueSweep, trials: Trials) -> tuple[list[Trial], list[Summary]]:
    """The whole sweep; returns every trial and the per-(variant, task) summaries. With
    `evaluate_finetuned`, only the noise and cross-domain evaluations of already fine-tuned folders."""
    sweep.check()
    tracker = trials.log.tracker
    if sweep.evaluate_finetuned:
        evaluate_finetuned(
            sweep.checkpoints(),
            sweep.data_dir,
            tracker,
            sweep.max_seq_length,
            sweep.noise_levels,
            sweep.noise_seeds,
            sweep.cross_domain,
            sweep.max_eval_samples,
            sweep.eval_batch_size,
            sweep.noise_scales,
        )
        return [], []
    checkpoints = sweep.checkpoints()
    done: list[Trial] = []
    runs = len(checkpoints) * len(sweep.tasks) * len(sweep.lr_settings()) * len(sweep.seeds)
    bar = progress_bar(runs, "GLUE sweep", unit="run")
    for ckpt in checkpoints:
        tokenizer = load_tokenizer(ckpt.path, sweep.tokenizer, sweep.allow_tokenizer_change)
        kept: dict[str, Path] = {}
        datas: dict[str, TaskData] = {}
        for name in sweep.tasks:
            data = load_task_data(
                get_task(name),
                tokenizer,
                sweep.data_dir,
                sweep.max_seq_length,
                uses_token_types(ckpt.config),
                sweep.max_train_samples,
                sweep.max_eval_samples,
                positions=ckpt.config.max_position_embeddings,
            )
            datas[data.task.name] = data
            done += _task_trials(trials, ckpt, data, tokenizer, bar, kept)
        if sweep.cross_domain:
            sources = {t: kept[t] for t in cross_domain.CROSS_DOMAIN_TASKS if t in kept}
            cross_domain_evaluation(
                ckpt.name, sources, {t: datas[t] for t in sources}, tracker, sweep.eval_batch_size
            )
    bar.close()
    return done, glue_summaries(done)


def _task_trials(
    trials: Trials, ckpt: Checkpoint, data: TaskData, tokenizer: Any, bar: Any, kept: dict[str, Path]
) -> list[Trial]:
    """One checkpoint on one task: a trial per rate setting and seed; the median trial's folder kept
    (in `kept`) and its noise evaluation run when asked."""
    sweep, task_trials = trials.sweep, []
    for lrs in sweep.lr_settings():
        for seed in sweep.seeds:
            task_trials.append(glue_trial(trials, ckpt, data, tokenizer, lrs, seed))
            bar.update(1)
    (summary,) = glue_summaries(task_trials)
    task = data.task.name
    log.info("%s %s: lr %s, median %s", ckpt.name, task, summary.lr_label, summary.median)
    if sweep.keep == "median" and ParallelDims.from_env().is_main:
        prune_models(task_trials, summary.median_trial)
    if sweep.keep != "none":
        kept[task] = Path(summary.median_trial.model_dir)
    if sweep.noise_levels:
        noise_evaluation(
            ckpt.name,
            kept[task],
            data,
            sweep.noise_levels,
            sweep.noise_seeds,
            trials.log.tracker,
            sweep.eval_batch_size,
            sweep.noise_scales,
        )
    return task_trials


def _by_variant(models: list[Checkpoint]) -> dict[str, dict[str, Path]]:
    """variant name -> task -> fine-tuned folder (the task read from each folder's config.json)."""
    by_variant: dict[str, dict[str, Path]] = {}
    for m in models:
        task_name = getattr(m.config, "glue_task", None)
        if not task_name or task_name not in GLUE_TASKS:
            raise CheckpointError(
                f"{m.path}/config.json names no glue_task; is it a GLUE model fine-tuned by swbert?"
            )
        if task_name in by_variant.setdefault(m.name, {}):
            raise CheckpointError(
                f"two {task_name} models for variant {m.name!r}: {by_variant[m.name][task_name]} and {m.path}"
            )
        by_variant[m.name][task_name] = m.path
    return by_variant


def evaluate_finetuned(
    models: list[Checkpoint],
    data_dir: Path | None,
    tracker: Tracker,
    max_seq_length: int = 128,
    noise_levels: list[float] | None = None,
    noise_seeds: list[int] | None = None,
    cross: bool = False,
    max_eval_samples: int | None = None,
    batch_size: int = 128,
    noise_scales: list[NoiseScale] | tuple[NoiseScale, ...] = NOISE_SCALES,
) -> None:
    """Noise and/or cross-domain evaluation of already fine-tuned folders (their task is in config.json).

    Models of one variant are grouped by their ``NAME`` (``NAME=PATH``, one folder per task).
    """
    for name, paths in _by_variant(models).items():
        datas, fingerprints = {}, {}
        for task_name, path in paths.items():
            tok = load_tokenizer(path)
            fingerprints[path] = tokenizer_fingerprint(tok)
            if cross and len(set(fingerprints.values())) > 1:
                raise CheckpointError(
                    f"{path}: its tokenizer differs from that of {next(iter(fingerprints))}; cross-domain evaluation "
                    f"needs models fine-tuned from the same pretrained checkpoint"
                )
            task = get_task(task_name)
            datas[task_name] = load_task_data(
                task,
                tok,
                data_dir,
                max_seq_length,
                uses_token_types(Checkpoint(name, path).config),
                max_eval=max_eval_samples,
                with_train=False,
            )
            if noise_levels:
                noise_evaluation(
                    name,
                    path,
                    datas[task_name],
                    noise_levels,
                    noise_seeds or [0],
                    tracker,
                    batch_size,
                    noise_scales,
                )
        if cross:
            sources = {t: p for t, p in paths.items() if t in cross_domain.CROSS_DOMAIN_TASKS}
            cross_domain_evaluation(name, sources, {t: datas[t] for t in sources}, tracker, batch_size)
