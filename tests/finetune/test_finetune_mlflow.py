"""Fine-tuning sweeps in MLflow: system metrics and the report as artifacts of the sweep's run.

Pretraining's store (a loadable model, system metrics, the configs) is checked on the installed
wheel's run in test_install.py."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_rerun_sweep_skips_finished_trials_and_marks_the_killed_runs(tmp_path):
    """kill -9 a real sweep once its first trial is recorded; the re-run reuses that trial's result
    (not trained again) and marks the killed sweep's runs KILLED instead of RUNNING for ever."""
    import os
    import runpy
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from swbert.finetune.report import collect
    from swbert.finetune.synthetic import write_glue_fixture
    from swbert.studies.tracking import REUSED_FROM
    from tests.finetune_fixtures import make_checkpoint
    from tests.launch_utils import HANG_S

    root = Path(__file__).resolve().parents[2]
    write_glue_fixture(tmp_path / "glue", ["sst2"], n_train=64, n_dev=16)
    ckpt, out, uri = make_checkpoint(tmp_path / "ckpt"), tmp_path / "out", f"sqlite:///{tmp_path / 'm.db'}"
    argv = ["--checkpoint", f"tiny={ckpt}", "--tasks", "sst2", "--data-dir", str(tmp_path / "glue"),
            "--output-dir", str(out), "--learning-rates", "1e-3", "--seeds", "1", "2", "--epochs", "2",
            "--batch-size", "8", "--max-seq-length", "16", "--tracking-uri", uri, "--experiment", "resume"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen([sys.executable, "launchers/finetune_glue.py", *argv], cwd=root, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    first = out / "trials" / "tiny" / "sst2" / "lr0.001-seed1.json"
    deadline = time.time() + HANG_S  # a hang guard: the first trial's record is the event
    while not first.exists() and job.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    job.send_signal(signal.SIGKILL)
    assert job.wait() == -signal.SIGKILL and first.exists(), job.stderr.read()[-3000:]
    recorded = first.stat().st_mtime_ns
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("resume").experiment_id
    killed_parent = next(
        r for r in client.search_runs([experiment]) if r.data.tags["swbert.kind"] == "glue_sweep"
    )
    assert killed_parent.info.status == "RUNNING"

    main = runpy.run_path(str(root / "launchers" / "finetune_glue.py"), run_name="launcher")["main"]
    assert main(argv) == 0
    runs = client.search_runs([experiment])
    assert not [r for r in runs if r.info.status == "RUNNING"]
    assert client.get_run(killed_parent.info.run_id).info.status == "KILLED"
    new_parent = next(
        r for r in runs if r.data.tags["swbert.kind"] == "glue_sweep" and r.info.status == "FINISHED"
    )
    children = {
        r.data.params["seed"]: r
        for r in runs
        if r.data.tags.get("mlflow.parentRunId") == new_parent.info.run_id
    }
    assert sorted(children) == ["1", "2"]
    old_seed1 = json.loads(first.read_text())["run_id"]
    assert children["1"].data.tags[REUSED_FROM] == old_seed1 and first.stat().st_mtime_ns == recorded
    reused, old = children["1"].data.metrics, client.get_run(old_seed1).data.metrics
    assert "best/validation/accuracy" in reused and reused == {k: old[k] for k in reused}  # not retrained
    assert REUSED_FROM not in children["2"].data.tags  # killed before its end: trained again
    assert len(collect(uri, "resume", [new_parent.info.run_id]).glue) == 2  # the report sees every seed
