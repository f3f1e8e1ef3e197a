"""The quality study's outputs: fits.json, fits.md (also printed), points.csv, plots and the MLflow runs.

fits.json holds, per variant, L(N) against non-embedding parameters and L(C) against training
FLOPs (fitted parameters with intervals, convergence and the residual against the seed spread, see
`swbert.scaling.fit`), the points each fit used and those it left out with their reason (a point
at the data's unigram floor is left out unless --fit-floor-points), its warnings, the data's
floors, and each variant's parameter efficiency against the reference variant: the reference's
non-embedding parameter count that reaches the variant's loss, at every measured size and at the
`--extrapolate-to` sizes, withheld there (with the reason) when its interval is unbounded or a fit
has not converged (ours). fits.md is the same answer as a table per variant.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from swbert.models.config import SIZES, SWBertConfig
from swbert.models.flops import layer_params
from swbert.scaling.fit import Fit, FitError, equivalent_size, fit_power_law
from swbert.scaling.floors import floor_lines, mark_floor
from swbert.scaling.report import line_style
from swbert.studies.outputs import pyplot, save_figure, write_csv
from swbert.studies.runner import StudyLog

PLOTS = {"non_embedding_params": "loss_vs_params", "train_flops": "loss_vs_flops"}
FITS = {"L(N)": "non_embedding_params", "L(C)": "train_flops"}  # each fit's label and x
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


def floor_reason(row: dict[str, Any], margin: float) -> str:
    """Why a point at the unigram floor is left out of the fits."""
    below = row["below_unigram"]
    side = f"{below:.3g} nats below it" if below >= 0 else f"{-below:.3g} nats above it"
    return f"at the unigram floor: {side}, less than --floor-margin {margin:g}"


def fitted_rows(cfg: Any, mine: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """The variant's rows its fits use, and those left out with their reason: not finished, or at
    the unigram floor (unless --fit-floor-points)."""
    used, excluded = [], []
    for r in mine:
        if r["status"] != "done":
            excluded.append({"name": r["name"], "reason": r["reason"]})
        elif r.get("at_floor") and not cfg.fit_floor_points:
            excluded.append({"name": r["name"], "reason": floor_reason(r, cfg.floor_margin)})
        else:
            used.append(r)
    return used, excluded


def variant_entry(cfg: Any, mine: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Fit]]:
    """One variant's part of fits.json (points, excluded, both fits, warnings) and its fits by label."""
    used, excluded = fitted_rows(cfg, mine)
    extra = ("below_unigram",) if any("below_unigram" in r for r in used) else ()
    entry: dict[str, Any] = {
        "points": [{k: r[k] for k in (*POINT_KEYS, *extra)} for r in used],
        "excluded": excluded,
    }
    warnings, fits = [], {}
    for label, key in FITS.items():
        fit, why = fit_variant(used, key, cfg.bootstrap, cfg.level)
        entry[label] = fit.to_json() if fit else {"error": why}
        if fit is None:
            warnings.append(f"{label}: no fit: {why}")
            continue
        fits[label] = fit
        warnings += [f"{label} not converged: {r}" for r in fit.why_not_converged]
        warnings += [f"{label}: {w}" for w in fit.warnings]
    warnings += [f"{e['name']} left out of the fits: {e['reason']}" for e in excluded]
    kept = [r["name"] for r in used if r.get("at_floor")]
    if kept:
        warnings.append(
            f"{', '.join(kept)}: at the unigram floor (less than --floor-margin {cfg.floor_margin:g} below "
            "it), kept in the fits (--fit-floor-points)"
        )
    entry["warnings"] = warnings
    return entry, fits


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


def ratio_problems(at: dict[str, Any], fits: dict[str, Fit], reference: str) -> list[str]:
    """Why an efficiency ratio should not be read: an unbounded interval (the reference curve never
    reaches the loss in some bootstrap draws), or a fit not converged. `fits`: L(N) by variant."""
    reasons = []
    share = at["unreached_share"]
    if share > 0 or not np.isfinite(at["ratio"]) or not np.isfinite(at["ratio_interval"][1]):
        where = f"in {share:.1%} of the bootstrap draws" if share > 0 else "at the fitted curves"
        reasons.append(f"its interval is unbounded: the {reference} curve does not reach this loss {where}")
    reasons += [f"the {name} L(N) fit is not converged" for name, fit in fits.items() if not fit.converged]
    return reasons


