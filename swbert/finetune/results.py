"""From trials (one fine-tuning run each) to one number per variant and task.

For each variant and task: the median over seeds of every metric, at the learning-rate setting whose
median selection score on the main dev split is best. This is our aggregation, not the paper's (it does
not say how it combines seeds; docs/paper.md). The launchers print this at the end of a sweep and the
report command computes it again from MLflow, with the same function.
"""

from __future__ import annotations

import math
import shutil
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from swbert.finetune.tasks import get_task

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
    metrics: dict[str, dict[str, float]]
    """split -> metric -> value (GLUE: fractions; SQuAD: percent, as the official scripts)."""
    model_dir: str = ""
    """Where the fine-tuned model was saved ("" when it was not kept)."""
    later_lrs: tuple[float, ...] = ()
    """A stepped plan's later learning rates (each stage continuing from the best weights so far);
    () for a run at one learning rate."""
    status: str = "done"
    reason: str = ""
    run_id: str | None = None  # the MLflow run that trained it
    logged: dict[str, float] = field(default_factory=dict)  # the metrics that run logged last

    @property
    def lr_setting(self) -> tuple[float, ...]:
        return (self.learning_rate, *self.later_lrs)

    @classmethod
    def of(cls, recorded: dict[str, Any]) -> Trial:
        """A recorded trial; a model removed since (`--keep median` pruned it) reads as not kept."""
        trial = cls(**{**recorded, "later_lrs": tuple(recorded["later_lrs"])})
        trial.model_dir = trial.model_dir if trial.model_dir and Path(trial.model_dir).is_dir() else ""
        return trial


@dataclass
class Summary:
    variant: str
    task: str
    learning_rate: float
    seeds: list[int]
    median: dict[str, dict[str, float]]
    """split -> metric -> median over seeds."""
    median_trial: Trial
    """The trial whose selection score is nearest the median (the one kept for noise/cross-domain)."""
    per_lr: dict[tuple[float, ...], float] = field(default_factory=dict)
    """Learning-rate setting (one rate, or a stepped sequence) -> median selection score."""
    later_lrs: tuple[float, ...] = ()
    """The chosen setting's later rates when it is a stepped plan."""

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


def _nanmedian(values: list[float]) -> float:
    finite = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.median(finite)) if finite else float("nan")


def summarize(
    trials: list[Trial], main_split: dict[str, str], select_metric: dict[str, str]
) -> list[Summary]:
    """Median over seeds at the best learning-rate setting, per (variant, task). This aggregation is
    ours: the paper does not say how it combines seeds (docs/paper.md).

    ``main_split[task]`` and ``select_metric[task]`` name the split and metric that pick the setting
    (GLUE: the task score on the matched/only dev split; SQuAD: F1). A setting is one learning rate, or
    a stepped plan's sequence of rates.
    """
    groups: dict[tuple[str, str], dict[tuple[float, ...], list[Trial]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for t in trials:
        groups[(t.variant, t.task)][t.lr_setting].append(t)
    out = []
    for (variant, task), by_lr in groups.items():
        split, metric = main_split[task], select_metric[task]

        def score(t: Trial, split: str = split, metric: str = metric) -> float:
            return t.metrics.get(split, {}).get(metric, float("nan"))

        per_lr = {lr: _nanmedian([score(t) for t in ts]) for lr, ts in by_lr.items()}
        # ties: the smaller rates (as before for single rates)
        best = max(
            per_lr,
            key=lambda k: (-math.inf if math.isnan(per_lr[k]) else per_lr[k], tuple(-x for x in k)),
        )
        chosen = sorted(by_lr[best], key=lambda t: t.seed)
        median: dict[str, dict[str, float]] = {}
        for sp in sorted({s for t in chosen for s in t.metrics}):
            names = sorted({m for t in chosen for m in t.metrics.get(sp, {})})
            median[sp] = {
                m: _nanmedian([t.metrics.get(sp, {}).get(m, float("nan")) for t in chosen]) for m in names
            }
        target = per_lr[best]
        nearest = min(
            chosen, key=lambda t: (abs(score(t) - target) if not math.isnan(score(t)) else math.inf, t.seed)
        )
        out.append(
            Summary(variant, task, best[0], [t.seed for t in chosen], median, nearest, per_lr, best[1:])
        )
    return sorted(out, key=lambda s: (s.variant, s.task))


def task_summaries(trials: list[Trial]) -> list[Summary]:
    """`summarize` with each task's selection: SQuAD and TriviaQA by dev F1, a GLUE task by its
    score on its main dev split."""
    splits, metrics = {}, {}
    for name in {t.task for t in trials}:
        qa = name.startswith("squad") or name == "triviaqa"
        splits[name], metrics[name] = ("validation", "f1") if qa else (get_task(name).main_split, "score")
    return summarize(trials, splits, metrics)
