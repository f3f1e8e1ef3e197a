"""Pretraining with --document-attention (ours): a real run through the loader's workers, the
engine and validation, and the settings it cannot run with refused before any work."""

from __future__ import annotations

import math

import pytest

from swbert.training.config import TrainConfig
from tests.launch_utils import read_metrics, run_single


@pytest.mark.slow  # a 1-rank run (about 15 s)
def test_a_run_with_document_attention_trains_and_differs_from_plain_attention(data_dir, tmp_path):
    losses = {}
    for name, flag in (("documents", "true"), ("plain", "false")):
        out = tmp_path / name
        args = ["--config", "tiny_cpu", "--data-dir", str(data_dir), "--output-dir", str(out)]
        args += ["--train-steps", "6", "--log-interval", "2", "--eval-interval", "6", "--save-interval", "6"]
        result = run_single([*args, "--mlflow", "false", "--export", "false", "--document-attention", flag])
        assert result.returncode == 0, result.stderr[-3000:]
        metrics = read_metrics(out)
        losses[name] = [metrics[s]["loss"] for s in (2, 4, 6)]
        assert all(math.isfinite(v) for v in losses[name]) and math.isfinite(metrics[6]["val_loss"])
    assert losses["documents"][0] != losses["plain"][0]  # the same batches, attention cut at documents
    # a resume may not switch it silently: it changes what every position attends to
    more = [*args, "--mlflow", "false", "--export", "false", "--train-steps", "8", "--resume", "auto"]
    switched = run_single([*more, "--document-attention", "true"])
    assert switched.returncode != 0
    assert "document_attention: checkpoint False vs this run True" in switched.stderr, switched.stderr[-2000:]
    assert "--allow-resume-change document_attention" in switched.stderr


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"compile": "on"}, "--document-attention runs eager.*pass --compile off"),
        ({"tensor_parallel": 2}, "--document-attention does not run with --tensor-parallel > 1"),
    ],
)
def test_what_document_attention_cannot_run_with_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(document_attention=True, **changes).check()