def efficiency_entry(
    cfg: Any, attention: str, fits: dict[str, Fit], rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """The variant's parameter efficiency against the reference, at its measured sizes (with their
    warnings) and at the --extrapolate-to sizes ({"size", "withheld": why} when it should not be read)."""
    target, reference = fits[attention], fits[cfg.reference]
    measured = sorted({r["non_embedding_params"] for r in rows if r["attention"] == attention})
    entry: dict[str, Any] = {"reference": cfg.reference, "measured": [], "extrapolated": {}}
    for at in equivalent_size(target, reference, measured)["at"]:
        entry["measured"].append({**at, "warnings": ratio_problems(at, fits, cfg.reference)})
    named = extrapolation_sizes(cfg.extrapolate_to, attention)
    for name, at in zip(cfg.extrapolate_to, equivalent_size(target, reference, named)["at"] if named else []):
        reasons = ratio_problems(at, fits, cfg.reference)
        entry["extrapolated"][name] = {"size": at["size"], "withheld": "; ".join(reasons)} if reasons else at
    return entry


def build_fits(
    cfg: Any, rows: list[dict[str, Any]], floors: dict[str, float] | None = None
) -> tuple[dict[str, Any], dict[str, dict[str, Fit]]]:
    """fits.json's content, and each variant's fits by label (for the plots). Rows at the floor are
    marked beforehand (`mark_floor`)."""
    variants: dict[str, Any] = {}
    fitted: dict[str, dict[str, Fit]] = {}
    for attention in dict.fromkeys(cfg.attentions):
        variants[attention], fitted[attention] = variant_entry(
            cfg, [r for r in rows if r["attention"] == attention]
        )
    by_n = {attention: fits["L(N)"] for attention, fits in fitted.items() if "L(N)" in fits}
    efficiency = {
        attention: efficiency_entry(
            cfg, attention, {attention: by_n[attention], cfg.reference: by_n[cfg.reference]}, rows
        )
        for attention in by_n
        if attention != cfg.reference and cfg.reference in by_n
    }
    spec = {
        "x": "non-embedding parameters (L(N)); training FLOPs = tokens x train_flops_per_token (L(C))",
        "budget": f"tokens = {cfg.tokens_per_param} x non-embedding parameters",
        "level": cfg.level,
    }
    bounds = None
    if floors is not None:
        bounds = {"unigram": floors["unigram"], "bigram": floors.get("bigram"), "margin": cfg.floor_margin}
    return {"study": spec, "floors": bounds, "variants": variants, "efficiency": efficiency}, fitted


def write_outputs(
    cfg: Any,
    rows: list[dict[str, Any]],
    study: StudyLog | None = None,
    floors: dict[str, float] | None = None,
) -> dict[str, Any]:
    """fits.json, fits.md (the table, also printed), points.csv and plots/ under cfg.output_dir (and to
    the study's MLflow run: each variant's alpha and E, the files); returns the fits. Rows less than
    cfg.floor_margin below the unigram floor of `floors` are marked, and left out of the fits unless
    cfg.fit_floor_points."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    mark_floor(rows, floors, cfg.floor_margin)
    fits, fitted = build_fits(cfg, rows, floors)
    fits_path = out / "fits.json"
    text = json.dumps(fits, indent=2, default=float) + "\n"
    plots = [out / "plots" / f"{name}.png" for name in PLOTS.values()]
    unchanged = fits_path.is_file() and fits_path.read_text() == text and all(p.is_file() for p in plots)
    fits_path.write_text(text)
    table = render_table(fits)
    print(table, flush=True)  # the study's answer, on the console
    table_path = out / "fits.md"
    table_path.write_text(table)
    csv_path = write_csv(rows, out / "points.csv")
    if not unchanged:  # a re-run that found every point finished draws the same plots: keep them
        plots = plot_fits(rows, fitted, fits, out / "plots")
    if study is not None:
        for attention, entry in fits["variants"].items():
            law = entry["L(N)"]
            if "alpha" in law:
                study.tracker.log(
                    study.parent, {f"{attention}.alpha": law["alpha"], f"{attention}.E": law["E"]}
                )
        study.tracker.log_files(study.parent, [fits_path, table_path, csv_path, *plots])
    return fits


# ---- the table (console and fits.md) -------------------------------------------------------------

WIDTH = 96  # the table's wrapped lines fit an ordinary terminal


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else "inf" if value == np.inf else f"{value:.{digits}g}"


def _interval(value: float, interval: list[float], digits: int = 3) -> str:
    return f"{_num(value, digits)} [{_num(interval[0], digits)}, {_num(interval[1], digits)}]"


def _count(n: float) -> str:
    """A parameter count as 85.1M, 120k."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def _bullet(text: str) -> str:
    return textwrap.fill(text, WIDTH, initial_indent="- ", subsequent_indent="  ")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table with padded columns, so it reads as well on the console."""
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    lines = [[c.ljust(w) for c, w in zip(r, widths)] for r in (header, ["-" * w for w in widths], *rows)]
    return ["| " + " | ".join(cells) + " |" for cells in lines]


def fit_rows(entry: dict[str, Any]) -> list[str]:
    """A variant's fits: alpha, E, converged, rmse against the seed spread."""
    rows = []
    for label in FITS:
        law = entry[label]
        if "error" in law:
            rows.append([label, "no fit (see warnings)", "-", "-", "-"])
            continue
        ratio = law["rmse_over_seed_sd"]
        spread = f"{_num(law['rmse'], 2)} / {_num(law['seed_sd'], 2)}" + (f" = {ratio:.1f}x" if ratio else "")
        converged = "yes" if law["converged"] else "NO"
        E = _interval(law["E"], law["intervals"]["E"], 4)
        rows.append([label, _interval(law["alpha"], law["intervals"]["alpha"]), E, converged, spread])
    return _table(["fit", "alpha", "E (nats)", "converged", "rmse / seed sd"], rows)


def efficiency_lines(attention: str, entry: dict[str, Any] | None, level: float) -> list[str]:
    """The variant's parameter efficiency at its measured sizes and the extrapolation sizes."""
    if not entry:
        return []
    ref = entry["reference"]
    lines = [
        f"Efficiency vs {ref} ({ref} parameters reaching {attention}'s loss / {attention}'s, {level:.0%}):"
    ]
    for at in entry["measured"]:
        text = f"at {_count(at['size'])} (measured): {_interval(at['ratio'], at['ratio_interval'])}"
        lines.append(_bullet(text + "".join(f"; warning: {w}" for w in at["warnings"])))
    for name, at in entry["extrapolated"].items():
        where = f"at {name} ({_count(at['size'])}, extrapolated)"
        ratio = (
            f"withheld: {at['withheld']}"
            if "withheld" in at
            else _interval(at["ratio"], at["ratio_interval"])
        )
        lines.append(_bullet(f"{where}: {ratio}"))
    return [*lines, ""]


def render_table(fits: dict[str, Any]) -> str:
    """The study's answer as markdown that reads on a console: per variant its fits, the points
    fitted and left out, its efficiency against the reference, and its warnings."""
    level = fits["study"]["level"]
    lines = [f"# Quality study: held-out loss L = E + A x^-alpha ({level:.0%} intervals)", ""]
    floors = fits.get("floors")
    said = "Floors: not computed; no point was checked against the unigram floor."
    if floors:
        said = (
            f"Floors: unigram {floors['unigram']:.3f} nats, bigram {_num(floors['bigram'], 4)} nats; a "
            f"point less than {floors['margin']:g} nats below the unigram floor is at the floor."
        )
    lines += [textwrap.fill(said, WIDTH), ""]
    for attention, entry in fits["variants"].items():
        fitted, left = len(entry["points"]), len(entry["excluded"])
        lines += [
            f"## {attention}",
            "",
            f"{fitted} point(s) fitted, {left} left out.",
            "",
            *fit_rows(entry),
            "",
        ]
        lines += efficiency_lines(attention, fits["efficiency"].get(attention), level)
        if entry["warnings"]:
            lines += ["Warnings:", *(_bullet(w) for w in entry["warnings"]), ""]
    return "\n".join(lines)


# ---- the plots -----------------------------------------------------------------------------------


def plot_fits(
    rows: list[dict[str, Any]], fitted: dict[str, dict[str, Fit]], fits: dict[str, Any], folder: Path
) -> list[Path]:
    """loss_vs_params.png and loss_vs_flops.png: points (hollow: at the unigram floor), fitted
    curves and their bands, one line style per variant, and the unigram and bigram floors."""
    level = fits["study"]["level"]
    written = []
    for label, key in FITS.items():
        fig, ax = pyplot().subplots(figsize=(6, 4))
        for i, attention in enumerate(fits["variants"]):
            done = [r for r in rows if r["attention"] == attention and r["status"] == "done"]
            if done:
                draw_variant(
                    ax, attention, f"C{i}", [r[key] for r in done], done, fitted[attention].get(label)
                )
        floor_lines(ax, fits.get("floors"))
        ax.set_xscale("log")
        ax.set_xlabel("non-embedding parameters" if key == "non_embedding_params" else "training FLOPs")
        ax.set_ylabel("held-out MLM loss")
        ax.set_title(f"{label}: E + A x^-alpha, {level:.0%} bands")
        ax.legend(fontsize=7)
        written.append(save_figure(fig, folder / f"{PLOTS[key]}.png", dpi=120))
    return written


def draw_variant(
    ax: Any, attention: str, color: str, xs: list[float], done: list[dict[str, Any]], fit: Fit | None
) -> None:
    """One variant's points (filled; hollow at the floor), its fitted curve and band."""
    losses = [r["val_loss"] for r in done]
    at = np.array([bool(r.get("at_floor")) for r in done])
    x, y = np.asarray(xs, dtype=float), np.asarray(losses, dtype=float)
    ax.scatter(x[~at], y[~at], s=18, color=color, label=attention)
    if at.any():
        ax.scatter(x[at], y[at], s=18, facecolors="none", edgecolors=color, label=f"{attention} at the floor")
    if fit is not None:
        grid = np.geomspace(fit.x.min() / 1.5, fit.x.max() * 1.5, 100)
        ax.plot(grid, fit.law.loss(grid), line_style(attention), color=color)
        lo, hi = fit.band(grid)
        ax.fill_between(grid, lo, hi, alpha=0.15, color=color)
