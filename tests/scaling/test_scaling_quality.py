"""The quality scaling study's driver: bad input before anything trains, re-runs that never
retrain a finished point, failed points kept with their reason, and the outputs. Points are trained
by a stand-in here (the real trainer: the long end-to-end test at the bottom)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from swbert.models.config import SIZES, SWBertConfig
from swbert.scaling import quality
from swbert.scaling.quality import Point, PointResult, QualityConfig, non_embedding_params, plan, run_quality
from swbert.studies import jobs
from swbert.training.runlock import RunLock
from tests.csv_utils import read_csv
from tests.launch_utils import REPO, job_env, wait_for
from tests.training.test_training_runlock import other_process_locks


def fake_data(folder: Path, valid_documents: int = 10) -> str:
    """A data folder as far as the study reads it before training: manifest and tokenizer file."""
    (folder / "tokenizer").mkdir(parents=True)
    (folder / "tokenizer" / "spm.model").write_bytes(b"")
    manifest = {"tokenizer": {"vocab_size": 8000}, "shards": [{"valid": {"documents": valid_documents}}]}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return str(folder)


class StandIn:
    """Trains nothing: the loss of a known power law, a failure for the names in `fail`."""

    def __init__(self, fail: tuple[str, ...] = ()) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def __call__(self, point: Point, cfg: QualityConfig, run_dir: Path, data_dir: str) -> PointResult:
        self.calls.append(point.name)
        if point.name in self.fail:
            return PointResult("failed", "killed by signal 9 (out of memory?)")
        shift = 1.0 if point.attention == "standard" else 1.2  # shared: worth 1.2x its parameters
        loss = 3.0 + 40.0 * (shift * point.non_embedding_params) ** -0.3
        return PointResult("done", val_loss=loss, curve=[{"step": point.steps, "val_loss": loss}])


# the settings these tests were written for, pinned so that a change of the study's defaults (sized
# for the real default study) does not move them
PINNED = dict(seeds=[1234], tokens_per_param=1.0, global_batch=32)


def config(tmp_path: Path, **kw) -> QualityConfig:
    defaults = dict(
        output_dir=tmp_path / "study",
        data_dir=fake_data(tmp_path / "data"),
        mlflow=False,
        bootstrap=200,
        **PINNED,
    )
    return QualityConfig(**{**defaults, **kw})


def test_layers_by_width_sizes_have_64_dim_heads():
    assert SIZES["3x192"] == dict(
        hidden_size=192, num_hidden_layers=3, num_attention_heads=3, intermediate_size=768
    )
    assert "3x192" in SIZES and "3x100" not in SIZES and "x64" not in SIZES
    assert "3x192" not in list(SIZES)  # the named table is unchanged
    assert SWBertConfig.from_size("2x128").head_dim == 64


def test_the_budget_counts_non_embedding_parameters():
    cfg = QualityConfig(sizes=["1x64", "2x128", "mini"], seeds=[1, 2])
    points = plan(cfg, 8000)
    assert len(points) == 3 * 2 * 2
    mini = next(p for p in points if p.size == "mini" and p.attention == "standard")
    n = non_embedding_params(SWBertConfig.from_size("mini", attention_type="standard"))
    assert mini.non_embedding_params == n < mini.params  # embeddings left out
    k, batch = cfg.tokens_per_param, cfg.global_batch * cfg.seq_len
    assert mini.tokens == round(k * n) and mini.steps == math.ceil(mini.tokens / batch)
    assert mini.lr == pytest.approx(0.003239 - 0.0001395 * math.log(n))


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--sizes", "1x64", "2x64"], "--sizes"),
        (["--attentions", "standard", "nonesuch"], "--attentions nonesuch"),
        (["--sizes", "1x64", "2x64", "lots"], "--sizes lots"),
        (["--tokens-per-param", "0.01"], "--tokens-per-param 0.01"),
        (["--data-dir", "NOVALID"], "no validation split"),
        (["--recipe", "modrn"], "--recipe modrn: not a recipe file nor one of"),
    ],
)
def test_bad_input_is_refused_naming_the_flag_before_anything_trains(tmp_path, capsys, argv, flag):
    from launchers.scaling_study import main

    data = fake_data(tmp_path / "data", valid_documents=0 if "NOVALID" in argv else 10)
    argv = [a.replace("NOVALID", data) for a in argv]
    if "--data-dir" not in argv:
        argv += ["--data-dir", data]
    with pytest.raises(SystemExit) as exit_info:
        main(["--quality", *argv, "--output-dir", str(tmp_path / "out"), "--mlflow", "false"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and flag in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out" / "points").exists()


def test_a_job_array_trains_one_point_per_task_and_collect_fits_what_they_left(tmp_path, capsys):
    """--emit-slurm writes one array task per point; each task (--point-index I) trains point I and
    no fit; --collect trains nothing, fits the finished points and names the one still missing."""
    from swbert.scaling.quality import emit_slurm

    sizes = ["1x64", "2x64", "2x128", "3x128"]
    cfg = config(tmp_path, sizes=sizes)
    argv = ["--quality", "--emit-slurm", "--sizes", *sizes, "--output-dir", str(cfg.output_dir)]
    submit, command, collect = emit_slurm(cfg, argv, 8000)
    points = plan(cfg, 8000)
    assert command.startswith(f"sbatch --array=0-{len(points) - 1} launchers/slurm/quality.sbatch --sizes")
    assert f"--data-dir {cfg.data_dir}" in command and command in submit.read_text()
    spelled = ["--quality", "true", "--emit-slurm=yes", *argv[2:]]  # the switches in other spellings
    assert emit_slurm(cfg, spelled, 8000)[1:] == (command, collect)
    assert collect.endswith(
        f"--quality --collect --sizes {' '.join(sizes)} --output-dir {cfg.output_dir} --data-dir {cfg.data_dir}"
    )
    trainer = StandIn()
    for index in range(len(points) - 1):  # the last task has not run
        cfg.point_index = index
        (row,) = run_quality(cfg, trainer)
        assert row["name"] == points[index].name and row["status"] == "done"
    assert trainer.calls == [p.name for p in points[:-1]]
    assert not (cfg.output_dir / "fits.json").exists()  # tasks fit nothing
    cfg.point_index, cfg.collect = None, True
    never = StandIn(fail=tuple(p.name for p in points))  # would fail every point it were asked for
    rows = run_quality(cfg, never)
    assert never.calls == []
    assert [r["status"] for r in rows].count("missing") == 1
    fits = json.loads((cfg.output_dir / "fits.json").read_text())
    missing = points[-1]
    excluded = fits["variants"][missing.attention]["excluded"]
    assert excluded == [
        {"name": missing.name, "reason": "not run yet: its array task has not finished (submit.sh runs it)"}
    ]
    assert not (cfg.output_dir / "points" / missing.name / "point.json").exists()  # runs when submitted again
    with pytest.raises(ValueError, match=f"--point-index 99: the ladder has points 0-{len(points) - 1}"):
        run_quality(QualityConfig(**{**cfg.__dict__, "collect": False, "point_index": 99}), StandIn())


def test_reruns_never_retrain_finished_points_and_failures_keep_their_reason(tmp_path):
    cfg = config(tmp_path, sizes=["1x64", "2x64", "2x128", "3x128", "mini"], extrapolate_to=["base"])
    first = StandIn(fail=("mini-shared-s1234",))
    rows = run_quality(cfg, first)
    assert len(first.calls) == 10
    fits = json.loads((cfg.output_dir / "fits.json").read_text())
    shared = fits["variants"]["shared"]
    assert shared["excluded"] == [
        {"name": "mini-shared-s1234", "reason": "killed by signal 9 (out of memory?)"}
    ]
    assert len(shared["points"]) == 4 and len(fits["variants"]["standard"]["points"]) == 5
    law = fits["variants"]["standard"]["L(N)"]
    assert law["alpha"] == pytest.approx(0.3, abs=0.01) and law["converged"]
    assert all(math.isfinite(v) for v in law["intervals"]["alpha"])
    # the stand-in's shared curve is the standard one at 1.2x the parameters, at every size
    for at in [
        *fits["efficiency"]["shared"]["measured"],
        fits["efficiency"]["shared"]["extrapolated"]["base"],
    ]:
        assert at["ratio"] == pytest.approx(1.2, rel=0.02)
    assert {r["status"] for r in read_csv(cfg.output_dir / "points.csv")} == {"done", "failed"}
    assert (cfg.output_dir / "plots" / "loss_vs_params.png").is_file()
    assert (cfg.output_dir / "plots" / "loss_vs_flops.png").is_file()

    again = StandIn()
    assert [r["val_loss"] for r in run_quality(cfg, again)] == [r["val_loss"] for r in rows]
    assert again.calls == []  # finished points read back; the failed one keeps its reason
    # a point in flight when the study stopped runs again; one whose run had ended is read back
    (cfg.output_dir / "points" / "2x64-shared-s1234" / "point.json").unlink()
    finished = next(r for r in rows if r["name"] == "2x128-standard-s1234")
    (cfg.output_dir / "points" / "2x128-standard-s1234" / "point.json").unlink()
    record = {"step": finished["steps"], "loss": 4.0, "val_loss": finished["val_loss"], "tokens_seen": 1}
    (cfg.output_dir / "points" / "2x128-standard-s1234" / "metrics.jsonl").write_text(
        json.dumps(record) + "\n"
    )
    cfg.retry_failed = True
    third = StandIn()
    run_quality(cfg, third)
    assert sorted(third.calls) == ["2x64-shared-s1234", "mini-shared-s1234"]


@pytest.mark.parametrize(
    "change, named",
    [
        ({"tokens_per_param": 2.0}, "--tokens-per-param 2.0 (was 1.0)"),
        ({"lr_scale": 0.5}, "--lr-scale 0.5 (was 1.0)"),
        ({"data": True}, "the data changed: "),
    ],
)
def test_a_rerun_with_another_budget_rate_or_data_is_refused_and_never_relabels(tmp_path, change, named):
    """Issue 46: a re-run with another --tokens-per-param or --lr-scale, or on changed data at the same
    --data-dir, is refused naming what differs; with --allow-study-change its points train again
    under the new plan (the old runs set aside, kept) instead of reporting the old losses."""
    cfg = config(tmp_path, sizes=["1x64", "2x64", "2x128", "3x128"])
    before = {r["name"]: r for r in run_quality(cfg, StandIn())}
    vocab = 8000
    if change.pop("data", False):
        manifest, vocab = Path(cfg.data_dir) / "manifest.json", 8001
        manifest.write_text(manifest.read_text().replace("8000", "8001"))  # same folder, other shards
    cfg = dataclasses.replace(cfg, **change)
    with pytest.raises(ValueError) as err:
        run_quality(cfg, StandIn())
    assert named in str(err.value) and "\n" not in str(err.value)
    cfg.allow_study_change = True
    again = StandIn()
    rows = run_quality(cfg, again)
    assert sorted(again.calls) == sorted(before)  # every point trained again, none relabelled
    planned = {p.name: p for p in plan(cfg, vocab)}
    assert [(r["tokens"], r["lr"]) for r in rows] == [
        (planned[r["name"]].tokens, planned[r["name"]].lr) for r in rows
    ]
    assert all(r["trained_now"] for r in rows)
    kept = list((cfg.output_dir / "points").glob("*.before-*"))
    assert len(kept) == len(before) and all((k / "point.json").is_file() for k in kept)


@pytest.fixture
def own_store(monkeypatch):
    """The study's default store (sqlite in its folder); what the study sets in MLflow's globals
    (the tracking URI and active experiment, and the variables they set) put back afterwards."""
    import mlflow
    from mlflow.tracking._tracking_service import utils

    names = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID")
    saved = {name: os.environ.pop(name, None) for name in names}
    monkeypatch.setattr(utils, "_tracking_uri", utils._tracking_uri)  # set back by the undo
    monkeypatch.setattr(mlflow.tracking.fluent, "_active_experiment_id", None)
    yield
    for name, value in saved.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value


def runs_of(cfg: QualityConfig) -> tuple[list[str], dict[str, list[str]]]:
    """The study's parent runs, and each point's nested runs by name."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{cfg.output_dir.parent / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(cfg.experiment).experiment_id])
    parents = [r.info.run_id for r in runs if "mlflow.parentRunId" not in r.data.tags]
    points: dict[str, list[str]] = {}
    for r in runs:
        if "mlflow.parentRunId" in r.data.tags:
            points.setdefault(r.info.run_name, []).append(r.info.run_id)
    return parents, points


