"""Metrics: `metrics.jsonl` in the run folder (always) and MLflow (rank 0, never blocking training).

MLflow calls run on a background thread: a slow or unreachable tracking server costs the training
loop nothing. An outage is reported once; the calls wait in order and are retried every
SWBERT_MLFLOW_RETRY_S seconds (30, doubling to 5 minutes), so the MLflow run catches up and is
ended when the server is back. `metrics.jsonl` keeps every record whatever happens.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch

from swbert.runtime.monitor import start_system_metrics, stop_system_metrics
from swbert.runtime.tracking import experiment_id, tracking_uri

log = logging.getLogger(__name__)


class MLflowSink:
    """Sends params, metrics and artifacts to MLflow from a background thread, in order, riding out
    an outage of the tracking server (ours: retried with backoff, never dropped while the run lives)."""

    MAX_PENDING = 100_000  # calls kept through an outage; older metric batches beyond it are dropped

    def __init__(
        self, output_dir: Path, run_name: str, params: dict[str, Any], system_metrics: bool = True
    ) -> None:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.uri = tracking_uri(output_dir)
        self.output_dir = output_dir
        self.run_name = run_name
        self.run_id: str | None = None
        self.resumed = False
        self.system_metrics = system_metrics
        self.monitor = None
        self.retry_s = float(os.environ.get("SWBERT_MLFLOW_RETRY_S", "30"))
        self.down_since: float | None = None  # monotonic time of the outage's first failure
        self.next_try = 0.0
        self.backoff = self.retry_s
        self.reported = False
        self.queue: queue.Queue = queue.Queue()
        self.pending: collections.deque = collections.deque()
        self.thread = threading.Thread(target=self._work, name="mlflow-sink", daemon=True)
        self.thread.start()
        self.submit(self._start, params)

    def submit(self, fn, *args) -> None:
        self.queue.put((fn, args))

    def _work(self) -> None:
        closing = False
        while not closing:
            wait = max(0.0, self.next_try - time.monotonic()) if self.pending else None
            try:
                item = self.queue.get(timeout=wait)
            except queue.Empty:
                item = ()  # time to retry
            if item is None:
                closing = True
            elif item:
                self._keep(item)
            if closing or time.monotonic() >= self.next_try:
                self._drain()
        if self.pending:
            log.warning(
                "MLflow at %s is still unreachable: %d calls not sent%s; metrics.jsonl has every "
                "record, and the run is ended when the run folder is resumed",
                self.uri,
                len(self.pending),
                f" to run {self.run_id}" if self.run_id else "",
            )

    def _keep(self, item: tuple) -> None:
        self.pending.append(item)
        if len(self.pending) > self.MAX_PENDING:  # drop the oldest metric batch, never start or end
            for i, (fn, _) in enumerate(self.pending):
                if getattr(fn, "droppable", False):
                    del self.pending[i]
                    break

    def _drain(self) -> None:
        """Send the waiting calls in order until one fails (then retry later, backing off)."""
        while self.pending:
            fn, args = self.pending[0]
            try:
                fn(*args)
            except Exception as err:  # noqa: BLE001 - any tracking failure must not stop training
                self._down(err)
                return
            self.pending.popleft()
            if self.down_since is not None:
                log.warning(
                    "MLflow logging to %s resumed after %.0f s; the calls of the outage are sent in order",
                    self.uri,
                    time.monotonic() - self.down_since,
                )
                self.down_since, self.reported = None, False

    def _down(self, err: Exception) -> None:
        now = time.monotonic()
        self.backoff = self.retry_s if self.down_since is None else min(300.0, 2 * self.backoff)
        self.down_since = now if self.down_since is None else self.down_since
        self.next_try = now + self.backoff
        if not self.reported:
            self.reported = True
            log.warning(
                "MLflow logging to %s failed (%s: %s); training continues, metrics.jsonl keeps every "
                "record, and MLflow is retried every %g s or more",
                self.uri,
                type(err).__name__,
                err,
                self.retry_s,
            )

    def _start(self, params: dict[str, Any]) -> None:
        """Create the run (or reopen a resumed one) and log its params; safe to retry after a failure
        part way (params logged again with the same values are accepted)."""
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient(tracking_uri=self.uri)
        id_file = self.output_dir / "mlflow_run_id"
        if self.run_id is None and id_file.is_file():  # a resumed run keeps logging into the same run
            self.client.update_run(id_file.read_text().strip(), status="RUNNING")
            self.run_id, self.resumed = id_file.read_text().strip(), True
        elif self.run_id is None:
            exp_id = experiment_id(self.uri, os.environ.get("MLFLOW_EXPERIMENT_NAME", "swbert-pretrain"))
            self.run_id, self.resumed = (
                self.client.create_run(exp_id, run_name=self.run_name).info.run_id,
                False,
            )
            id_file.write_text(self.run_id)
        if not self.resumed:
            items = [Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
            for i in range(0, len(items), 100):
                self.client.log_batch(self.run_id, params=items[i : i + 100])
        if self.system_metrics and self.monitor is None:
            self.monitor = start_system_metrics(self.run_id, self.uri, resume=self.resumed)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        snapshot = dict(values)
        now = int(time.time() * 1000)  # when it was logged, not when an outage let it through

        def send():
            from mlflow.entities import Metric

            batch = [Metric(k, float(v), now, step) for k, v in snapshot.items() if v is not None]
            self.client.log_batch(self.run_id, metrics=batch)

        send.droppable = True  # metrics.jsonl has it
        self.submit(send)

    def tag(self, key: str, value: str) -> None:
        self.submit(lambda: self.client.set_tag(self.run_id, key, value))

    def artifact(self, path: Path, artifact_path: str | None = None) -> None:
        def send():
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), artifact_path)
            else:
                self.client.log_artifact(self.run_id, str(path), artifact_path)

        self.submit(send)

    def log_model(self, export_dir: Path) -> None:
        """Log an exported folder as an MLflow pyfunc model at `model` (fill-mask; see fill_mask_pyfunc)."""

        def send():
            import tempfile

            import mlflow.pyfunc
            import transformers

            code = Path(__file__).with_name("fill_mask_pyfunc.py")
            requirements = [
                f"torch=={torch.__version__.split('+')[0]}",
                f"transformers=={transformers.__version__}",
            ]
            # texts in; top_k a parameter of predict (MLflow drops params a signature does not name)
            signature = mlflow.models.infer_signature(["the [MASK] sat on the mat ."], params={"top_k": 5})
            with tempfile.TemporaryDirectory(dir=self.output_dir) as tmp:
                path = Path(tmp) / "model"
                mlflow.pyfunc.save_model(
                    path,
                    python_model=str(code),
                    artifacts={"model": str(export_dir)},
                    pip_requirements=requirements,
                    signature=signature,
                )
                self.client.log_artifacts(self.run_id, str(path), "model")

        self.submit(send)

    def close(self, status: str = "FINISHED", timeout: float = 120.0) -> None:
        def end():
            stop_system_metrics(self.monitor)  # before the run is marked terminated
            self.client.set_terminated(self.run_id, status=status)

        self.submit(end)
        self.queue.put(None)
        self.thread.join(timeout)


def _finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


class MetricsWriteError(RuntimeError):
    """metrics.jsonl could not be written (a full disk between saves); the file was left whole."""


TORN_SUFFIX = ".torn"  # where a torn last line of metrics.jsonl is moved, never deleted


def repair_torn_tail(path: Path) -> str | None:
    """Cut a torn last line (no newline: a write a crash or a full disk cut off) from a JSON-lines
    file, appending it to `<path>.torn`; returns the torn text, or None when the file was whole."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    with open(path, "rb+") as f:
        f.seek(max(0, size - 2**20))  # a line is at most a few KiB
        tail = f.read()
        if not tail or tail.endswith(b"\n"):
            return None
        cut = tail.rfind(b"\n") + 1
        torn = tail[cut:]
        with open(path.with_name(path.name + TORN_SUFFIX), "ab") as aside:
            aside.write(torn + b"\n")
        f.truncate(size - len(torn))
    text = torn.decode("utf-8", "replace")
    log.warning("%s ended in a torn line (moved to %s%s): %.80s", path, path.name, TORN_SUFFIX, text)
    return text


