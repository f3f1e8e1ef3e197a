"""Pretraining logs to a real MLflow tracking server, and survives losing it mid-run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest
from mlflow import MlflowClient

from tests.launch_utils import HANG_S, free_port, job_env, kill_group, read_metrics, slowdown, start, wait_for


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """One real server for the module; the last test kills it."""
    tmp_path = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'server.db'}",
            "--artifacts-destination",
            str(tmp_path / "artifacts"),
            "--workers",
            "1",
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        # tracking only: no job runner process beside the server (MLflow's default starts one)
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )
    uri = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200
        except OSError:
            return False

    try:
        wait_for(healthy, proc=proc)
        yield uri, proc
    finally:
        import signal

        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def run_args(data_dir, out, steps: int, *extra: str) -> list[str]:
    return [
        "--config",
        "tiny_cpu",
        "--data-dir",
        str(data_dir),
        "--output-dir",
        str(out),
        "--train-steps",
        str(steps),
        "--log-interval",
        "1",
        "--save-interval",
        "1000",
        *extra,
    ]


@pytest.mark.slow
def test_params_metrics_and_artifacts_reach_the_server(mlflow_server, data_dir, tmp_path):
    uri, _ = mlflow_server
    out = tmp_path / "run"
    proc = start(
        2,
        run_args(data_dir, out, 8, "--run-name", "tiny-shared-test"),
        env=job_env(MLFLOW_TRACKING_URI=uri),
        log=tmp_path / "log",
    )
    try:
        assert proc.wait(timeout=HANG_S) == 0, (tmp_path / "log").read_text()[-4000:]
    finally:
        kill_group(proc)
    printed = (tmp_path / "log").read_text()  # rank 0 ends by saying where everything is
    assert f"model (Hugging Face folder): {out / 'export'}" in printed and f"{out}/metrics.jsonl" in printed
    assert f"MLflow tracking server:      {uri}" in printed
    client = MlflowClient(tracking_uri=uri)
    run_id = (out / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.run_name == "tiny-shared-test" and run.info.status == "FINISHED"
    assert run.data.params["attention_type"] == "shared" and run.data.params["zero_stage"] == "2"
    history = client.get_metric_history(run_id, "loss")
    assert [m.step for m in history] == list(range(1, 9))
    local = read_metrics(out)
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(
        [local[s]["loss"] for s in range(1, 9)]
    )
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"resolved_config.yaml", "ds_config.json", "model"} <= artifacts
    model = {a.path for a in client.list_artifacts(run_id, "model")}
    assert "model/MLmodel" in model and "model/fill_mask_pyfunc.py" in model  # an MLflow model
    exported = {a.path for a in client.list_artifacts(run_id, "model/artifacts/export")}
    assert (
        "model/artifacts/export/model.safetensors" in exported
        and "model/artifacts/export/config.json" in exported
    )


@pytest.mark.slow
def test_training_continues_when_the_server_goes_away(mlflow_server, data_dir, tmp_path):
    uri, server = mlflow_server
    out = tmp_path / "run"
    log = tmp_path / "log"
    proc = start(2, run_args(data_dir, out, 60), env=job_env(MLFLOW_TRACKING_URI=uri), log=log)
    client = MlflowClient(tracking_uri=uri)

    def some_metrics_arrived() -> bool:
        if not (out / "mlflow_run_id").is_file():
            return False
        return len(client.get_metric_history((out / "mlflow_run_id").read_text().strip(), "loss")) >= 2

    try:
        wait_for(some_metrics_arrived, proc=proc)
        run_name = client.get_run((out / "mlflow_run_id").read_text().strip()).info.run_name
        import os
        import signal

        os.killpg(server.pid, signal.SIGKILL)  # the tracking server disappears mid-run
        server.wait(timeout=30)
        started = time.monotonic()
        assert proc.wait(timeout=HANG_S) == 0, log.read_text()[-4000:]
        took = time.monotonic() - started
    finally:
        kill_group(proc)
    text = log.read_text()
    assert text.count("MLflow logging to") == 1, text[-4000:]  # warned once
    assert sorted(read_metrics(out)) == list(range(1, 61))  # metrics.jsonl holds everything
    # the rest of the 60 steps, the export, and at most the sink's 120 s wait at close: never a
    # stall on the lost server per step. The 200 s of an idle machine, longer under load
    assert took < 200 * slowdown(), took
    assert (out / "export" / "model.safetensors").is_file()
    assert run_name == "tiny-shared"  # with no --run-name, the run is named by size and variant
