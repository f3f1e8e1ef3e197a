"""Fine-tuning sweeps in MLflow: system metrics and the report as artifacts of the sweep's run.

Pretraining's store (a loadable model, system metrics, the configs) is checked on the installed
wheel's run in test_install.py."""

from __future__ import annotations

from mlflow import MlflowClient


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
