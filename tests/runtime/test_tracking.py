"""Where MLflow runs go (swbert.runtime.tracking), for pretraining, fine-tuning and the studies."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from swbert.runtime.tracking import experiment_id, tracking_uri


@pytest.mark.slow  # an MLflow SQLite store created (about 5 s)
def test_a_new_experiment_keeps_its_artifacts_beside_its_sqlite_store(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # not where the store is
    uri = tracking_uri(tmp_path / "study")
    assert uri == f"sqlite:///{(tmp_path / 'study' / 'mlflow.db').resolve()}"
    first = experiment_id(uri, "swbert-x")
    assert experiment_id(uri, "swbert-x") == first  # found, not created twice
    location = MlflowClient(uri).get_experiment(first).artifact_location
    assert location == (tmp_path / "study" / "mlartifacts").resolve().as_uri()
    assert "Creating a new experiment" not in caplog.text


def test_the_environment_names_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    assert tracking_uri(tmp_path / "run") == "http://tracking.example:5000"
    assert not (tmp_path / "run").exists()  # a server: no local folder made
