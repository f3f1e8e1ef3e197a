"""isoFLOP mode and LR sweeps of the quality study: the plan (sizes too short for a budget left
out), bad input before anything trains, and the analysis against a stand-in whose loss is a known
parabola in ln N at each budget (no training here)."""

from __future__ import annotations

import json
import logging
import math
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from swbert.scaling import quality
from swbert.scaling.isoflop import analyse
from swbert.scaling.quality import Point, PointResult, QualityConfig, plan, plan_point, run_quality
from tests.scaling.test_scaling_quality import PINNED, StandIn, fake_data

SIZES = ["1x64", "2x64", "2x128", "3x128", "4x128", "4x256"]  # 46k to 3.2M non-embedding parameters
BUDGETS = [1e11, 1e12, 1e13, 1e14]
SHARED_GAIN = 0.05  # the stand-in's shared variant: this much lower L* at every budget
BEST_SCALE = 0.5  # the stand-in's best LR scale


def true_n_star(budget: float) -> float:
    return 1e5 * (budget / 1e11) ** 0.25


def true_l_star(budget: float, attention: str) -> float:
    return 2.0 + 30 * budget**-0.15 - (SHARED_GAIN if attention == "shared" else 0.0)


class Parabolas:
    """Trains nothing: held-out loss L*(C) + 0.2 (ln N - ln N*(C))^2, a penalty (ln s - ln 0.5)^2 for
    an LR scale s, and a little noise fixed by the point's name."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, point: Point, cfg: QualityConfig, run_dir: Path, data_dir: str) -> PointResult:
        self.calls.append(point.name)
        loss = true_l_star(point.budget, point.attention)
        loss += 0.2 * (math.log(point.non_embedding_params) - math.log(true_n_star(point.budget))) ** 2
        if point.lr_scale is not None:
            loss += math.log(point.lr_scale / BEST_SCALE) ** 2
        loss += np.random.default_rng(zlib.crc32(point.name.encode())).normal(0, 0.005)
        return PointResult("done", val_loss=loss, curve=[{"step": point.steps, "val_loss": loss}])


def ladder_sweep(point: Point, cfg: QualityConfig, run_dir: Path, data_dir: str) -> PointResult:
    """The ladder's stand-in (a known power law), with Parabolas' penalty for an LR scale."""
    result = StandIn()(point, cfg, run_dir, data_dir)
    result.val_loss += math.log(point.lr_scale / BEST_SCALE) ** 2
    return result


def config(tmp_path: Path, **kw) -> QualityConfig:
    defaults = dict(output_dir=tmp_path / "study", data_dir=fake_data(tmp_path / "data"), mlflow=False,
                    bootstrap=200, sizes=SIZES, isoflop_budgets=BUDGETS, min_steps=1, **PINNED)  # fmt: skip
    return QualityConfig(**{**defaults, **kw})


def test_an_isoflop_plan_trains_each_size_to_the_budget_and_leaves_out_those_too_short(caplog):
    cfg = QualityConfig(
        sizes=["1x64", "2x64", "2x128", "3x128", "4x256"], isoflop_budgets=[3e12, 3e13], **PINNED
    )
    steps = {s: plan_point(cfg, s, "standard", 1, 8000, budget=3e12).steps for s in cfg.sizes}
    assert steps["4x256"] < cfg.min_steps <= steps["3x128"]  # 4x256 is too short at 3e12 only
    assert plan_point(cfg, "4x256", "standard", 1, 8000, budget=3e13).steps >= cfg.min_steps
    with caplog.at_level(logging.INFO, logger="swbert.scaling.quality"):
        points = plan(cfg, 8000)
    (left_out,) = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]  # one line
    assert left_out.endswith(
        f"left out under --min-steps 100 (size at budget: steps): 4x256 at 3e12: {steps['4x256']}"
    )
    names = [p.name for p in points]
    assert len(names) == 2 * (4 + 5) and len(set(names)) == len(names)
    assert "2x64-shared-s1234-c3e13" in names and "4x256-standard-s1234-c3e12" not in names
    for p in points:
        assert p.budget in cfg.isoflop_budgets and p.steps >= cfg.min_steps
        assert p.tokens == round(p.budget / p.train_flops_per_token)
        assert p.train_flops == pytest.approx(p.budget, rel=1e-5)  # every point of a budget: its compute
    assert [p.budget for p in points] == sorted(p.budget for p in points)  # cheapest budget first


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--isoflop-budgets", "3e12", "--sizes", "1x64", "2x64", "4x256"],
         "--isoflop-budgets 3e12: only 2 size(s) of --sizes reach --min-steps 100"),
        (["--isoflop-budgets", "1e9"], "--isoflop-budgets 1e9: only 0 size(s)"),
        (["--tokens-per-param", "0.2"], "--tokens-per-param 0.2: no point reaches --min-steps 100"),
        (["--isoflop-budgets", "3e13", "0"], "--isoflop-budgets 0: must be positive"),
        (["--lr-scales", "1", "0"], "--lr-scales 0: must be positive"),
        (["--isoflop-budgets", "3e13", "3.0001e13"], "--isoflop-budgets 3e+13 3.0001e+13: two values name"),
        (["--min-steps", "0"], "--min-steps 0: must be positive"),
    ],
)  # fmt: skip
def test_bad_isoflop_input_is_refused_in_one_line_naming_the_flag(tmp_path, capsys, argv, said):
    from launchers.scaling_study import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--quality", *argv, "--data-dir", fake_data(tmp_path / "data"), "--output-dir",
              str(tmp_path / "out"), "--mlflow", "false"])  # fmt: skip
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and said in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out" / "points").exists()


def test_a_tokens_per_param_beside_budgets_is_ignored():
    one = plan(QualityConfig(isoflop_budgets=[3e13], **PINNED), 8000)
    other = plan(QualityConfig(isoflop_budgets=[3e13], **{**PINNED, "tokens_per_param": 20}), 8000)
    assert [(p.name, p.tokens) for p in one] == [(p.name, p.tokens) for p in other]


def test_the_analysis_finds_each_budgets_optimum_the_frontier_and_the_gap_at_equal_compute(tmp_path, capsys):
    cfg = config(tmp_path)
    rows = run_quality(cfg, Parabolas())
    assert len(rows) == len(BUDGETS) * len(SIZES) * 2
    out = cfg.output_dir
    result = json.loads((out / "isoflop.json").read_text())
    for attention in ("standard", "shared"):
        for budget in BUDGETS:
            entry = result["profiles"][attention][quality.budget_label(budget)]
            (lo, hi), found = entry["intervals"]["n_star"], entry["optimum"]["n_star"]
            assert lo <= true_n_star(budget) <= hi and found == pytest.approx(true_n_star(budget), rel=0.05)
            (lo, hi) = entry["intervals"]["l_star"]
            assert lo <= true_l_star(budget, attention) <= hi
        frontier = result["frontier"][attention]
        assert [p["budget"] for p in frontier["points"]] == BUDGETS
        lo, hi = frontier["fit"]["intervals"]["alpha"]
        assert lo <= 0.15 <= hi  # the stand-in's L*(C) falls as C^-0.15
    for at in result["comparison"]["shared"]["at"]:  # shared is SHARED_GAIN lower at equal compute
        lo, hi = at["interval"]
        assert lo <= -SHARED_GAIN <= hi and hi < 0
    table = (out / "isoflop.md").read_text()
    assert table in capsys.readouterr().out  # printed as written
    assert len([line for line in table.splitlines() if line.startswith("| 1e")]) == 2 * len(BUDGETS)
    assert "frontier, shared: L*(C)" in table and "floors: not computed" in table
    for name in ("isoflop.png", "frontier.png"):
        assert (out / "plots" / name).stat().st_size > 1000
    assert len((out / "points.csv").read_text().splitlines()) == len(rows) + 1
    study = SimpleNamespace(tracker=Tracker(), parent="study-run")  # the study's MLflow run
    quality.write_isoflop(cfg, rows, study)
    assert sorted(p.name for p in study.tracker.files) == [
        "frontier.png", "isoflop.json", "isoflop.md", "isoflop.png", "points.csv"
    ]  # fmt: skip
    frontier = result["frontier"]["shared"]["fit"]
    assert study.tracker.metrics["shared.frontier_alpha"] == pytest.approx(frontier["alpha"])


class Tracker:
    """What the study's MLflow run is given."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}
        self.files: list[Path] = []

    def log(self, run: str, metrics: dict[str, float]) -> None:
        self.metrics.update(metrics)

    def log_files(self, run: str, files: list[Path]) -> None:
        self.files += files


