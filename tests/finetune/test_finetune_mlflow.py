"""Fine-tuning sweeps in MLflow: system metrics and the report as artifacts of the sweep's run.

Pretraining's store (a loadable model, system metrics, the configs) is checked on the installed
wheel's run in test_install.py."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient


@pytest.mark.slow
def test_finetune_sweep_logs_system_metrics_and_its_report(tmp_path):
    from swbert.studies.tracking import Tracker

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
    old_seed1 = json.loads(first.read_text())["result"]["run_id"]
    assert children["1"].data.tags[REUSED_FROM] == old_seed1 and first.stat().st_mtime_ns == recorded
    reused, old = children["1"].data.metrics, client.get_run(old_seed1).data.metrics
    assert "best/validation/accuracy" in reused and reused == {k: old[k] for k in reused}  # not retrained
    assert REUSED_FROM not in children["2"].data.tags  # killed before its end: trained again
    assert len(collect(uri, "resume", [new_parent.info.run_id]).glue) == 2  # the report sees every seed


@pytest.mark.slow  # an MLflow store and a 1-rank process group (a few seconds)
def test_a_sweep_rerun_on_changed_data_or_flags_is_refused_naming_what_differs(tmp_path, capsys):
    """Issue 46: a sweep records its flags and its task files' hashes in study.json; run again on
    data changed at the same --data-dir (or with another flag) it is refused in one line naming the
    file (the flag) before anything trains, instead of reusing the old results."""
    import runpy
    from pathlib import Path

    from swbert import cli
    from swbert.finetune.glue import GlueSweep
    from swbert.finetune.sweep import run_sweep
    from swbert.finetune.synthetic import write_glue_fixture

    root = Path(__file__).resolve().parents[2]
    write_glue_fixture(tmp_path / "glue", ["sst2"], n_train=16, n_dev=8)
    argv = ["--checkpoint", f"tiny={tmp_path / 'ckpt'}", "--tasks", "sst2", "--data-dir", str(tmp_path / "glue"),
            "--output-dir", str(tmp_path / "out"), "--seeds", "1", "--tracking-uri",
            f"sqlite:///{tmp_path / 'm.db'}", "--experiment", "identity"]  # fmt: skip
    trained = []

    def one_trial(sweep, trials):  # a stand-in that records one finished trial
        trained.append(trials)
        trials.runner.records.save("tiny/sst2/lr0.0001-seed1", {"result": {}})

    assert run_sweep(cli.build_config(GlueSweep, None, argv), "glue", one_trial) == 0
    train_tsv = (tmp_path / "glue" / "SST-2" / "train.tsv").resolve()
    assert str(train_tsv) in trained[0].options["data"]
    main = runpy.run_path(str(root / "launchers" / "finetune_glue.py"), run_name="launcher")["main"]
    capsys.readouterr()  # the first run's lines
    for change, named in [(["--epochs", "2"], "--epochs 2 (was 10)"), ([], f"the data changed: {train_tsv}")]:
        if not change:
            train_tsv.write_text(train_tsv.read_text().replace("\t0\n", "\t1\n", 1))  # one label flipped
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, *change])
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and named in err and "--allow-study-change" in err, err
        assert len(err.splitlines()) == 1 and len(trained) == 1  # refused before anything ran


# The previous trial record's key (swbert-trial/1, before the study layer), as that version built it
PREVIOUS_NOT_IN_KEY = frozenset(
    "checkpoint learning_rates seeds tasks versions output_dir tracking_uri experiment run_name keep noise "
    "noise_levels noise_seeds noise_scales cross_domain evaluate_finetuned plugins".split()
)


def previous_trial_key(params: dict, tags: dict, checkpoint, sweep_params: dict) -> dict:
    from swbert.finetune.sweep import checkpoint_fingerprint

    return {
        "params": {key: str(value) for key, value in sorted(params.items())},
        "tags": dict(sorted(tags.items())),
        "checkpoint": checkpoint_fingerprint(checkpoint),
        "sweep": {k: v for k, v in sorted(sweep_params.items()) if k not in PREVIOUS_NOT_IN_KEY},
    }


@pytest.mark.slow  # an MLflow store and a 1-rank process group (a few seconds)
def test_a_trial_recorded_in_the_previous_format_is_not_trained_again(tmp_path):
    """A sweep folder from before the study layer holds `swbert-trial/1` records: a trial whose record
    stands for it is read back as finished (logged as reused), not trained; once its checkpoint is
    exported again the record no longer stands for it and the trial trains."""
    import dataclasses

    from swbert import cli
    from swbert.finetune.checkpoint import Checkpoint
    from swbert.finetune.glue import GlueSweep
    from swbert.finetune.sweep import TrialTask, run_sweep
    from swbert.studies.records import write_json_atomic
    from swbert.studies.tracking import REUSED_FROM, flat_params
    from tests.finetune_fixtures import make_checkpoint

    ckpt = Checkpoint("tiny", make_checkpoint(tmp_path / "ckpt"))
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    argv = ["--checkpoint", f"tiny={ckpt.path}", "--tasks", "sst2", "--output-dir", str(tmp_path / "out"),
            "--seeds", "1", "--tracking-uri", uri, "--experiment", "previous"]  # fmt: skip
    sweep = cli.build_config(GlueSweep, None, argv)
    lrs, seed, task_params = (1e-4, 2e-5, 2e-6), 1, {"train_examples": 64}
    # what the previous version logged and keyed: its FinetuneConfig named `deepspeed` deepspeed_config
    params = dataclasses.asdict(sweep.finetune_config(lrs[0], seed))
    params["deepspeed_config"] = params.pop("deepspeed")
    params |= {"lr_plan": "stepped", "later_learning_rates": "2e-05 2e-06", "attention_type": "shared"}
    params |= {"max_seq_length": 128, "attention_dropout": 0.1, "hidden_dropout": None, "batching": "grouped"}
    tags = {"swbert.kind": "glue_trial", "swbert.variant": "tiny", "swbert.task": "sst2",
            "swbert.checkpoint": str(ckpt.path)}  # fmt: skip
    previous_flags = flat_params(dataclasses.asdict(sweep))
    for added in ("allow_study_change", "allow_tokenizer_change"):  # flags the previous version lacked
        del previous_flags[added]
    metrics = {"validation": {"accuracy": 0.75, "score": 0.75}}
    write_json_atomic(
        tmp_path / "out" / "trials" / "tiny" / "sst2" / "lr0.0001-2e-05-2e-06-seed1.json",
        {
            "format": "swbert-trial/1",
            "key": previous_trial_key({**params, **task_params}, tags, ckpt.path, previous_flags),
            "run_id": "run-of-the-previous-sweep",
            "metrics": {"best/validation/accuracy": 0.75, "seconds_per_epoch": 2.0},
            "trial": {"variant": "tiny", "task": "sst2", "learning_rate": 1e-4, "seed": 1, "metrics": metrics,
                      "model_dir": "", "later_lrs": [2e-5, 2e-6]},
        },
    )  # fmt: skip

    class Trained(Exception):
        pass

    def build_model():
        raise Trained

    done, seen = [], []
    work = TrialTask(ckpt, "sst2", build_model, None, None, None, "validation/score", None, task_params)

    def one_trial(sweep, trials):
        seen.append(trials)
        done.append(trials.trial(work, lrs, seed, save=True))

    assert run_sweep(sweep, "glue", one_trial) == 0
    assert (done[0].metrics, done[0].run_id, done[0].later_lrs) == (
        metrics,
        "run-of-the-previous-sweep",
        (2e-5, 2e-6),
    )
    client = MlflowClient(uri)
    (child,) = client.search_runs(
        [client.get_experiment_by_name("previous").experiment_id], "tags.swbert.kind = 'glue_trial'"
    )
    assert child.data.tags[REUSED_FROM] == "run-of-the-previous-sweep"
    assert child.data.metrics["best/validation/accuracy"] == 0.75
    config = ckpt.path / "config.json"
    config.write_text(config.read_text())  # exported again: its files' times differ
    with pytest.raises(Trained):
        run_sweep(sweep, "glue", one_trial)
    assert seen[-1].bar.disable  # the progress bar closed on the error too (tqdm disables a closed bar)
