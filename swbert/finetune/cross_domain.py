"""Cross-domain evaluation (the paper's Table 6): MNLI, QNLI, QQP and MRPC models on each other's dev
sets, a model's predicted class and the target's gold label both mapped to one binary question by
the table of docs/finetuning.md ("Cross-domain", ours)."""

from __future__ import annotations

import numpy as np
from sklearn.metrics import accuracy_score

from swbert.finetune.tasks import get_task

CROSS_DOMAIN_TASKS = ("mnli", "qnli", "qqp", "mrpc")
POSITIVE_LABEL = {"mnli": "entailment", "qnli": "entailment", "qqp": "duplicate", "mrpc": "equivalent"}


def to_binary(task_name: str, label_ids: np.ndarray) -> np.ndarray:
    """Class indices of ``task_name`` -> 1 for its positive label, 0 otherwise."""
    task = get_task(task_name)
    if task.name not in POSITIVE_LABEL:
        raise ValueError(
            f"{task.name} has no cross-domain label mapping; use one of {', '.join(CROSS_DOMAIN_TASKS)}"
        )
    positive = task.label_names.index(POSITIVE_LABEL[task.name])
    return (np.asarray(label_ids) == positive).astype(np.int64)


def cross_domain_accuracy(source: str, predictions: np.ndarray, target: str, labels: np.ndarray) -> float:
    """Accuracy of a ``source`` model's predicted classes on ``target`` gold labels, in the shared space."""
    return float(accuracy_score(to_binary(target, labels), to_binary(source, predictions)))
