"""The quality study's answer from a synthetic ladder (rows as the study writes them, no training):
points at the unigram floor left out of the fits and named, extrapolations withheld with their
reason when their interval is unbounded or a fit has not converged, and the table on the console
and in fits.md."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from torch.testing import assert_close

from swbert.scaling import report
from swbert.scaling.fit import fit_power_law
from swbert.scaling.quality import PointResult, QualityConfig, plan, point_row
from swbert.scaling.quality_report import build_fits, render_table, write_outputs
from tests.scaling.test_scaling_quality import PINNED

LADDER = ["1x64", "2x64", "2x128", "3x128", "4x128"]
LAWS = {"standard": (3.0, 40.0, 0.3), "shared": (3.0, 30.0, 0.3)}  # E, A, alpha


def ladder(tmp_path: Path, laws: dict = LAWS, **kw) -> tuple[QualityConfig, list[dict]]:
    """The ladder's rows, each point's held-out loss on its variant's law (and a small deterministic
    wiggle, so that the fits have residuals)."""
    cfg = QualityConfig(
        **{**PINNED, **kw}, output_dir=tmp_path / "study", sizes=LADDER, mlflow=False, bootstrap=200
    )
    rows = []
    for i, point in enumerate(plan(cfg, 8000)):
        E, A, alpha = laws[point.attention]
        loss = E + A * point.non_embedding_params**-alpha + 0.002 * (-1) ** i
        rows.append(point_row(point, PointResult("done", val_loss=loss), trained=True))
    return cfg, rows


def smallest(rows: list[dict], attention: str) -> dict:
    return min((r for r in rows if r["attention"] == attention), key=lambda r: r["non_embedding_params"])


def reference_fit(cfg: QualityConfig, rows: list[dict]):
    return fit_power_law(
        [r["non_embedding_params"] for r in rows], [r["val_loss"] for r in rows], draws=cfg.bootstrap
    )


@pytest.mark.parametrize("keep", [False, True])
def test_a_point_at_the_floor_is_left_out_named_and_drawn(tmp_path, capsys, monkeypatch, keep):
    """The smallest standard point 0.05 nats below the unigram floor (margin 0.1): left out of both
    fits, which equal the fits of the other points, named in fits.json and in the printed table;
    with --fit-floor-points kept in the fits, and still named. The plots draw both floors and the
    point hollow."""
    cfg, rows = ladder(tmp_path, fit_floor_points=keep)
    low = smallest(rows, "standard")
    floors = {"unigram": low["val_loss"] + 0.05, "bigram": 2.9, "predicted_tokens": 1000}
    axes = []
    save = report.save_figure
    monkeypatch.setattr(
        report, "save_figure", lambda fig, *a, **k: axes.append(fig.axes[0]) or save(fig, *a, **k)
    )
    fits = write_outputs(cfg, rows, floors=floors)
    printed = capsys.readouterr().out

    mine = [r for r in rows if r["attention"] == "standard"]
    used = mine if keep else [r for r in mine if r is not low]
    expected = reference_fit(cfg, used)
    on_disk = json.loads((cfg.output_dir / "fits.json").read_text())
    standard = on_disk["variants"]["standard"]
    assert_close(standard["L(N)"]["alpha"], expected.law.alpha)
    assert_close(standard["L(N)"]["E"], expected.law.E)
    assert len(standard["L(C)"]["intervals"]) == 3 and len(standard["points"]) == len(used)
    assert on_disk["floors"] == {"unigram": floors["unigram"], "bigram": 2.9, "margin": 0.1}
    assert low["at_floor"] and [r["name"] for r in rows if r["at_floor"]] == [low["name"]]
    if keep:
        assert standard["excluded"] == []
        assert any(low["name"] in w and "--fit-floor-points" in w for w in standard["warnings"])
    else:
        reason = "at the unigram floor: 0.05 nats below it, less than --floor-margin 0.1"
        assert standard["excluded"] == [{"name": low["name"], "reason": reason}]
        assert f"{low['name']} left out of the fits: {reason}" in " ".join(printed.split())
    assert on_disk["variants"]["shared"]["excluded"] == []
    assert fits == on_disk
    assert printed.strip() == (cfg.output_dir / "fits.md").read_text().strip() == render_table(fits).strip()
    assert max(len(line) for line in printed.splitlines()) <= 100

    assert len(axes) == 2
    for ax, key in zip(axes, ("non_embedding_params", "train_flops")):
        floor_lines = {
            line.get_label(): line.get_ydata()[0] for line in ax.lines if "floor" in line.get_label()
        }
        assert floor_lines == {
            f"unigram floor ({floors['unigram']:.2f})": floors["unigram"],
            "bigram floor (2.90)": 2.9,
        }
        hollow = [c for c in ax.collections if c.get_label() == "standard at the floor"]
        assert len(hollow) == 1 and len(hollow[0].get_facecolors()) == 0
        assert_close(np.asarray(hollow[0].get_offsets()).tolist(), [[float(low[key]), low["val_loss"]]])


def test_an_unbounded_extrapolation_is_withheld_and_measured_sizes_keep_their_numbers(tmp_path, capsys):
    """The shared curve falls below the standard curve's floor E = 3 before BERT-base (E = 2, steep):
    no standard size reaches its loss there, so the ratio at base is withheld with that reason; at
    the measured sizes the standard curve does reach it and the ratios are reported."""
    laws = {"standard": (3.0, 40.0, 0.3), "shared": (2.0, 60.0, 0.25)}
    cfg, rows = ladder(tmp_path, laws)
    fits, fitted = build_fits(cfg, rows)
    assert all(f.converged for variant in fitted.values() for f in variant.values())
    entry = fits["efficiency"]["shared"]
    at_base = entry["extrapolated"]["base"]
    assert set(at_base) == {"size", "withheld"}
    assert at_base["withheld"].startswith(
        "its interval is unbounded: the standard curve does not reach this loss"
    )
    # the reason is true: the shared law at base is below the standard fit's floor
    assert fitted["shared"]["L(N)"].law.loss(at_base["size"]) < fitted["standard"]["L(N)"].law.E
    for at in entry["measured"]:
        assert np.isfinite(at["ratio"]) and np.isfinite(at["ratio_interval"]).all() and at["warnings"] == []
        assert_close(
            fitted["standard"]["L(N)"].law.loss(at["equivalent"]),
            fitted["shared"]["L(N)"].law.loss(at["size"]),
        )
    write_outputs(cfg, rows)
    printed = " ".join(capsys.readouterr().out.split())
    assert "at base (71.5M, extrapolated): withheld: its interval is unbounded" in printed


def test_a_fit_not_converged_withholds_the_extrapolation_and_warns_at_measured_sizes(tmp_path, capsys):
    """A reference whose fitted floor is negative: the shared variant's ratios at measured sizes keep
    their numbers and carry the warning; at base the ratio is withheld for it."""
    laws = {"standard": (-1.0, 12.0, 0.1), "shared": (3.0, 40.0, 0.3)}
    cfg, rows = ladder(tmp_path, laws, extrapolate_to=["2x128"])
    fits, fitted = build_fits(cfg, rows)
    standard = fits["variants"]["standard"]
    assert fitted["standard"]["L(N)"].law.E < 0 and not standard["L(N)"]["converged"]
    assert any(w.startswith("L(N) not converged: the fitted floor E") for w in standard["warnings"])
    entry = fits["efficiency"]["shared"]
    for at in entry["measured"]:
        assert np.isfinite(at["ratio"]) and "the standard L(N) fit is not converged" in at["warnings"]
    assert "the standard L(N) fit is not converged" in entry["extrapolated"]["2x128"]["withheld"]
    table = render_table(fits)
    assert "| L(N) |" in table and "| NO " in table
    assert "withheld: " in table and "warning: the standard L(N) fit is not converged" in " ".join(
        table.split()
    )