@pytest.mark.slow  # an MLflow store created (a few seconds)
def test_a_rerun_continues_the_studys_mlflow_run_and_logs_only_what_it_trained(tmp_path, own_store):
    cfg = config(tmp_path, sizes=["1x64", "2x64", "2x128", "3x128"], mlflow=True)
    run_quality(cfg, StandIn())
    parents, points = runs_of(cfg)
    assert len(parents) == 1 and len(points) == 8 and all(len(ids) == 1 for ids in points.values())

    run_quality(cfg, StandIn())  # nothing trained: nothing logged again
    (cfg.output_dir / "points" / "2x64-shared-s1234" / "point.json").unlink()  # in flight: trains again
    again = StandIn()
    run_quality(cfg, again)
    assert again.calls == ["2x64-shared-s1234"]
    assert runs_of(cfg) == (parents, points)  # the same runs, the retrained point's updated

    cfg.experiment = "another"  # where the study's run is not: a new one, with every point
    run_quality(cfg, StandIn())
    new_parents, new_points = runs_of(cfg)
    assert len(new_parents) == 1 and new_parents != parents and len(new_points) == 8


# A stand-in for a point's torchrun job: attempt k does what the k-th word of argv[3] says (the last
# word: every attempt after it). "busy" prints argv[4], the run lock's real refusal, as
# launchers/pretrain.py prints it.
FAKE_JOB = """
import json, pathlib, sys
run, steps, plan = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
tries = run / "tries"
n = len(tries.read_text()) if tries.exists() else 0
tries.write_text("x" * (n + 1))
n = min(n, len(plan) - 1)
if plan[n] == "busy":
    print(f"error: {sys.argv[4]}")
    sys.exit(1)
if plan[n] == "silent":
    sys.exit(1)
record = {"step": steps, "loss": 4.0, "val_loss": 3.5, "tokens_seen": 1}
(run / "metrics.jsonl").write_text(json.dumps(record) + "\\n")
"""


