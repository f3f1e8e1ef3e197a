"""A pretraining run's MLflow store, as MLflow users read it: a loadable model, system metrics, the configs."""

from __future__ import annotations

import json

import mlflow
from mlflow import MlflowClient

from tests.launch_utils import job_env, run_single


def test_default_store_holds_a_loadable_model_system_metrics_and_the_configs(data_dir, tmp_path):
    out = tmp_path / "run"
    done = run_single(
        ["--config", "tiny_cpu", "--data-dir", str(data_dir), "--output-dir", str(out), "--train-steps", "3"],
        env=job_env(MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL="1"),  # MLflow's default samples every 10 s
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    uri = f"sqlite:///{out / 'mlflow.db'}"
    assert f"MLflow store:                {uri}" in done.stdout
    client = MlflowClient(uri)
    run_id = (out / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith((out / "mlartifacts").as_uri())  # in the run folder

    system = {k for k in run.data.metrics if k.startswith("system/")}
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= system, system
    params = run.data.params
    assert params["size"] == "tiny" and params["deepspeed.zero_optimization.stage"] == "2"
    assert params["deepspeed.train_batch_size"] == "8"  # filled from the training config
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"resolved_config.yaml", "ds_config.json", "model"} <= artifacts
    assert json.loads((out / "ds_config.json").read_text())["train_micro_batch_size_per_gpu"] == 4

    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        model = mlflow.pyfunc.load_model(f"runs:/{run_id}/model")
    finally:
        mlflow.set_tracking_uri(before)
    predictions = model.predict(["the cat [MASK] the dog .", "a [MASK] ."], params={"top_k": 2})
    assert len(predictions) == 2 and all(len(p) == 2 for p in predictions)
    assert all(isinstance(p["token_str"], str) and 0 < p["score"] <= 1 for p in predictions[0])


def test_finetune_sweep_logs_system_metrics_and_its_report(tmp_path):
    from swbert.finetune.tracking import Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "sweep-test")
    report = tmp_path / "report"
    report.mkdir()
    (report / "table1_glue.md").write_text("| variant | SST-2 |\n")
    with tracker.sweep("sweep", "glue_sweep") as parent:
        with tracker.run("trial", {"swbert.kind": "glue_trial"}) as child:
            tracker.log(child, {"best/validation/accuracy": 0.5})
    tracker.log_artifacts(parent, report, "report")
    client = MlflowClient(uri)
    run = client.get_run(parent)
    assert run.info.status == "FINISHED" and run.info.artifact_uri.startswith(
        (tmp_path / "mlartifacts").as_uri()
    )
    assert "system/cpu_utilization_percentage" in run.data.metrics, sorted(run.data.metrics)
    assert [a.path for a in client.list_artifacts(parent, "report")] == ["report/table1_glue.md"]
