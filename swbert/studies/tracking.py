"""A study in MLflow: one parent run, one child run per point, only rank 0 logging. The study's
folder names its parent run (`PARENT_FILE`): the next run of the study there continues it (the
scaling studies) or starts a new one and marks the killed one's runs KILLED (the fine-tuning sweeps,
whose report reads one parent's children); docs/finetuning.md and docs/scaling.md."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from swbert.runtime.tracking import experiment_id, mlflow_client
from swbert.studies.records import read_json, spelled, write_json_atomic

log = logging.getLogger("swbert.studies")

KIND = "swbert.kind"  # the tag that says what a run is: glue_sweep, glue_trial, quality_point, ...
REUSED_FROM = "swbert.reused_from"  # a child logged from a record: the run that trained it
PARENT_FILE = "sweep_run.json"  # in a study's folder: {"run_id", "tracking_uri"} of its parent run


def flat_params(values: dict[str, Any]) -> dict[str, str]:
    """Values as MLflow params (`spelled`), None left out."""
    return {k: spelled(v) for k, v in values.items() if v is not None}


class Tracker:
    """A thin MLflow client wrapper; ``enabled=False`` (non-zero ranks) makes every call a no-op."""

    def __init__(self, uri: str, experiment: str, enabled: bool = True, system_metrics: bool = True) -> None:
        self.enabled, self.uri, self.system_metrics = enabled, uri, system_metrics
        self.parent_id: str | None = None
        self.continued = False  # the parent run is an earlier run of the study, continued
        if not enabled:
            return
        self.client = mlflow_client(uri)  # rides out another job's lock on a shared SQLite store
        self.experiment_id = experiment_id(uri, experiment)

    def _create(self, name: str, tags: dict[str, str], params: dict | None) -> str | None:
        if not self.enabled:
            return None
        if self.parent_id:
            tags = {**tags, "mlflow.parentRunId": self.parent_id}
        run_id = self.client.create_run(self.experiment_id, run_name=name, tags=tags).info.run_id
        if params:
            from mlflow.entities import Param

            self.client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
        return run_id

    def log(self, run_id: str | None, metrics: dict[str, Any], step: int = 0) -> None:
        """Log the finite numbers of `metrics` at ``step`` (MLflow rejects nan; None, a bool or a nan
        reads as missing)."""
        if not self.enabled or run_id is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        numbers = {k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        batch = [Metric(k, float(v), now, step) for k, v in numbers.items() if math.isfinite(v)]
        for i in range(0, len(batch), 1000):  # MLflow's per-request limit
            self.client.log_batch(run_id, metrics=batch[i : i + 1000])

    def _get(self, run_id: str | None) -> Any:
        """The run `run_id` of this store, or None (none, or not held)."""
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id) if self.enabled and run_id else None
        except MlflowException:
            return None

    def live(self, run_id: str | None) -> bool:
        """Whether this store holds `run_id`, not deleted, in this experiment."""
        run = self._get(run_id)
        active = run is not None and run.info.lifecycle_stage == "active"
        return active and run.info.experiment_id == self.experiment_id

    @contextlib.contextmanager
    def sweep(
        self,
        name: str,
        kind: str,
        params: dict | None = None,
        folder: Path | None = None,
        resume: bool = False,
    ) -> Iterator[str | None]:
        """The parent run of a study, with its system metrics (MLflow's monitor). With `folder`, the
        run is named there for the next run of the study, which continues it (`resume`) or marks it
        and its children KILLED where they are still RUNNING."""
        from swbert.runtime.monitor import start_system_metrics, stop_system_metrics

        saved = read_json(Path(folder) / PARENT_FILE) if folder is not None and self.enabled else None
        previous = saved.get("run_id") if isinstance(saved, dict) else None
        killed = None if resume else self._get(previous)
        if killed is not None and killed.info.status == "RUNNING":  # a killed study's runs: marked so
            children = self.client.search_runs(
                [killed.info.experiment_id],
                f"tags.mlflow.parentRunId = '{previous}' and attributes.status = 'RUNNING'",
                max_results=50000,
            )
            for rid in [child.info.run_id for child in children] + [previous]:
                self.client.set_terminated(rid, "KILLED")
            log.info("marked %d run(s) of the killed study %s as KILLED", len(children) + 1, previous)
        with self.run(name, {KIND: kind}, params, previous if resume else None) as run_id:
            self.parent_id, self.continued = run_id, run_id is not None and run_id == previous
            if folder is not None and run_id is not None and not self.continued:
                write_json_atomic(Path(folder) / PARENT_FILE, {"run_id": run_id, "tracking_uri": self.uri})
            monitor = start_system_metrics(run_id, self.uri) if run_id and self.system_metrics else None
            try:
                yield run_id
            finally:
                stop_system_metrics(monitor)
                self.parent_id = None

    def log_artifacts(self, run_id: str | None, folder: str | Path, artifact_path: str | None = None) -> None:
        """Files of ``folder`` (reports, figures) as artifacts of ``run_id``."""
        if self.enabled and run_id is not None and Path(folder).is_dir():
            self.client.log_artifacts(run_id, str(folder), artifact_path)

    def log_files(self, run_id: str | None, paths: list[Path]) -> None:
        """Files (a table, plots) as artifacts of ``run_id``, at its top."""
        if self.enabled and run_id is not None:
            for path in paths:
                self.client.log_artifact(run_id, str(path))

    @contextlib.contextmanager
    def run(
        self, name: str, tags: dict[str, str], params: dict | None = None, run_id: str | None = None
    ) -> Iterator[str | None]:
        """A run (a child of the parent run open, if any), marked FAILED (and the error re-raised) if its
        body raises; `run_id` continues that run (logged by an earlier run of the study) instead."""
        if run_id is not None and self.live(run_id):
            self.client.update_run(run_id, status="RUNNING")
            for key, value in tags.items():
                self.client.set_tag(run_id, key, str(value)[:5000])
        else:
            run_id = self._create(name, tags, params)
        status = "FAILED"
        try:
            yield run_id
            status = "FINISHED"
        finally:
            if self.enabled and run_id is not None:
                self.client.set_terminated(run_id, status)