@pytest.mark.parametrize(
    "attempts, status, tries, reason",
    [
        ("busy,busy,ok", "done", 3, None),  # the folder's last holder let go: the point trains
        ("busy,silent,ok", "failed", 2, "exit status 1: no output"),  # an earlier refusal is not this one's
        ("busy", "stopped", None, "in use by another job"),  # still held after BUSY_WAIT_S
    ],
)
def test_a_run_folder_still_held_is_waited_for_and_never_recorded_as_failed(
    tmp_path, monkeypatch, attempts, status, tries, reason
):
    """The study killed while a point trains leaves that point's job checkpointing on its way out
    (`start_job`); the next run waits for the folder (up to BUSY_WAIT_S), and a folder still held is
    reported, not recorded as the point's failure."""
    cfg = config(tmp_path, sizes=["1x64", "2x64", "2x128", "3x128"])
    point = plan(cfg, 8000)[0]
    run_dir = cfg.output_dir / "points" / point.name
    held = RunLock(tmp_path / "held").acquire()
    refusal = other_process_locks(tmp_path / "held")  # what the trainer says, word for word
    held.release()

    def fake(point, cfg, run_dir, data_dir, ds_config):
        return [sys.executable, "-c", FAKE_JOB, str(run_dir), str(point.steps), attempts, refusal]

    monkeypatch.setattr(quality, "pretrain_command", fake)
    monkeypatch.setattr(jobs, "BUSY_RETRY_S", 0.05)
    monkeypatch.setattr(jobs, "BUSY_WAIT_S", 2.0 if status != "stopped" else 0.3)
    settled = quality.settle_point(point, cfg, quality.train_point, {})
    result = settled.result
    assert settled.trained and result.status == status, result
    assert (run_dir / "point.json").is_file() == (status != "stopped")  # held: nothing recorded
    if tries is not None:
        assert len((run_dir / "tries").read_text()) == tries
    if reason is not None:
        assert reason in result.reason


