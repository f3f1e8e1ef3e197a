"""Where a job's MLflow runs go, for pretraining, fine-tuning and the scaling studies alike.

The store is MLFLOW_TRACKING_URI when it is set (a tracking server, a shared database), else a
SQLite file in the job's output folder (MLflow 3's plain file store is in maintenance mode). An
experiment swbert creates in a SQLite store keeps its artifacts beside the database file
(`mlartifacts/`), not in ./mlruns of wherever the job happened to be started.
"""

from __future__ import annotations

import os
from pathlib import Path

ARTIFACTS = "mlartifacts"


def tracking_uri(output_dir: str | Path) -> str:
    """MLFLOW_TRACKING_URI if set, else `sqlite:///<output_dir>/mlflow.db` (the folder created)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


def experiment_id(uri: str, name: str) -> str:
    """The id of experiment `name` in the store at `uri`, created if it is new (in a SQLite store,
    with its artifacts beside the database). Creating it here rather than by `mlflow.set_experiment`
    also keeps MLflow's "does not exist. Creating a new experiment" line off the console."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri=uri)
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