def test_an_optimum_beyond_the_sizes_is_said_not_invented_and_three_budgets_give_no_frontier(tmp_path):
    small = ["1x64", "2x64", "2x128"]  # at most 413k parameters: N*(1e14) = 562k lies beyond
    cfg = config(tmp_path, sizes=small, isoflop_budgets=[1e11, 1e12, 1e14], seeds=[1, 2])
    run_quality(cfg, Parabolas())
    result = json.loads((cfg.output_dir / "isoflop.json").read_text())
    beyond = result["profiles"]["standard"]["1e14"]
    assert beyond["optimum"] is None and beyond["reason"].startswith("optimum beyond the largest size")
    assert result["profiles"]["standard"]["1e11"]["optimum"] is not None
    fit = result["frontier"]["standard"]["fit"]
    assert "alpha" not in fit and "2 budget(s) with an optimum" in fit["error"]
    gap = result["comparison"]["shared"]["at"][2]
    assert "difference" not in gap and "no optimum" in gap["reason"]


def test_points_at_the_unigram_floor_are_left_out_and_the_floors_are_computed_once(tmp_path, monkeypatch):
    calls = []

    def floors(data_dir, seq_len, mlm_probability, seed, sequences):
        calls.append((seq_len, mlm_probability, seed, sequences))
        return {"unigram": 4.0, "bigram": 3.5, "predicted_tokens": 1000.0}

    monkeypatch.setattr(quality, "held_out_floors", floors)
    cfg = config(tmp_path, isoflop_budgets=[1e11, 1e12], eval_batches=3, micro_batch=4)
    rows = run_quality(cfg, Parabolas())
    assert calls == [(128, 0.15, [1234], 12)]
    result = json.loads((cfg.output_dir / "isoflop.json").read_text())
    at_floor = sorted(r["name"] for r in rows if r["val_loss"] > 4.0 - cfg.floor_margin)
    assert at_floor and sorted(result["at_floor"]["names"]) == at_floor
    used = {n for a in result["profiles"].values() for e in a.values() for n in e["points"]}
    assert not used & set(at_floor) and len(used) == len(rows) - len(at_floor)
    assert (
        f"{len(at_floor)} point(s) within 0.1 nats of the unigram floor, left out"
        in (cfg.output_dir / "isoflop.md").read_text()
    )
    run_quality(cfg, Parabolas())  # a re-run reads the floors back
    assert len(calls) == 1
    cfg.fit_floor_points = True  # a fit setting: no change of the study
    again, _ = analyse(cfg, rows, {"unigram": 4.0, "bigram": 3.5})
    used = {n for a in again["profiles"].values() for e in a.values() for n in e["points"]}
    assert set(at_floor) <= used


