"""GLUE and SQuAD metrics against scikit-learn/scipy, hand-worked cases and the official SQuAD rules."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from swbert.finetune.cross_domain import cross_domain_accuracy, to_binary
from swbert.finetune.metrics import (
    best_null_threshold,
    exact_match,
    glue_metrics,
    normalize_answer,
    selection_value,
    squad_scores,
    token_f1,
)
from swbert.finetune.tasks import GLUE_TASKS, get_task

# ------------------------------------------------------------------------------------------------ GLUE


def test_hand_worked_classification_metrics():
    # tp=1 fp=1 fn=1 tn=1: accuracy 0.5, F1 0.5, MCC 0
    preds, labels = np.array([1, 1, 0, 0]), np.array([1, 0, 1, 0])
    assert glue_metrics(get_task("mrpc"), preds, labels) == {"accuracy": 0.5, "f1": 0.5, "score": 0.5}
    assert glue_metrics(get_task("cola"), preds, labels)["matthews"] == 0.0
    # tp=2 fp=1 tn=1 fn=0: MCC = (2*1 - 1*0) / sqrt(3*2*2*1)
    m = glue_metrics(get_task("cola"), np.array([1, 1, 1, 0]), np.array([1, 1, 0, 0]))
    assert m["matthews"] == pytest.approx(2 / math.sqrt(12))
    assert glue_metrics(get_task("rte"), np.array([0, 1, 1, 0]), np.array([0, 1, 0, 0]))["accuracy"] == 0.75


def test_hand_worked_correlations():
    preds, labels = np.array([1.0, 2.0, 3.0, 4.0]), np.array([2.0, 4.0, 6.0, 8.5])
    m = glue_metrics(get_task("stsb"), preds, labels)
    assert m["spearman"] == pytest.approx(1.0)  # monotone
    x, y = preds - preds.mean(), labels - labels.mean()
    assert m["pearson"] == pytest.approx((x @ y) / math.sqrt((x @ x) * (y @ y)))
    assert m["score"] == pytest.approx((m["pearson"] + m["spearman"]) / 2)


@pytest.mark.parametrize("task", list(GLUE_TASKS))
def test_every_task_agrees_with_sklearn_and_scipy(task):
    t = get_task(task)
    rng = np.random.default_rng(0)
    if t.is_regression:
        labels = rng.uniform(0, 5, 200)
        preds = labels + rng.normal(0, 1.5, 200)
        expect = {"pearson": stats.pearsonr(preds, labels)[0], "spearman": stats.spearmanr(preds, labels)[0]}
    else:
        labels = rng.integers(0, t.num_labels, 200)
        preds = np.where(rng.random(200) < 0.7, labels, rng.integers(0, t.num_labels, 200))
        ref = {"accuracy": accuracy_score, "f1": f1_score, "matthews": matthews_corrcoef}
        expect = {m: ref[m](labels, preds) for m in t.metrics}
    got = glue_metrics(t, preds, labels)
    assert set(got) == set(t.metrics) | {"score"}
    for name, value in expect.items():
        assert got[name] == pytest.approx(value, abs=1e-12)
    assert got["score"] == pytest.approx(np.mean(list(expect.values())))


def test_constant_regression_is_nan_and_ranks_last():
    m = glue_metrics(get_task("stsb"), np.full(4, 2.5), np.array([1.0, 2.0, 3.0, 4.0]))
    assert math.isnan(m["pearson"]) and math.isnan(m["score"])
    assert selection_value(m["score"]) == -math.inf
    assert selection_value(0.1) == 0.1


def test_metric_input_errors():
    with pytest.raises(ValueError, match="empty split"):
        glue_metrics(get_task("sst2"), np.array([]), np.array([]))
    with pytest.raises(ValueError, match="3 predictions for 2 labels"):
        glue_metrics(get_task("sst2"), np.array([0, 1, 1]), np.array([0, 1]))


# ----------------------------------------------------------------------------------------------- SQuAD


def test_normalisation_rules():
    assert normalize_answer("The  Cat, sat!") == "cat sat"
    assert normalize_answer("an apple") == "apple"
    assert normalize_answer("Theatre") == "theatre"  # articles only as whole words
    assert normalize_answer("A-B") == "ab"  # punctuation removed, not split on
    assert exact_match("the Eiffel Tower.", "Eiffel tower") == 1.0


def test_token_f1_hand_worked():
    # "cat sat on mat" vs "cat on mat": 3 common, P = 3/4, R = 1
    assert token_f1("the cat sat on the mat", "a cat on a mat") == pytest.approx(2 * 0.75 / 1.75)
    assert token_f1("dog", "cat") == 0.0
    # repeated tokens count with multiplicity: P = R = 2/3
    assert token_f1("x b b", "b b c") == pytest.approx(2 / 3)
    # ... and the article "a" is dropped before counting: P = 1, R = 2/3
    assert token_f1("a b b", "b b c") == pytest.approx(0.8)


def test_v2_empty_answers():
    assert token_f1("", "", "2.0") == 1.0
    assert token_f1("the", "", "2.0") == 1.0  # normalises to empty
    assert token_f1("", "x", "2.0") == 0.0
    assert token_f1("x", "", "2.0") == 0.0


def test_squad_scores_max_over_gold_and_missing_predictions():
    refs = {"q1": ["Broncos", "Denver Broncos"], "q2": ["Santa Clara, California"], "q3": ["1990"]}
    preds = {"q1": "the Denver Broncos", "q2": "Santa Clara"}  # q3 missing: scored 0
    s = squad_scores(preds, refs, "1.1")
    # q1: EM 1 (second gold); q2: EM 0, F1 = 2*(2/2)*(2/3)/(1+2/3) = 0.8; q3: 0
    assert s["exact"] == pytest.approx(100 / 3)
    assert s["f1"] == pytest.approx(100 * (1 + 0.8) / 3)
    assert s["total"] == 3


def test_squad_v2_has_and_no_answer_breakdown():
    refs = {"a": ["Paris"], "b": [], "c": []}
    s = squad_scores({"a": "paris", "b": "", "c": "London"}, refs, "2.0")
    assert s["exact"] == pytest.approx(200 / 3) and s["f1"] == pytest.approx(200 / 3)
    assert (s["HasAns_exact"], s["HasAns_total"]) == (100.0, 1.0)
    assert (s["NoAns_exact"], s["NoAns_total"]) == (50.0, 2.0)


def test_squad_version_errors():
    with pytest.raises(ValueError, match="no gold answer"):
        squad_scores({"q": ""}, {"q": []}, "1.1")
    with pytest.raises(ValueError, match="version"):
        squad_scores({}, {"q": ["x"]}, "3.0")


def test_best_null_threshold_follows_the_official_search():
    refs = {"q1": ["a b"], "q2": [], "q3": ["c"]}
    best_spans = {"q1": "a b", "q2": "x", "q3": "d"}
    diffs = {"q1": -1.0, "q2": 2.0, "q3": 0.5}
    # Threshold -1: answer only q1 -> q1 right, q2 right (empty), q3 wrong = 2/3.
    out = best_null_threshold(best_spans, diffs, refs)
    assert out["best_exact"] == pytest.approx(200 / 3) and out["best_exact_thresh"] == -1.0
    assert out["best_f1"] == pytest.approx(200 / 3)


# -------------------------------------------------------------------------------------- cross-domain


def test_cross_domain_label_mapping():
    assert to_binary("mnli", np.array([0, 1, 2])).tolist() == [1, 0, 0]  # entailment only
    assert to_binary("qnli", np.array([0, 1])).tolist() == [1, 0]
    assert to_binary("qqp", np.array([0, 1])).tolist() == [0, 1]
    assert to_binary("mrpc", np.array([0, 1])).tolist() == [0, 1]
    # an MNLI model's predictions (entailment, contradiction, neutral) on QQP gold (dup, not, dup)
    assert cross_domain_accuracy("mnli", np.array([0, 2, 1]), "qqp", np.array([1, 0, 1])) == pytest.approx(
        2 / 3
    )
    with pytest.raises(ValueError, match="no cross-domain label mapping"):
        to_binary("sst2", np.array([0]))
