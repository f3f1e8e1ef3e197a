"""The quality study's outputs: fits.json, points.csv, plots and the MLflow runs.

fits.json holds, per variant, L(N) against non-embedding parameters and L(C) against training
FLOPs (fitted parameters with intervals, see `swbert.scaling.fit`), the points each fit used and
those it left out with their reason, and each variant's parameter efficiency against the
reference variant: the reference's non-embedding parameter count that reaches the variant's loss,
at every measured size and at the `--extrapolate-to` sizes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from swbert.models.config import SIZES, SWBertConfig
from swbert.models.flops import layer_params
from swbert.scaling.fit import Fit, FitError, equivalent_size, fit_power_law
from swbert.scaling.report import line_style
from swbert.studies.outputs import pyplot, save_figure, write_csv
from swbert.studies.runner import StudyLog

PLOTS = {"non_embedding_params": "loss_vs_params", "train_flops": "loss_vs_flops"}
POINT_KEYS = ("name", "size", "seed", "params", "non_embedding_params", "tokens", "train_flops", "val_loss")


def non_embedding_params(config: SWBertConfig) -> int:
    """Encoder layers and the MLM transform (dense + LayerNorm): Kaplan et al.'s N for an encoder."""
    d = config.hidden_size
    return config.num_hidden_layers * layer_params(config) + d * d + 3 * d


def fit_variant(rows: list[dict[str, Any]], x_key: str, draws: int, level: float) -> tuple[Fit | None, str]:
    """The variant's fit of held-out loss against `x_key`, or None and why it could not be made."""
    done = [r for r in rows if r["status"] == "done"]
    try:
        fit = fit_power_law([r[x_key] for r in done], [r["val_loss"] for r in done], draws=draws, level=level)
    except FitError as err:
        return None, str(err)
    return fit, ""


def extrapolation_sizes(names: list[str], attention: str) -> list[float]:
    """Non-embedding parameters of each `--extrapolate-to` entry: a size name or a number."""
    out = []
    for name in names:
        if name in SIZES:
            out.append(float(non_embedding_params(SWBertConfig.from_size(name, attention_type=attention))))
        else:
            try:
                out.append(float(name))
            except ValueError:
                raise ValueError(f"--extrapolate-to {name}: neither a size nor a parameter count") from None
    return out


def build_fits(cfg: Any, rows: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Fit]]:
    """fits.json's content, and the L(N) fits by variant (for the plots)."""
    variants: dict[str, Any] = {}
    by_n: dict[str, Fit] = {}
    for attention in dict.fromkeys(cfg.attentions):
        mine = [r for r in rows if r["attention"] == attention]
        entry: dict[str, Any] = {
            "points": [{k: r[k] for k in POINT_KEYS} for r in mine if r["status"] == "done"],
            "excluded": [{"name": r["name"], "reason": r["reason"]} for r in mine if r["status"] != "done"],
        }
        for label, key in (("L(N)", "non_embedding_params"), ("L(C)", "train_flops")):
            fit, why = fit_variant(mine, key, cfg.bootstrap, cfg.level)
            entry[label] = fit.to_json() if fit else {"error": why}
            if fit and label == "L(N)":
                by_n[attention] = fit
        variants[attention] = entry
    efficiency: dict[str, Any] = {}
    reference = by_n.get(cfg.reference)
    for attention, fit in by_n.items():
        if attention == cfg.reference or reference is None:
            continue
        measured = sorted({r["non_embedding_params"] for r in rows if r["attention"] == attention})
        named = extrapolation_sizes(cfg.extrapolate_to, attention)
        efficiency[attention] = {
            "reference": cfg.reference,
            "measured": equivalent_size(fit, reference, measured)["at"],
            "extrapolated": dict(zip(cfg.extrapolate_to, equivalent_size(fit, reference, named)["at"]))
            if named
            else {},
        }
    spec = {
        "x": "non-embedding parameters (L(N)); training FLOPs = tokens x train_flops_per_token (L(C))",
        "budget": f"tokens = {cfg.tokens_per_param} x non-embedding parameters",
        "level": cfg.level,
    }
    return {"study": spec, "variants": variants, "efficiency": efficiency}, by_n


def write_outputs(cfg: Any, rows: list[dict[str, Any]], study: StudyLog | None = None) -> dict[str, Any]:
    """fits.json, points.csv and plots/ under cfg.output_dir (and to the study's MLflow run: each
    variant's alpha and E, the files); returns the fits."""
    out = Path(cfg.output_dir)
    fits, by_n = build_fits(cfg, rows)
    fits_path = out / "fits.json"
    text = json.dumps(fits, indent=2, default=float) + "\n"
    plots = [out / "plots" / f"{name}.png" for name in PLOTS.values()]
    unchanged = fits_path.is_file() and fits_path.read_text() == text and all(p.is_file() for p in plots)
    fits_path.write_text(text)
    csv_path = write_csv(rows, out / "points.csv")
    if not unchanged:  # a re-run that found every point finished draws the same plots: keep them
        plots = plot_fits(rows, by_n, fits, out / "plots", cfg.level)
    if study is not None:
        for attention, entry in fits["variants"].items():
            law = entry["L(N)"]
            if "alpha" in law:
                study.tracker.log(
                    study.parent, {f"{attention}.alpha": law["alpha"], f"{attention}.E": law["E"]}
                )
        study.tracker.log_files(study.parent, [fits_path, csv_path, *plots])
    return fits


def plot_fits(
    rows: list[dict[str, Any]], by_n: dict[str, Fit], fits: dict[str, Any], folder: Path, level: float
) -> list[Path]:
    """loss_vs_params.png and loss_vs_flops.png: points, fitted curves and their bands, one line
    style per variant."""
    written = []
    for (key, name), label in zip(PLOTS.items(), ("L(N)", "L(C)")):
        fig, ax = pyplot().subplots(figsize=(6, 4))
        for attention, entry in fits["variants"].items():
            done = [r for r in rows if r["attention"] == attention and r["status"] == "done"]
            if not done:
                continue
            xs = np.array([r[key] for r in done], dtype=float)
            line = ax.scatter(xs, [r["val_loss"] for r in done], label=attention, s=18)
            if "E" in entry[label]:
                fit = fit_power_law(xs, [r["val_loss"] for r in done], draws=200, level=level)
                grid = np.geomspace(xs.min() / 1.5, xs.max() * 1.5, 100)
                ax.plot(grid, fit.law.loss(grid), line_style(attention), color=line.get_facecolor()[0])
                lo, hi = fit.band(grid)
                ax.fill_between(grid, lo, hi, alpha=0.15, color=line.get_facecolor()[0])
        ax.set_xscale("log")
        ax.set_xlabel("non-embedding parameters" if key == "non_embedding_params" else "training FLOPs")
        ax.set_ylabel("held-out MLM loss")
        ax.set_title(f"{label}: E + A x^-alpha, {level:.0%} bands")
        ax.legend()
        written.append(save_figure(fig, folder / f"{name}.png", dpi=120))
    return written