class MetricsLogger:
    """Rank 0's sink: appends JSON lines to metrics.jsonl and forwards to MLflow.

    Each record is one unbuffered append; a write that fails (a full disk) is cut back, so the file
    never holds a torn line, and raises MetricsWriteError. A torn line left by an older version or
    a kill is repaired when the logger opens the file."""

    def __init__(
        self,
        output_dir: Path,
        run_name: str,
        params: dict[str, Any],
        use_mlflow: bool,
        system_metrics: bool = True,
    ) -> None:
        self.path = output_dir / "metrics.jsonl"
        repair_torn_tail(self.path)
        self.fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.mlflow = MLflowSink(output_dir, run_name, params, system_metrics) if use_mlflow else None

    def _append(self, line: bytes) -> None:
        """Append `line` whole or not at all: a failed write is truncated back, then raised."""
        assert self.fd is not None, "metrics.jsonl is closed"
        before = os.fstat(self.fd).st_size
        try:
            done = 0
            while done < len(line):
                done += os.write(self.fd, line[done:])
        except OSError as err:
            try:
                os.ftruncate(self.fd, before)
            except OSError:
                pass  # the torn line is repaired when the run resumes
            free = shutil.disk_usage(self.path.parent).free / 2**20
            raise MetricsWriteError(
                f"{self.path} could not be written ({type(err).__name__}: {err}; {free:,.0f} MiB free "
                "there); it is kept whole"
            ) from err

    def log(self, step: int, values: dict[str, Any]) -> None:
        # strict JSON: a non-finite value (a skipped step's loss) is null, not NaN, which jq and
        # other strict readers refuse; the skipped-step counters say what happened
        record = {"step": step, **{k: _finite_or_none(v) for k, v in values.items()}}
        self._append((json.dumps(record, allow_nan=False) + "\n").encode())
        if self.mlflow is not None:
            self.mlflow.metrics(step, {k: v for k, v in values.items() if isinstance(v, (int, float))})

    def tag(self, key: str, value: str) -> None:
        """An MLflow tag (tags, unlike params, may be set again when a run is resumed)."""
        if self.mlflow is not None:
            self.mlflow.tag(key, value)

    def artifact(self, path: Path, artifact_path: str | None = None) -> None:
        if self.mlflow is not None:
            self.mlflow.artifact(path, artifact_path)

    def log_model(self, export_dir: Path) -> None:
        if self.mlflow is not None:
            self.mlflow.log_model(export_dir)

    def close(self, status: str = "FINISHED") -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.mlflow is not None:
            self.mlflow.close(status)
