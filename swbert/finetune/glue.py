"""GLUE fine-tuning sweeps (the paper's Table 1), with robustness (Table 5) and cross-domain (Table 6):
every (checkpoint, task, learning-rate setting, seed) a trial (`swbert.finetune.sweep`); what each
table reports is in docs/finetuning.md."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from torch import nn
from torch.utils.data import DataLoader

from swbert import SWBertConfig, SWBertForSequenceClassification
from swbert.finetune import cross_domain, robustness
from swbert.finetune.checkpoint import (
    Checkpoint,
    CheckpointError,
    load_tokenizer,
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
from swbert.finetune.results import (
    CHECKPOINT,
    TASK,
    VARIANT,
    Summary,
    majority_metrics,
)
from swbert.finetune.robustness import DEFAULT_LEVELS, NOISE_SCALES
from swbert.finetune.sweep import SweepConfig, Trials, TrialTask
from swbert.finetune.tasks import GLUE_TASKS, PAPER_GLUE_TASKS, GlueTask, get_task
from swbert.finetune.trainer import default_device, predict
from swbert.studies.tracking import KIND, Tracker


@dataclass(kw_only=True)
class GlueSweep(SweepConfig):
    """Everything one ``finetune_glue.py`` invocation does (its flags; see `SweepConfig` for the rest)."""

    LABEL = "GLUE"
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])  # one run per seed (ours)
    epochs: int = 10  # the appendix's GLUE epochs (per stage with --lr-plan stepped)
    attention_dropout: float = 0.1  # the appendix's GLUE attention dropout
    # GLUE tasks (mnli: matched and mismatched); the paper's eight by default, WNLI only when named
    tasks: list[str] = field(default_factory=lambda: list(PAPER_GLUE_TASKS))
    # GLUE's TSV files, GLUE's layout (CoLA/train.tsv, MNLI/dev_matched.tsv, ...): offline data;
    # default: the Hub's nyu-mll/glue (or the local datasets cache)
    data_dir: Path | None = None
    noise: bool = False  # evaluate kept models under embedding noise at the default levels (Table 5)
    noise_levels: list[float] = field(default_factory=list)  # custom noise levels (implies --noise)
    noise_seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # one noise draw per seed
    # what a noise level means (both by default, each its own table): norm = the level times the mean
    # embedding norm (the paper's levels, section 3); unit = a standard-deviation-1 draw times the level (ours)
    noise_scales: list[Literal["unit", "norm"]] = field(default_factory=lambda: list(NOISE_SCALES))
    cross_domain: bool = False  # evaluate kept MNLI/QNLI/QQP/MRPC models on each other's dev sets (Table 6)
    # --checkpoint folders are already fine-tuned GLUE models: only run --noise / --cross-domain
    evaluate_finetuned: bool = False

    def tasks_per_checkpoint(self) -> int:
        return 0 if self.evaluate_finetuned else len(self.tasks)

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
    task: GlueTask, tokenizer: Any, sweep: GlueSweep, config: SWBertConfig, with_train: bool = True
) -> TaskData:
    """The task's splits as `sweep` reads them, encoded for `config`'s model and checked to fit it."""

    def split(name: str, head: int | None) -> tuple[GlueExamples, EncodedDataset]:
        ex = load_glue_split(task, name, sweep.data_dir).head(head)
        data = encode_glue(ex, tokenizer, sweep.max_seq_length, uses_token_types(config))
        return ex, check_fits(data, config.max_position_embeddings, ex.source)

    train = split("train", sweep.max_train_samples)[1] if with_train else None
    return TaskData(task, train, {name: split(name, sweep.max_eval_samples) for name in task.dev_splits})


def load_classifier(path: Path, task: GlueTask, **overrides: Any) -> nn.Module:
    """A sequence classifier for ``task`` from a pretrained (new head) or fine-tuned (same task)
    folder; `overrides` set config fields (a sweep's dropouts: `SweepConfig.dropout`)."""
    done = getattr(SWBertConfig.from_pretrained(path), "glue_task", None)
    if done and done != task.name:
        raise CheckpointError(
            f"{path} was fine-tuned on {done}, not {task.name}; its head does not fit {task.name}"
        )
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


def classify(
    task: GlueTask, model: nn.Module, dataset: EncodedDataset, collate, batch_size: int
) -> np.ndarray:
    """The model's predicted classes (scores, for a regression task) for a whole dataset, in order."""
    (logits,) = predict(model, dataset, collate, batch_size)
    return logits[:, 0] if task.is_regression else logits.argmax(-1)


def evaluate_task(model: nn.Module, data: TaskData, collate, batch_size: int = 128) -> dict[str, float]:
    """GLUE metrics on every dev split, flat as ``<split>/<metric>``."""
    metrics = {}
    for split, (ex, enc) in data.dev.items():
        preds = classify(data.task, model, enc, collate, batch_size)
        metrics.update({f"{split}/{k}": v for k, v in glue_metrics(data.task, preds, ex.labels).items()})
    return metrics


def glue_trials(trials: Trials, ckpt: Checkpoint, data: TaskData, tokenizer: Any) -> Summary:
    """Every (learning-rate setting, seed) of one checkpoint on one task, and their summary."""
    sweep, task = trials.sweep, data.task
    collate = sweep.collate(tokenizer.pad_token_id)
    work = TrialTask(
        ckpt,
        task.name,
        lambda: load_classifier(ckpt.path, task, **sweep.dropout()),
        data.train,
        collate,
        lambda m: evaluate_task(m, data, collate, sweep.eval_batch_size) | majority_metrics(task, data.dev),
        f"{task.main_split}/score",
        tokenizer,
        {"train_examples": len(data.train)},
        tuple(sweep.task_files(task.name)),
    )
    return trials.task_trials(work)


def eval_model(path: Path, task: GlueTask) -> tuple[nn.Module, Callable]:
    """A fine-tuned classifier of `task` ready to evaluate, and its collate."""
    model = load_classifier(path, task).to(default_device()).eval()
    return model, pad_collate(model.config.pad_token_id)


def noise_evaluation(sweep: GlueSweep, tracker: Tracker, name: str, model_dir: Path, data: TaskData) -> None:
    """Table 5: evaluate a fine-tuned model under embedding noise at the sweep's levels; one MLflow run
    per (noise definition, noise seed), the level in percent as the step."""
    task, levels, seeds, batch_size = data.task, sweep.noise_levels, sweep.noise_seeds, sweep.eval_batch_size
    model, collate = eval_model(model_dir, task)
    loader = DataLoader(data.dev[task.main_split][1], batch_size=batch_size, collate_fn=collate)
    mean_norm = robustness.mean_embedding_norm(model, loader)
    evaluate = functools.partial(evaluate_task, data=data, collate=collate, batch_size=batch_size)
    tags = {KIND: "noise", VARIANT: name, TASK: task.name, CHECKPOINT: str(model_dir)}
    for scale in sweep.noise_scales:
        results = robustness.evaluate_under_noise(model, evaluate, mean_norm, levels, seeds, scale)
        for seed in seeds:
            params = {"noise_seed": seed, "noise_scale": scale, "mean_embedding_norm": mean_norm}
            with tracker.run(f"{name}/{task.name}/noise-{scale}-seed{seed}", tags, params) as rid:
                for level in levels:
                    tracker.log(rid, results[(level, seed)], step=round(level * 100))


def cross_domain_evaluation(
    name: str, models: dict[str, Path], data: dict[str, TaskData], tracker: Tracker, batch_size: int = 128
) -> None:
    """Table 6: each task's model (`models`) on the dev sets of every task of `models`, scored as
    docs/finetuning.md says (own labels on the diagonal, one binary question off it)."""
    for source, model_dir in models.items():
        source_task = get_task(source)
        model, collate = eval_model(model_dir, source_task)
        metrics = {}
        for target in models:
            for split, (ex, enc) in data[target].dev.items():
                # the source model's classes; cross_domain maps them and the target's gold labels
                preds = classify(source_task, model, enc, collate, batch_size)
                binary = cross_domain.cross_domain_accuracy(source, preds, target, ex.labels)
                own = float(np.mean(preds == np.asarray(ex.labels)))
                metrics[f"{target}/{split}/accuracy"] = own if target == source else binary
                if target == source:
                    metrics[f"{target}/{split}/binary_accuracy"] = binary
        tags = {KIND: "cross_domain", VARIANT: name, TASK: source, CHECKPOINT: str(model_dir)}
        with tracker.run(f"{name}/{source}/cross-domain", tags, {"diagonal": "own_labels"}) as rid:
            tracker.log(rid, metrics)


def evaluate_kept(
    sweep: GlueSweep, tracker: Tracker, name: str, models: dict[str, Path], data: dict[str, TaskData]
) -> None:
    """--noise and --cross-domain on one variant's kept models (task -> folder)."""
    if sweep.noise_levels:
        for task_name, model_dir in models.items():
            noise_evaluation(sweep, tracker, name, model_dir, data[task_name])
    if sweep.cross_domain:
        sources = {t: models[t] for t in cross_domain.CROSS_DOMAIN_TASKS if t in models}
        cross_domain_evaluation(name, sources, data, tracker, sweep.eval_batch_size)


def run_glue(sweep: GlueSweep, trials: Trials) -> None:
    """The whole sweep (with --evaluate-finetuned, only `evaluate_finetuned`)."""
    sweep.check()
    if sweep.evaluate_finetuned:
        evaluate_finetuned(sweep, trials.log.tracker)
        return
    for ckpt in sweep.checkpoints():
        tokenizer = load_tokenizer(ckpt.path, sweep.tokenizer, sweep.allow_tokenizer_change)
        data = {name: load_task_data(get_task(name), tokenizer, sweep, ckpt.config) for name in sweep.tasks}
        summaries = {name: glue_trials(trials, ckpt, loaded, tokenizer) for name, loaded in data.items()}
        if sweep.keep != "none":
            kept = {name: Path(summary.median_trial.model_dir) for name, summary in summaries.items()}
            evaluate_kept(sweep, trials.log.tracker, ckpt.name, kept, data)


def evaluate_finetuned(sweep: GlueSweep, tracker: Tracker) -> None:
    """Noise and/or cross-domain evaluation of already fine-tuned folders (their task is in
    config.json), grouped by their ``NAME`` (``NAME=PATH``, one folder per task)."""
    by_variant: dict[str, dict[str, Path]] = {}
    for m in sweep.checkpoints():
        task_name = getattr(m.config, "glue_task", None)
        if task_name not in GLUE_TASKS:
            raise CheckpointError(
                f"{m.path}/config.json names no glue_task; is it a GLUE model fine-tuned by swbert?"
            )
        if task_name in by_variant.setdefault(m.name, {}):
            raise CheckpointError(
                f"two {task_name} models for variant {m.name!r}: {by_variant[m.name][task_name]} and {m.path}"
            )
        by_variant[m.name][task_name] = m.path
    for name, paths in by_variant.items():
        data, fingerprints = {}, {}
        for task_name, path in paths.items():
            tok = load_tokenizer(path)
            fingerprints[path] = tokenizer_fingerprint(tok)
            if sweep.cross_domain and len(set(fingerprints.values())) > 1:
                raise CheckpointError(
                    f"{path}: its tokenizer differs from that of {next(iter(fingerprints))}; cross-domain evaluation "
                    f"needs models fine-tuned from the same pretrained checkpoint"
                )
            config = Checkpoint(name, path).config
            data[task_name] = load_task_data(get_task(task_name), tok, sweep, config, with_train=False)
        evaluate_kept(sweep, tracker, name, paths, data)
