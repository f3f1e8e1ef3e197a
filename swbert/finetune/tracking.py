"""MLflow logging for fine-tuning: one parent run per sweep, one child run per trial or evaluation.

The store is ``MLFLOW_TRACKING_URI`` when set (a server), else a SQLite file in the output directory
(swbert.runtime.tracking). Only rank 0 logs; other ranks get a no-op tracker.
Child runs carry the tags the report command reads: ``swbert.kind`` (``glue_trial``, ``squad_trial``,
``noise``, ``cross_domain``), ``swbert.variant``, ``swbert.task``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from pathlib import Path

from swbert.runtime.tracking import experiment_id

KIND, VARIANT, TASK, CHECKPOINT = "swbert.kind", "swbert.variant", "swbert.task", "swbert.checkpoint"
DEFAULT_EXPERIMENT = "swbert-finetune"


class Tracker:
    """A thin MLflow client wrapper; ``enabled=False`` (non-zero ranks) makes every call a no-op."""

    def __init__(
        self,
        uri: str,
        experiment: str = DEFAULT_EXPERIMENT,
        enabled: bool = True,
        system_metrics: bool = True,
    ) -> None:
        self.enabled = enabled
        self.parent_id: str | None = None
        self.uri = uri
        self.system_metrics = system_metrics
        if not enabled:
            return
        from mlflow import MlflowClient

        self.client = MlflowClient(uri)
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

    def log(self, run_id: str | None, metrics: dict[str, float], step: int = 0) -> None:
        """Log finite metrics at ``step`` (MLflow rejects nan; a missing value reads as missing)."""
        if not self.enabled or run_id is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [
            Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None and math.isfinite(v)
        ]
        for i in range(0, len(batch), 1000):  # MLflow's per-request limit
            self.client.log_batch(run_id, metrics=batch[i : i + 1000])

    @contextlib.contextmanager
    def sweep(self, name: str, kind: str, params: dict | None = None) -> Iterator[str | None]:
        """The parent run of a sweep; its children are nested under it in the MLflow UI.

        The sweep's system metrics (MLflow's monitor: CPU, memory, GPU) are logged to it."""
        run_id = self._create(name, {KIND: kind}, params)
        self.parent_id = run_id
        monitor = None
        if run_id is not None and self.system_metrics:
            from swbert.runtime.monitor import start_system_metrics

            monitor = start_system_metrics(run_id, self.uri)
        try:
            yield run_id
        except BaseException:
            self._stop(monitor)
            self._end(run_id, "FAILED")
            raise
        finally:
            self.parent_id = None
        self._stop(monitor)
        self._end(run_id, "FINISHED")

    @staticmethod
    def _stop(monitor: object) -> None:
        from swbert.runtime.monitor import stop_system_metrics

        stop_system_metrics(monitor)

    def log_artifacts(self, run_id: str | None, folder: str | Path, artifact_path: str | None = None) -> None:
        """Files of ``folder`` (reports, figures) as artifacts of ``run_id``."""
        if self.enabled and run_id is not None and Path(folder).is_dir():
            self.client.log_artifacts(run_id, str(folder), artifact_path)

    @contextlib.contextmanager
    def run(self, name: str, tags: dict[str, str], params: dict | None = None) -> Iterator[str | None]:
        """A child run, marked FAILED (and the error re-raised) if its body raises."""
        run_id = self._create(name, tags, params)
        try:
            yield run_id
        except BaseException:
            self._end(run_id, "FAILED")
            raise
        self._end(run_id, "FINISHED")

    def kill_running(self, run_id: str) -> list[str]:
        """Set `run_id` and its children KILLED where they are still RUNNING (a killed sweep's runs);
        returns those marked. A run this store does not hold is left alone."""
        from mlflow.exceptions import MlflowException

        if not self.enabled:
            return []
        try:
            parent = self.client.get_run(run_id)
        except MlflowException:
            return []
        if parent.info.status != "RUNNING":
            return []
        children = self.client.search_runs(
            [parent.info.experiment_id],
            f"tags.mlflow.parentRunId = '{run_id}' and attributes.status = 'RUNNING'",
            max_results=50000,
        )
        marked = [child.info.run_id for child in children] + [run_id]
        for rid in marked:
            self.client.set_terminated(rid, "KILLED")
        return marked

    def _end(self, run_id: str | None, status: str) -> None:
        if self.enabled and run_id is not None:
            self.client.set_terminated(run_id, status)
