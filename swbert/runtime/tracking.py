"""Where a job's MLflow runs go, for pretraining, fine-tuning and the scaling studies alike.

The store is, first, the one a job is told (a study's or sweep's --tracking-uri, else
MLFLOW_TRACKING_URI: a tracking server, a shared database); else a SQLite file, `mlflow.db`, in the
folder that holds the job's output folder, so every run under one folder (runs/NAME, runs/glue,
runs/quality, ...) lands in one store, runs/mlflow.db, and can be compared in one MLflow UI (ours).
An output folder that holds its own mlflow.db (a run made before the store was shared) keeps using it,
so a resumed run logs into the run it started. SQLite rather than MLflow 3's plain file store, which is
in maintenance mode. An experiment swbert creates in a SQLite store keeps its artifacts beside the
database file (`mlartifacts/`), not in ./mlruns of wherever the job happened to be started.

Several jobs may write one SQLite store at once. MLflow waits 20 s for another writer's lock, but
SQLite refuses at once ("database is locked") where waiting could deadlock, so our calls retry that
error for up to SWBERT_MLFLOW_LOCK_WAIT_S seconds (`mlflow_client`; ours). Two jobs opening a new
store at once would both run MLflow's table migrations ("duplicate column name"): the first opening of
a SQLite store in a process holds a lock file beside it (`open_store`).
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)

ARTIFACTS = "mlartifacts"
STORE_FILE = "mlflow.db"
LOCKED = ("database is locked", "database table is locked")  # SQLite's SQLITE_BUSY / SQLITE_LOCKED
T = TypeVar("T")


def default_store(output_dir: str | Path) -> Path:
    """The SQLite file a job writing `output_dir` logs to unless told another store: the folder's own
    mlflow.db when it has one (made before the store was shared), else mlflow.db beside the folder."""
    folder = Path(output_dir).resolve()
    own = folder / STORE_FILE
    return own if own.is_file() else folder.parent / STORE_FILE


def tracking_uri(output_dir: str | Path) -> str:
    """MLFLOW_TRACKING_URI if set, else `sqlite:///` `default_store(output_dir)` (its folder created)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    db = default_store(output_dir)
    db.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{db}"


def is_locked(err: BaseException) -> bool:
    """Whether `err` (or what caused it) is SQLite refusing a write another process holds the lock for."""
    while err is not None:
        if any(text in str(err) for text in LOCKED):
            return True
        err = err.__cause__ or err.__context__
    return False


def retry_locked(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`, called again while it fails because the SQLite store is locked, backing off
    from 50 ms to 2 s with jitter, for up to SWBERT_MLFLOW_LOCK_WAIT_S seconds (300; ours). Any other
    error, or the lock outlasting the wait, is raised."""
    wait_s = float(os.environ.get("SWBERT_MLFLOW_LOCK_WAIT_S", "300"))
    deadline, pause, told = time.monotonic() + wait_s, 0.05, False
    while True:
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            if not is_locked(err) or time.monotonic() + pause > deadline:
                raise
            if not told:
                log.info("the MLflow store is locked by another job; retrying for up to %g s", wait_s)
                told = True
            time.sleep(pause * random.uniform(0.5, 1.5))
            pause = min(2.0, 2 * pause)


_OPENED: set[str] = set()  # the SQLite stores this process has opened (their tables exist)


def open_store(uri: str) -> None:
    """Create the tables of the SQLite store at `uri` if it is new, holding `.<name>.lock` beside it so
    that jobs starting together migrate it one at a time; once per process (other stores: nothing)."""
    if not uri.startswith("sqlite:///") or uri in _OPENED:
        return
    import fcntl

    from mlflow import MlflowClient

    db = Path(uri[len("sqlite:///") :])
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.parent / f".{db.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        retry_locked(MlflowClient(tracking_uri=uri).search_experiments, max_results=1)
    _OPENED.add(uri)


class _PatientClient:
    """An MlflowClient whose every method call goes through `retry_locked`."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr
        return functools.partial(retry_locked, attr)


def mlflow_client(uri: str) -> Any:
    """An MlflowClient for `uri` that rides out another job's lock on a shared SQLite store (and opens
    a new one safely: `open_store`)."""
    from mlflow import MlflowClient

    open_store(uri)
    return _PatientClient(MlflowClient(tracking_uri=uri))


def experiment_id(uri: str, name: str) -> str:
    """The id of experiment `name` in the store at `uri`, created if it is new (in a SQLite store,
    with its artifacts beside the database). Creating it here rather than by `mlflow.set_experiment`
    also keeps MLflow's "does not exist. Creating a new experiment" line off the console."""
    from mlflow.exceptions import MlflowException

    client = mlflow_client(uri)
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    where = None
    if uri.startswith("sqlite:///"):
        where = (Path(uri[len("sqlite:///") :]).resolve().parent / ARTIFACTS).as_uri()
    try:
        return client.create_experiment(name, artifact_location=where)
    except MlflowException:  # another process created it meanwhile
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id
