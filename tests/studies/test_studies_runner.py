"""The point runner every study uses: finished points read back, failures kept with their reason,
a changed study refused naming what differs, one MLflow child per point under a parent that a
re-run continues (or, for sweeps, replaces, marking the killed one), and job arrays."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from swbert.studies.records import Records, check_study, data_identity, point_key, study_options
from swbert.studies.runner import ChildRun, PointRunner, StudyLog, run_points
from swbert.studies.slurm import switch_given, without_switches, write_array


@dataclass
class Res:
    status: str
    reason: str = ""
    value: float | None = None


def runner(tmp_path, retry_failed=False) -> PointRunner[Res]:
    return PointRunner(
        Records(tmp_path / "points", "test/1", "{name}/point.json"), lambda d: Res(**d), retry_failed
    )


def test_finished_points_are_read_back_and_failures_keep_their_reason(tmp_path):
    calls = []

    def attempt(name, status):
        return lambda: calls.append(name) or Res(status, "boom" if status == "failed" else "", 1.0)

    r = runner(tmp_path)
    assert r.settle("a", attempt("a", "done")).trained
    assert r.settle("b", attempt("b", "failed")).result.reason == "boom"
    assert r.settle("c", attempt("c", "stopped")).trained  # not recorded: runs again next time
    assert not (tmp_path / "points" / "c" / "point.json").exists()
    again = runner(tmp_path)
    settled = [again.settle(n, attempt(n, "done")) for n in "abc"]
    assert [s.trained for s in settled] == [False, False, True] and calls == ["a", "b", "c", "c"]
    assert settled[1].result == Res("failed", "boom", 1.0)
    retry = runner(tmp_path, retry_failed=True)
    assert (
        retry.settle("b", attempt("b", "done")).trained and not retry.settle("a", attempt("a", "x")).trained
    )
    # a run that ended before the study recorded it is read back from its own files, not run again
    recovered = runner(tmp_path).settle("d", attempt("d", "done"), recover=lambda: Res("done", value=2.0))
    assert not recovered.trained and recovered.result.value == 2.0 and calls[-1] == "b"


def test_a_record_stands_only_for_its_key(tmp_path):
    records = Records(tmp_path, "test/1")
    records.save("x/y", {"result": {"status": "done"}}, key={"lr": 1e-3})
    assert records.load("x/y", {"lr": 1e-3})["result"] == {"status": "done"}
    assert records.load("x/y", {"lr": 2e-3}) is None and records.load("x/y") is not None
    assert Records(tmp_path, "other/1").load("x/y") is None
    assert (tmp_path / "x" / "y.json").is_file()


def test_a_changed_study_is_refused_in_one_line_naming_what_differs(tmp_path):
    check_study(tmp_path, "quality", {"sizes": ["1x64", "2x64"], "seq_len": 128})
    check_study(tmp_path, "quality", {"sizes": ["1x64", "2x64"], "seq_len": 128})  # the same: fine
    with pytest.raises(ValueError) as err:
        check_study(tmp_path, "quality", {"sizes": ["1x64"], "seq_len": 64})
    message = str(err.value)
    assert "\n" not in message and "--allow-study-change" in message
    assert "--sizes 1x64 (was 1x64 2x64)" in message and "--seq-len 64 (was 128)" in message
    check_study(tmp_path, "quality", {"sizes": ["1x64"], "seq_len": 64}, allow_change=True)
    check_study(tmp_path, "quality", {"sizes": ["1x64"], "seq_len": 64})  # the new options kept

    @dataclass
    class Cfg:
        sizes: tuple = ("a",)
        output_dir: str = "x"

    assert study_options(Cfg(), []) == {"sizes": ["a"], "data": {}}  # where results go: not an option


def test_changed_data_is_refused_naming_the_file_and_a_changed_point_is_set_aside(tmp_path):
    """Issue 46: a study records its data's hashes; a re-run on changed data is refused naming the
    file, and a point whose options or data changed is run again, its old record set aside (kept,
    never read back as the new point's)."""
    data = tmp_path / "manifest.json"
    data.write_text('{"shards": 1}')
    options = {"seq_len": 128, "sizes": ["a"], "data": data_identity([data])}
    check_study(tmp_path / "study", "quality", options)
    data.write_text('{"shards": 2}')  # the same path, other bytes
    changed = {**options, "data": data_identity([data])}
    with pytest.raises(ValueError, match=f"the data changed: {data.resolve()}") as err:
        check_study(tmp_path / "study", "quality", changed)
    assert "\n" not in str(err.value) and "--allow-study-change" in str(err.value)
    check_study(tmp_path / "study", "quality", changed, allow_change=True)
    empty = Records(tmp_path / "study" / "points", "test/1", "{name}/point.json")
    check_study(tmp_path / "study", "quality", options, records=empty)  # no finished point: nothing to refuse

    r, calls = runner(tmp_path), []
    first = r.settle("a", lambda: Res("done", value=1.0), key=point_key(options, ["sizes"], point="a"))
    assert first.trained
    again = point_key({**options, "sizes": ["a", "b"]}, ["sizes"], point="a")  # a new point: the key holds
    assert not r.settle("a", lambda: calls.append("a") or Res("done"), key=again).trained and not calls
    new = r.settle("a", lambda: Res("done", value=2.0), key=point_key(changed, ["sizes"], point="a"))
    assert new.trained and new.result.value == 2.0
    (aside,) = (tmp_path / "points").glob("a.before-*")
    assert json.loads((aside / "point.json").read_text())["result"]["value"] == 1.0


def test_job_array_commands_and_switches(tmp_path):
    argv = ["--quality", "true", "--emit-slurm=yes", "--sizes", "a", "b", "--collect"]
    assert without_switches(argv, ("--quality", "--emit-slurm")) == ["--sizes", "a", "b", "--collect"]
    assert switch_given(argv, "--quality") and switch_given(argv, "--collect")
    assert not switch_given(["--quality", "false"], "--quality") and not switch_given([], "--quality")
    submit, command = write_array(tmp_path / "a", 3, "s.sbatch", ["--x", "a b"], "", 2, 8, "j")
    assert command == "sbatch --array=0-2 --nodes=2 --gpus-per-node=8 --job-name=j s.sbatch --x 'a b'"
    assert submit.read_text() == f"#!/bin/bash\n# from the repository root\n{command}\n"
    submit, command = write_array(tmp_path / "out", 1, "s.sbatch", [], "2 point(s)")
    assert command == "sbatch --array=0-0 s.sbatch" and submit == tmp_path / "out" / "submit.sh"
    assert submit.read_text() == f"#!/bin/bash\n# from the repository root; 2 point(s)\n{command}\n"


@pytest.mark.slow  # an MLflow store created (a few seconds)
def test_a_rerun_continues_its_parent_and_logs_only_what_it_ran(tmp_path):
    from mlflow import MlflowClient

    from swbert.studies.tracking import Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    folder = tmp_path / "study"

    def study(names, ran):
        tracker = Tracker(uri, "e", system_metrics=False)
        with tracker.sweep("s", "test_study", {"a": 1}, folder, resume=True) as parent:
            r = runner(folder)

            def child(point, settled):
                return ChildRun(
                    {"status": settled.result.status}, {"p": point}, {"v": 1.0}, [{"step": 1, "loss": 2.0}]
                )

            run_points(names, lambda n: r.settle(n, lambda: ran.append(n) or Res("done")), child,
                       StudyLog(tracker, folder))  # fmt: skip
        return parent

    ran: list[str] = []
    first = study(["a", "b"], ran)
    second = study(["a", "b", "c"], ran)
    assert first == second and ran == ["a", "b", "c"]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("e").experiment_id])
    children = sorted(r.info.run_name for r in runs if r.data.tags.get("mlflow.parentRunId") == first)
    assert children == ["a", "b", "c"] and len(runs) == 4
    assert all(r.info.status == "FINISHED" for r in runs)
    assert json.loads((folder / "sweep_run.json").read_text())["run_id"] == first


@pytest.mark.slow  # an MLflow store created (a few seconds)
def test_a_new_sweep_marks_the_killed_ones_runs(tmp_path):
    from mlflow import MlflowClient

    from swbert.studies.records import write_json_atomic
    from swbert.studies.tracking import KIND, PARENT_FILE, Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "e", system_metrics=False)
    killed = tracker._create("killed", {KIND: "glue_sweep"}, None)  # a sweep killed: left RUNNING
    write_json_atomic(tmp_path / PARENT_FILE, {"run_id": killed, "tracking_uri": uri})  # named in its folder
    tracker.parent_id = killed
    child = tracker._create("trial", {}, None)  # its child, left RUNNING too
    with Tracker(uri, "e", system_metrics=False).sweep("next", "glue_sweep", None, tmp_path) as parent:
        assert parent != killed
    client = MlflowClient(uri)
    assert {client.get_run(r).info.status for r in (killed, child)} == {"KILLED"}
    assert client.get_run(parent).info.status == "FINISHED"
