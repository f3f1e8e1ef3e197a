"""The quality scaling study's driver: bad input before anything trains, re-runs that never
retrain a finished point, failed points kept with their reason, and the outputs. Points are trained
by a stand-in here (the real trainer: the long end-to-end test at the bottom)."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import pytest

from swbert.models.config import SIZES, SWBertConfig
from swbert.scaling.quality import Point, PointResult, QualityConfig, non_embedding_params, plan, run_quality
from swbert.scaling.report import read_csv
from tests.launch_utils import REPO, job_env


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


def config(tmp_path: Path, **kw) -> QualityConfig:
    defaults = dict(
        output_dir=tmp_path / "study", data_dir=fake_data(tmp_path / "data"), mlflow=False, bootstrap=200
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
    assert mini.tokens == round(1.0 * n) and mini.steps == math.ceil(mini.tokens / (32 * 128))
    assert mini.lr == pytest.approx(0.003239 - 0.0001395 * math.log(n))


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--sizes", "1x64", "2x64"], "--sizes"),
        (["--attentions", "standard", "nonesuch"], "--attentions nonesuch"),
        (["--sizes", "1x64", "2x64", "lots"], "--sizes lots"),
        (["--tokens-per-param", "0.01"], "--tokens-per-param 0.01"),
        (["--data-dir", "NOVALID"], "no validation split"),
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


@pytest.mark.long  # the default ladder trains 8 points: about 20 minutes on 2 CPU cores
def test_the_default_study_trains_fits_and_a_rerun_trains_nothing(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "quality"
    cmd = [sys.executable, "launchers/scaling_study.py", "--quality", "--output-dir", str(out)]
    subprocess.run(cmd, cwd=REPO, env=job_env(), check=True, timeout=1800)
    fits = json.loads((out / "fits.json").read_text())
    for attention in ("standard", "shared"):
        entry = fits["variants"][attention]
        losses = [p["val_loss"] for p in sorted(entry["points"], key=lambda p: p["non_embedding_params"])]
        assert losses == sorted(losses, reverse=True), (attention, losses)
        law = entry["L(N)"]
        assert law["converged"] and all(math.isfinite(v) for v in law["intervals"]["alpha"])
    assert (out / "plots" / "loss_vs_params.png").is_file() and (out / "mlflow.db").is_file()
    start = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env=job_env(), check=True, timeout=300)
    assert time.perf_counter() - start < 60
    shutil.rmtree(out / "points", ignore_errors=True)
