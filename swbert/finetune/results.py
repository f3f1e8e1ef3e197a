"""From trials (one fine-tuning run each) to one number per variant and task: the median over seeds
of every metric at the learning-rate setting with the best median selection score on the main dev
split (ours: the paper does not say how it combines seeds; docs/paper.md), with the spread over those
seeds and the seeds that scored at chance level (`at_chance`, ours), which a median can hide. Sweeps
print it at their end; the report computes it again from MLflow."""

from __future__ import annotations

import math
import shutil
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from swbert.finetune.figures import noise_metric
from swbert.finetune.tasks import GlueTask, get_task

# the MLflow tags of fine-tuning's child runs besides swbert.kind (what the report reads)
VARIANT, TASK, CHECKPOINT = "swbert.variant", "swbert.task", "swbert.checkpoint"
DEFAULT_EXPERIMENT = "swbert-finetune"


def lr_label(lrs: tuple[float, ...] | list[float]) -> str:
    """``0.0001`` for one rate, ``0.0001>2e-05>2e-06`` for a stepped sequence (run names, tables)."""
    return ">".join(f"{lr:g}" for lr in lrs)


@dataclass
class Trial:
    """One fine-tuning run: the best-epoch dev metrics of every evaluation split (and, as a sweep's
    point, what its record holds)."""

    variant: str
    task: str
    learning_rate: float
    seed: int
    metrics: dict[str, dict[str, float]]  # split -> metric -> value (GLUE: fractions; SQuAD: percent)
    model_dir: str = ""  # where the fine-tuned model was saved ("" when it was not kept)
    # a stepped plan's later learning rates (each stage continuing from the best weights so far)
    later_lrs: tuple[float, ...] = ()
    status: str = "done"
    reason: str = ""
    run_id: str | None = None  # the MLflow run that trained it
    logged: dict[str, float] = field(default_factory=dict)  # the metrics that run logged last

    @classmethod
    def of(cls, recorded: dict[str, Any]) -> Trial:
        """A recorded trial; a model removed since (`--keep median` pruned it) reads as not kept."""
        trial = cls(**{**recorded, "later_lrs": tuple(recorded["later_lrs"])})
        trial.model_dir = trial.model_dir if trial.model_dir and Path(trial.model_dir).is_dir() else ""
        return trial


@dataclass
class Summary:
    """One variant on one task: the median over seeds at the best learning-rate setting."""

    variant: str
    task: str
    learning_rate: float
    seeds: list[int]
    median: dict[str, dict[str, float]]  # split -> metric -> median over seeds
    # the trial whose selection score is nearest the median (the one kept for noise/cross-domain)
    median_trial: Trial
    later_lrs: tuple[float, ...] = ()  # the chosen setting's later rates when it is a stepped plan
    # split -> metric -> (lowest, highest, number of seeds with a value) over the chosen seeds
    spread: dict[str, dict[str, tuple[float, float, int]]] = field(default_factory=dict)
    # seed -> its score (`chance_metric`) for the chosen seeds that scored at chance level
    at_chance: dict[int, float] = field(default_factory=dict)
    chance: float = float("nan")  # the task's `chance_score` those seeds are judged against

    @property
    def lr_label(self) -> str:
        """``2e-05``, or ``0.0001>2e-05>2e-06`` for a stepped plan."""
        return lr_label((self.learning_rate, *self.later_lrs))


def nest_metrics(flat: dict[str, float]) -> dict[str, dict[str, float]]:
    """``{"validation/accuracy": x}`` -> ``{"validation": {"accuracy": x}}`` (keys without a split dropped)."""
    out: dict[str, dict[str, float]] = {}
    for key, value in flat.items():
        split, _, metric = key.rpartition("/")
        if split:
            out.setdefault(split, {})[metric] = value
    return out


def prune_models(trials: list[Trial], keep: Trial) -> None:
    """Delete the saved models of ``trials`` except ``keep``'s (call on rank 0 only)."""
    for t in trials:
        if t.model_dir and t.model_dir != keep.model_dir:
            shutil.rmtree(t.model_dir, ignore_errors=True)


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if v is not None and not math.isnan(v)]


def _nanmedian(values: list[float]) -> float:
    finite = _finite(values)
    return float(np.median(finite)) if finite else float("nan")


def _over_seeds(chosen: list[Trial]) -> tuple[dict, dict]:
    """The median (`Summary.median`) and the spread (`Summary.spread`) of every metric over `chosen`."""
    median: dict[str, dict[str, float]] = {}
    spread: dict[str, dict[str, tuple[float, float, int]]] = {}
    for sp in sorted({s for t in chosen for s in t.metrics}):
        median[sp] = {}
        for m in sorted({m for t in chosen for m in t.metrics.get(sp, {})}):
            values = [t.metrics.get(sp, {}).get(m, float("nan")) for t in chosen]
            median[sp][m] = _nanmedian(values)
            finite = _finite(values)
            if finite:
                spread.setdefault(sp, {})[m] = (min(finite), max(finite), len(finite))
    return median, spread


# ------------------------------------------------------------------------------ chance level (ours)
# A seed "at chance" scored no better than a model that learned nothing; the report flags a median
# that hides one. The paper reports no per-seed numbers: this definition and its margin are ours.

