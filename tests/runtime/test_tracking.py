"""Where MLflow runs go (swbert.runtime.tracking), for pretraining, fine-tuning and the studies."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from sqlalchemy.exc import OperationalError

from swbert.runtime.tracking import experiment_id, retry_locked, tracking_uri
from swbert.studies.tracking import Tracker
from tests.launch_utils import HANG_S, REPO, wait_for


@pytest.mark.slow  # an MLflow SQLite store created (about 5 s)
def test_a_new_experiment_keeps_its_artifacts_beside_its_sqlite_store(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # not where the store is
    uri = tracking_uri(tmp_path / "runs" / "study")
    assert uri == f"sqlite:///{(tmp_path / 'runs' / 'mlflow.db').resolve()}"
    first = experiment_id(uri, "swbert-x")
    assert experiment_id(uri, "swbert-x") == first  # found, not created twice
    location = MlflowClient(uri).get_experiment(first).artifact_location
    assert location == (tmp_path / "runs" / "mlartifacts").resolve().as_uri()
    assert "Creating a new experiment" not in caplog.text


@pytest.mark.slow  # an MLflow SQLite store created (about 5 s)
def test_two_runs_under_one_folder_land_in_one_store(tmp_path, monkeypatch):
    """runs/a and runs/b (two studies, or a sweep and a pretraining run) log to runs/mlflow.db."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    runs = tmp_path / "runs"
    ids = {}
    for name in ("a", "b"):
        tracker = Tracker(tracking_uri(runs / name), "swbert-shared", system_metrics=False)
        with tracker.sweep(name, "test_sweep", folder=runs / name) as run_id:
            ids[name] = run_id
    client = MlflowClient(f"sqlite:///{runs / 'mlflow.db'}")
    found = client.search_runs([client.get_experiment_by_name("swbert-shared").experiment_id])
    assert sorted(r.info.run_id for r in found) == sorted(ids.values())
    assert not (runs / "a" / "mlflow.db").exists() and not (runs / "b" / "mlflow.db").exists()


# A job that makes one run in the store of runs/NAME, started when the file argv[2] appears. It loads
# swbert/runtime/tracking.py alone (standard library and MLflow): the package's own imports take seconds.
JOB = """
import importlib.util, sys, time
from pathlib import Path
import mlflow.store.tracking.sqlalchemy_store  # imported before the start: the jobs race on the store
spec = importlib.util.spec_from_file_location("tracking", "swbert/runtime/tracking.py")
tracking = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tracking)
folder, go = Path(sys.argv[1]), Path(sys.argv[2])
folder.with_suffix(".ready").touch()
while not go.exists():
    time.sleep(0.01)
uri = tracking.tracking_uri(folder)
tracking.mlflow_client(uri).create_run(tracking.experiment_id(uri, "swbert-race"), run_name=folder.name)
"""


@pytest.mark.slow  # two processes importing MLflow (about 5 s)
def test_jobs_starting_together_share_a_new_store(tmp_path):
    """Two jobs open runs/mlflow.db, new, at the same moment: neither fails on MLflow's migrations
    (without the lock one of them often did: "duplicate column name"), and both runs are in it."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    runs, go = tmp_path / "runs", tmp_path / "go"
    runs.mkdir()
    jobs = [
        subprocess.Popen([sys.executable, "-c", JOB, str(runs / name), str(go)], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for name in ("a", "b")
    ]  # fmt: skip
    for name, job in zip("ab", jobs):
        wait_for((runs / f"{name}.ready").exists, proc=job)
    go.touch()
    outputs = [job.communicate(timeout=HANG_S)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], outputs
    client = MlflowClient(f"sqlite:///{runs / 'mlflow.db'}")
    found = client.search_runs([client.get_experiment_by_name("swbert-race").experiment_id])
    assert sorted(r.info.run_name for r in found) == ["a", "b"]


def test_a_folder_with_its_own_store_keeps_it(tmp_path, monkeypatch):
    """A run made before the store was shared, resumed: it logs on into the run it started."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    old = tmp_path / "runs" / "old"
    old.mkdir(parents=True)
    (old / "mlflow.db").touch()
    assert tracking_uri(old) == f"sqlite:///{(old / 'mlflow.db').resolve()}"
    assert (
        tracking_uri(tmp_path / "runs" / "new") == f"sqlite:///{(tmp_path / 'runs' / 'mlflow.db').resolve()}"
    )


def test_the_environment_names_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    assert tracking_uri(tmp_path / "run") == "http://tracking.example:5000"
    assert not (tmp_path / "run").exists() and not (tmp_path / "mlflow.db").exists()  # a server: no file


def locked_error() -> MlflowException:
    """What MLflow raises when SQLite refuses a write another process holds the lock for."""
    cause = OperationalError("INSERT INTO runs ...", {}, sqlite3.OperationalError("database is locked"))
    try:
        raise MlflowException(message=cause) from cause
    except MlflowException as err:
        return err


def test_a_locked_store_is_retried_and_other_errors_are_not(monkeypatch):
    monkeypatch.setenv("SWBERT_MLFLOW_LOCK_WAIT_S", "30")
    calls = []

    def locked_twice() -> str:
        calls.append(1)
        if len(calls) <= 2:
            raise locked_error()
        return "created"

    assert retry_locked(locked_twice) == "created" and len(calls) == 3

    def broken() -> None:
        calls.append(1)
        raise MlflowException("RESOURCE_DOES_NOT_EXIST: run 'x' not found")

    calls.clear()
    with pytest.raises(MlflowException, match="not found"):
        retry_locked(broken)
    assert len(calls) == 1  # not a lock: raised at once

    def always_locked() -> None:
        calls.append(1)
        raise locked_error()

    calls.clear()
    monkeypatch.setenv("SWBERT_MLFLOW_LOCK_WAIT_S", "0")
    with pytest.raises(MlflowException, match="database is locked"):
        retry_locked(always_locked)  # the lock outlasts the wait: raised, not retried for ever
    assert len(calls) == 1