@pytest.mark.slow  # a study process and its job, started and killed (about 5 s)
def test_a_killed_study_stops_its_job_instead_of_leaving_it_to_train_on(tmp_path):
    """kill -9 of the study: the job it started (in a session of its own) gets SIGTERM, on which a
    real job checkpoints and exits, instead of training on as an orphan holding the run folder."""
    up, got = tmp_path / "up", tmp_path / "got"
    job = (
        "import signal, sys, time, pathlib\n"
        "def stop(*_):\n    pathlib.Path(sys.argv[2]).write_text('SIGTERM'); sys.exit(75)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "pathlib.Path(sys.argv[1]).write_text('up')\n"
        "time.sleep(120)\n"
    )
    study = textwrap.dedent(f"""
        import os, sys, time
        from swbert.studies.jobs import start_job
        with open({str(tmp_path / "log")!r}, "a") as out:
            job = start_job([sys.executable, "-c", {job!r}, {str(up)!r}, {str(got)!r}], None, dict(os.environ), out)
        print(job.pid, flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", study], cwd=REPO, env=job_env(), stdout=subprocess.PIPE, text=True
    )
    pid = int(proc.stdout.readline())
    try:
        wait_for(up.exists, timeout=60, proc=proc)
        proc.kill()
        proc.wait()
        psutil.Process(pid).wait(timeout=30)  # psutil.TimeoutExpired: the job trained on
        assert got.read_text() == "SIGTERM"
    finally:
        if psutil.pid_exists(pid):
            psutil.Process(pid).kill()


@pytest.mark.long  # the default ladder trains 8 points: about 20 minutes on 2 CPU cores
def test_the_default_study_clears_the_floor_fits_and_a_rerun_trains_nothing(tmp_path):
    """Every default point is below the data's unigram floor by more than --floor-margin (none left
    out), each fit either converges with finite intervals or says why not, the table is printed and
    written as fits.md, and a re-run trains nothing."""
    out = tmp_path / "quality"
    cmd = [sys.executable, "launchers/scaling_study.py", "--quality", "--output-dir", str(out)]
    first = subprocess.run(
        cmd, cwd=REPO, env=job_env(), check=True, timeout=3600, capture_output=True, text=True
    )
    fits = json.loads((out / "fits.json").read_text())
    floors = fits["floors"]
    assert floors["bigram"] < floors["unigram"]
    for attention in ("standard", "shared"):
        entry = fits["variants"][attention]
        default = QualityConfig()
        assert not entry["excluded"] and len(entry["points"]) == len(default.sizes) * len(default.seeds)
        for point in entry["points"]:
            assert point["below_unigram"] > floors["margin"], point  # against its own seed's floor
        by_size: dict[int, list[float]] = {}
        for point in entry["points"]:
            by_size.setdefault(point["non_embedding_params"], []).append(point["val_loss"])
        means = [sum(v) / len(v) for _, v in sorted(by_size.items())]
        assert means == sorted(means, reverse=True), (attention, means)
        law = entry["L(N)"]
        assert law["converged"] == (not law["why_not_converged"])
        if law["converged"]:
            assert all(math.isfinite(v) for v in law["intervals"]["alpha"])
    table = (out / "fits.md").read_text()
    assert table.strip() in first.stdout and "alpha" in table
    assert (out / "plots" / "loss_vs_params.png").is_file() and (out.parent / "mlflow.db").is_file()
    subprocess.run(cmd, cwd=REPO, env=job_env(), check=True, timeout=600, capture_output=True)
    assert not any(row["trained_now"] == "True" for row in read_csv(out / "points.csv"))
    shutil.rmtree(out / "points", ignore_errors=True)


def test_a_recipe_gives_the_points_its_settings_and_the_ladder_keeps_its_own(tmp_path):
    """--recipe modern (the modern encoder recipe, ours): each point's command starts from the recipe,
    so its positions, attention pattern, schedule and masking apply, and the ladder's size, variant,
    budget and LR come after it and win; without a recipe the ladder's cosine schedule is set."""
    import dataclasses

    from swbert.scaling.quality import plan, pretrain_command
    from swbert.training.config import build_config

    plain = config(tmp_path, sizes=["1x64", "2x64", "2x128"])
    for recipe in (None, "modern"):
        cfg = dataclasses.replace(plain, recipe=recipe)
        point = plan(cfg, 96)[0]
        command = pretrain_command(point, cfg, tmp_path / "run", cfg.data_dir, Path("ds_configs/zero1.json"))
        args = command[command.index("swbert.launchers.pretrain") + 1 :]
        resolved = build_config(args[1] if recipe else None, args[2:] if recipe else args)
        assert (resolved.size, resolved.attention_type, resolved.seed) == (
            point.size,
            point.attention,
            point.seed,
        )
        assert resolved.lr == pytest.approx(point.lr, rel=1e-5)
        if recipe:
            assert args[:2] == ["--config", "modern"]
            assert (resolved.position_embedding, resolved.lr_schedule, resolved.mlm_probability) == (
                "rope",
                "wsd",
                0.3,
            )
        else:
            assert (resolved.position_embedding, resolved.lr_schedule) == ("learned", "cosine")