# How far above its chance score a seed still counts as at chance: 2 points of accuracy, MCC or
# correlation (GLUE metrics are fractions; SQuAD's are percent, so 2.0 there)
CHANCE_MARGIN = 0.02
CHANCE_RULE = (  # `at_chance` in words, for the tables' notes
    "ours: accuracy at most 2 points above the dev labels' majority class (1/classes for runs that "
    "did not log it), MCC or correlation at most 0.02 or none, SQuAD F1 at most 2 above answering nothing"
)
# What a GLUE trial logs per dev split beside its metrics: the accuracy of always predicting the most
# frequent class of the split's labels (`majority_metrics`)
MAJORITY = "majority_accuracy"


def is_qa(task: str) -> bool:
    """SQuAD (``squad1.1``, ``squad2.0``) or TriviaQA, not a GLUE task."""
    return task.startswith("squad") or task == "triviaqa"


def majority_metrics(task: GlueTask, dev: Mapping[str, tuple[Any, Any]]) -> dict[str, float]:
    """``<split>/majority_accuracy`` of each dev split (``split -> (examples, encoded)``) of a
    classification task; none for a regression task (STS-B)."""
    if task.is_regression:
        return {}
    out = {}
    for split, (examples, _) in dev.items():
        counts = np.bincount(np.asarray(examples.labels, dtype=np.int64), minlength=task.num_labels)
        out[f"{split}/{MAJORITY}"] = float(counts.max() / max(1, counts.sum()))
    return out


def chance_metric(task: str) -> tuple[str, str]:
    """(split, metric) a trial of `task` is judged on: the main dev split's accuracy where the task
    has one, else its own metric (CoLA: MCC, STS-B: Pearson); F1 for SQuAD and TriviaQA."""
    if is_qa(task):
        return "validation", "f1"
    t = get_task(task)
    return t.main_split, noise_metric(t)


def chance_score(trial: Trial) -> float:
    """What a model that learned nothing scores on `chance_metric` (ours). Accuracy: the majority
    class's share of the dev labels the trial logged (`MAJORITY`), else 1 / the number of classes
    (uniform guessing, for runs that did not log it). MCC and correlations: 0. SQuAD v2.0: the share of
    unanswerable questions (answering none gets those right), else 0 (v1.1, TriviaQA). In the metric's
    units: GLUE fractions, SQuAD percent."""
    split, metric = chance_metric(trial.task)
    got = trial.metrics.get(split, {})
    if is_qa(trial.task):
        total, unanswerable = got.get("total"), got.get("NoAns_total")
        return 100.0 * unanswerable / total if total and unanswerable else 0.0
    if metric == "accuracy":
        return got.get(MAJORITY, 1.0 / get_task(trial.task).num_labels)
    return 0.0


def _chance_value(trial: Trial) -> float | None:
    split, metric = chance_metric(trial.task)
    return trial.metrics.get(split, {}).get(metric, float("nan"))


def at_chance(trial: Trial) -> bool:
    """Whether the trial scored at most `CHANCE_MARGIN` above its `chance_score` (or below it). A
    correlation with no value counts as at chance: a constant prediction has none (`glue_metrics`)."""
    value = _chance_value(trial)
    if value is None or math.isnan(value):
        return chance_metric(trial.task)[1] in ("pearson", "spearman")
    return value <= chance_score(trial) + CHANCE_MARGIN * (100.0 if is_qa(trial.task) else 1.0)


def task_summaries(trials: list[Trial]) -> list[Summary]:
    """Median over seeds at the best learning-rate setting, per (variant, task), sorted by both. This
    aggregation is ours: the paper does not say how it combines seeds (docs/paper.md). A setting is one
    learning rate, or a stepped plan's sequence of rates."""
    groups: dict[tuple[str, str], dict[tuple[float, ...], list[Trial]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for t in trials:
        groups[(t.variant, t.task)][(t.learning_rate, *t.later_lrs)].append(t)
    return sorted(map(_summary, groups.values()), key=lambda s: (s.variant, s.task))


def _summary(by_lr: dict[tuple[float, ...], list[Trial]]) -> Summary:
    """One variant and task from its trials by learning-rate setting, picked on the main dev split:
    SQuAD and TriviaQA by F1, a GLUE task by its score."""
    first = next(iter(by_lr.values()))[0]
    split, metric = chance_metric(first.task)
    metric = metric if is_qa(first.task) else "score"

    def score(t: Trial) -> float:
        return t.metrics.get(split, {}).get(metric, float("nan"))

    per_lr = {lrs: _nanmedian([score(t) for t in ts]) for lrs, ts in by_lr.items()}
    # ties: the smaller rates
    best = max(per_lr, key=lambda k: (-math.inf if math.isnan(per_lr[k]) else per_lr[k], [-x for x in k]))
    chosen = sorted(by_lr[best], key=lambda t: t.seed)
    median, spread = _over_seeds(chosen)

    def distance(t: Trial) -> tuple[float, int]:  # to the median score; a trial without one is last
        return (math.inf if math.isnan(score(t)) else abs(score(t) - per_lr[best]), t.seed)

    nearest = min(chosen, key=distance)
    seeds = [t.seed for t in chosen]
    summary = Summary(first.variant, first.task, best[0], seeds, median, nearest, best[1:], spread)
    summary.chance = chance_score(nearest)
    summary.at_chance = {t.seed: _chance_value(t) for t in chosen if at_chance(t)}
    return summary