def test_an_lr_sweep_keeps_each_points_best_scale(tmp_path):
    cfg = config(tmp_path, isoflop_budgets=[1e12], sizes=SIZES[:4], lr_scales=[0.25, 0.5, 1.0])
    trainer = Parabolas()
    rows = run_quality(cfg, trainer)
    assert len(trainer.calls) == 4 * 2 * 3 and "2x64-shared-s1234-c1e12-lr0.5" in trainer.calls
    result = json.loads((cfg.output_dir / "isoflop.json").read_text())
    assert len(result["points"]) == 4 * 2
    for point in result["points"]:
        assert point["lr_scale"] == BEST_SCALE and point["name"].endswith("-lr0.5")
        sweep = {float(s): loss for s, loss in point["lr_sweep"].items()}
        assert set(sweep) == {0.25, 0.5, 1.0} and min(sweep, key=sweep.get) == BEST_SCALE
    used = result["profiles"]["standard"]["1e12"]["points"]
    assert len(used) == 4 and all(name.endswith("-lr0.5") for name in used)
    assert len(rows) == len(trainer.calls)  # points.csv: every run of the sweep
    assert len((cfg.output_dir / "points.csv").read_text().splitlines()) == len(rows) + 1


def test_a_ladders_fits_take_each_points_best_scale(tmp_path):
    cfg = config(tmp_path, isoflop_budgets=[], sizes=SIZES[:4], lr_scales=[0.5, 2.0])
    rows = run_quality(cfg, ladder_sweep)
    fits = json.loads((cfg.output_dir / "fits.json").read_text())
    for attention in ("standard", "shared"):
        fitted = [p["name"] for p in fits["variants"][attention]["points"]]
        assert len(fitted) == 4 and all(name.endswith("-lr0.5") for name in fitted)
    assert len((cfg.output_dir / "points.csv").read_text().splitlines()) == len(rows) + 1 == 4 * 2 * 2 + 1


@pytest.mark.parametrize(
    "change, named",
    [({"isoflop_budgets": [1e11, 1e13]}, f"--isoflop-budgets {1e11} {1e13} (was {1e11} {1e12})"),
     ({"lr_scales": [0.5, 1.0]}, "--lr-scales 0.5 1.0 (was (unset))")],
)  # fmt: skip
def test_a_rerun_with_other_budgets_or_scales_is_refused(tmp_path, change, named):
    cfg = config(tmp_path, isoflop_budgets=[1e11, 1e12], sizes=SIZES[:3])
    run_quality(cfg, Parabolas())
    with pytest.raises(ValueError) as err:
        run_quality(QualityConfig(**{**cfg.__dict__, **change}), Parabolas())
    assert named in str(err.value) and "\n" not in str(err.value)


def test_a_ladder_keeps_its_study_identity_from_before_isoflop_mode(tmp_path):
    """A plain ladder's study.json and point keys hold none of the new options, so a study folder
    from before them is continued, not refused."""
    cfg = QualityConfig(**PINNED, output_dir=tmp_path / "study", data_dir=fake_data(tmp_path / "data"), mlflow=False,
                        bootstrap=50)  # fmt: skip
    _, options = quality.prepare(cfg)
    new = {"isoflop_budgets", "lr_scales", "min_steps", "floor_margin", "fit_floor_points"}
    assert not new & set(options) and {"tokens_per_param", "lr_scale"} <= set(options)
