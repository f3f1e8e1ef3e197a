"""Evaluation metrics exactly as GLUE and SQuAD define them: GLUE's by scikit-learn and scipy, SQuAD's
by the rules of the official evaluation scripts (v1.1 and v2.0)."""

from __future__ import annotations

import collections
import math
import re
import string
from collections.abc import Mapping, Sequence

import numpy as np
from scipy import stats
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from swbert.finetune.tasks import GlueTask, MetricName


def glue_metrics(task: GlueTask, predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """GLUE's metrics for ``task`` of class indices (scores for STS-B), as fractions (correlations in
    [-1, 1]), and ``score``, their mean: what GLUE ranks by and best-checkpoint selection maximises."""
    predictions = np.asarray(predictions)
    labels = np.asarray(labels)
    if predictions.shape != labels.shape:
        raise ValueError(f"{task.name}: {predictions.shape[0]} predictions for {labels.shape[0]} labels")
    if labels.size == 0:
        raise ValueError(f"{task.name}: cannot compute metrics on an empty split")
    out = {m: _metric(m, predictions, labels) for m in task.metrics}
    out["score"] = float(np.mean([out[m] for m in task.metrics]))
    return out


def _metric(name: MetricName, predictions: np.ndarray, labels: np.ndarray) -> float:
    if name == "accuracy":
        return float(accuracy_score(labels, predictions))
    if name == "f1":
        # GLUE's F1 for MRPC and QQP is the binary F1 of class 1 (equivalent / duplicate).
        return float(f1_score(labels, predictions, pos_label=1, average="binary", zero_division=0.0))
    if name == "matthews":
        return float(matthews_corrcoef(labels, predictions))
    if name in ("pearson", "spearman"):
        if np.all(predictions == predictions.flat[0]):
            # A constant prediction has no correlation; scipy would warn and return nan.
            return float("nan")
        fn = stats.pearsonr if name == "pearson" else stats.spearmanr
        return float(fn(predictions.astype(np.float64), labels.astype(np.float64))[0])
    raise ValueError(f"unknown metric {name!r}")


def selection_value(value: float) -> float:
    """Map a metric to a value safe to maximise: nan (e.g. a constant STS-B prediction) ranks last."""
    return -math.inf if value is None or math.isnan(value) else value


# ---------------------------------------------------------------------------------------------- SQuAD


def normalize_answer(text: str) -> str:
    """The official SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str, version: str = "2.0") -> float:
    """Token-overlap F1 of the official scripts: v2.0 scores an empty prediction against an empty
    gold answer as 1 (either alone as 0); v1.1's returns 0 whenever nothing overlaps."""
    pred_toks = normalize_answer(prediction).split()
    gold_toks = normalize_answer(gold).split()
    if version == "2.0" and (not pred_toks or not gold_toks):
        return float(pred_toks == gold_toks)
    num_same = sum((collections.Counter(pred_toks) & collections.Counter(gold_toks)).values())
    if num_same == 0:
        return 0.0
    precision, recall = num_same / len(pred_toks), num_same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def _question_scores(
    predictions: Mapping[str, str], references: Mapping[str, Sequence[str]], version: str
) -> dict[str, tuple[float, float]]:
    """(exact match, F1) of every question, the maximum over its gold answers; 0 without a prediction."""
    out = {}
    for qid, answers in references.items():
        # The v2.0 script drops gold answers that normalise to nothing; none left = unanswerable.
        gold = ([a for a in answers if normalize_answer(a)] or [""]) if version == "2.0" else list(answers)
        if not gold:
            raise ValueError(
                f"question {qid!r} has no gold answer; SQuAD v1.1 has none unanswerable (use --version 2.0)"
            )
        pred = predictions.get(qid)
        if pred is None:
            out[qid] = (0.0, 0.0)
        else:
            out[qid] = (
                max(exact_match(pred, g) for g in gold),
                max(token_f1(pred, g, version) for g in gold),
            )
    return out


def squad_scores(
    predictions: Mapping[str, str], references: Mapping[str, Sequence[str]], version: str = "2.0"
) -> dict[str, float]:
    """Exact match and F1 in percent, as the official scripts: ``references`` maps every question id
    to its gold answers (none: unanswerable), a question without a prediction is wrong, and v2.0 adds
    ``HasAns_*`` / ``NoAns_*`` breakdowns."""
    if version not in ("1.1", "2.0"):
        raise ValueError(f"SQuAD version must be '1.1' or '2.0', not {version!r}")
    if not references:
        raise ValueError("no SQuAD questions to score")
    scores = _question_scores(predictions, references, version)
    groups = {"": list(references)}
    if version == "2.0":
        # As in the official script, a question "has an answer" when its answer list is non-empty.
        groups["HasAns_"] = [q for q, a in references.items() if len(a) > 0]
        groups["NoAns_"] = [q for q, a in references.items() if len(a) == 0]
    out = {}
    for prefix, ids in groups.items():
        if ids:
            out[f"{prefix}exact"] = 100.0 * float(np.mean([scores[q][0] for q in ids]))
            out[f"{prefix}f1"] = 100.0 * float(np.mean([scores[q][1] for q in ids]))
            out[f"{prefix}total"] = float(len(ids))
    return out


def best_null_threshold(
    predictions: Mapping[str, str],
    null_score_diffs: Mapping[str, float],
    references: Mapping[str, Sequence[str]],
) -> dict[str, float]:
    """The official v2.0 script's ``best_exact``/``best_f1`` over no-answer thresholds, found as its
    ``find_best_thresh`` does: ``predictions`` are the best non-null spans, ``null_score_diffs`` how
    much more the model prefers "no answer"; questions walked in increasing diff order."""
    scores = _question_scores(predictions, references, "2.0")
    no_ans = {q for q, a in references.items() if len(a) == 0}
    result: dict[str, float] = {}
    for i, metric in enumerate(("exact", "f1")):
        # Start from "answer nothing anywhere": every unanswerable question is right.
        score = best = float(len(no_ans))
        best_thresh = 0.0
        for qid in sorted(references, key=lambda q: null_score_diffs.get(q, 0.0)):
            if predictions.get(qid, ""):  # answered: -1 where there is no answer, else its score
                score += -1.0 if qid in no_ans else scores[qid][i]
            if score > best:
                best, best_thresh = score, null_score_diffs.get(qid, 0.0)
        result[f"best_{metric}"] = 100.0 * best / len(references)
        result[f"best_{metric}_thresh"] = float(best_thresh)
    return result
