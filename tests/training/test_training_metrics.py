"""Unit tests of the metrics logger (swbert.training.metrics): strict JSON lines always, MLflow from
a background thread that never stops training, one MLflow run across a resume."""

from __future__ import annotations

import json
import logging
import math

import pytest

from swbert.training.metrics import MetricsLogger


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_record_is_one_strict_json_line_with_non_finite_values_null(tmp_path):
    logger = MetricsLogger(tmp_path, "run", {}, use_mlflow=False)
    logger.log(1, {"loss": 2.5, "skipped": 0})
    logger.log(2, {"loss": math.nan, "grad_norm": math.inf, "note": "x"})
    logger.tag("ignored", "without MLflow")
    logger.close()
    logger.close()  # twice is harmless
    assert _lines(tmp_path / "metrics.jsonl") == [
        {"step": 1, "loss": 2.5, "skipped": 0},
        {"step": 2, "loss": None, "grad_norm": None, "note": "x"},
    ]
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text()


def test_a_reopened_logger_appends(tmp_path):
    first = MetricsLogger(tmp_path, "run", {}, use_mlflow=False)
    first.log(1, {"loss": 1.0})
    first.close()
    second = MetricsLogger(tmp_path, "run", {}, use_mlflow=False)
    second.log(2, {"loss": 0.5})
    second.close()
    assert [r["step"] for r in _lines(tmp_path / "metrics.jsonl")] == [1, 2]


@pytest.mark.slow  # imports MLflow (about 4 s)
def test_an_unreachable_tracking_server_is_reported_once_and_every_record_stays(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens on port 9
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with caplog.at_level(logging.WARNING, logger="swbert.training.metrics"):
        logger = MetricsLogger(tmp_path, "run", {"lr": 1e-3}, use_mlflow=True, system_metrics=False)
        for step in range(1, 4):
            logger.log(step, {"loss": 1.0 / step})
        logger.close()
    failures = [r for r in caplog.records if "MLflow logging to http://127.0.0.1:9 failed" in r.message]
    assert len(failures) == 1 and "metrics.jsonl keeps every record" in failures[0].message
    assert [r["step"] for r in _lines(tmp_path / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.slow  # an MLflow store (about 5 s)
def test_mlflow_gets_params_metrics_and_tags_and_a_resume_logs_into_the_same_run(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first = MetricsLogger(tmp_path, "run-a", {"lr": 1e-3, "variant": "shared"}, True, system_metrics=False)
    first.log(1, {"loss": 2.0, "phase": "warm-up"})
    first.tag("stage", "one")
    first.close()
    second = MetricsLogger(tmp_path, "run-a", {"lr": 1e-3}, True, system_metrics=False)
    second.log(2, {"loss": 1.0})
    second.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path.parent / 'mlflow.db'}")  # the shared store
    run = client.get_run((tmp_path / "mlflow_run_id").read_text().strip())
    assert run.data.params == {"lr": "0.001", "variant": "shared"}
    assert run.data.tags["stage"] == "one" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 2.0), (2, 1.0)]  # one run, both records
    assert "phase" not in run.data.metrics  # strings go to metrics.jsonl only
    assert (tmp_path.parent / "mlartifacts").resolve().as_uri() in client.get_experiment(
        run.info.experiment_id
    ).artifact_location


@pytest.mark.slow  # an MLflow store (about 5 s)
def test_an_outage_of_the_tracking_server_is_ridden_out_and_the_run_is_ended(tmp_path, monkeypatch, caplog):
    """Calls made while the server is down wait and are retried in order: MLflow gets every record
    and the run ends FINISHED (before, the first failure switched MLflow off for good, leaving the
    run RUNNING with the outage's records and everything after missing)."""
    import threading

    from mlflow import MlflowClient

    from tests.launch_utils import wait_for

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("SWBERT_MLFLOW_RETRY_S", "0.2")
    down, failed = threading.Event(), threading.Event()
    real = MlflowClient.log_batch

    def flaky(self, *args, **kwargs):
        if down.is_set():
            failed.set()
            raise ConnectionError("tracking server unreachable")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", flaky)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path.parent / 'mlflow.db'}")  # the shared store
    with caplog.at_level(logging.WARNING, logger="swbert.training.metrics"):
        logger = MetricsLogger(tmp_path, "run", {"lr": 1e-3}, True, system_metrics=False)
        logger.log(1, {"loss": 4.0})
        down.set()
        logger.log(2, {"loss": 3.0})
        logger.log(3, {"loss": 2.0})
        wait_for(failed.is_set)
        down.clear()  # the server is back: the retry timer sends what waited, before the run ends

        def steps() -> list[int]:
            if not (tmp_path / "mlflow_run_id").is_file():
                return []
            run_id = (tmp_path / "mlflow_run_id").read_text().strip()
            return [m.step for m in client.get_metric_history(run_id, "loss")]

        wait_for(lambda: steps() == [1, 2, 3])
        logger.log(4, {"loss": 1.0})
        logger.close()
    run = client.get_run((tmp_path / "mlflow_run_id").read_text().strip())
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.001"}
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [
        (1, 4.0),
        (2, 3.0),
        (3, 2.0),
        (4, 1.0),
    ]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("failed" in m for m in messages) == 1, messages
    assert sum("resumed after" in m for m in messages) == 1, messages
