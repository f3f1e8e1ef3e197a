"""The quality study's outputs: fits.json (its fields: docs/scaling.md, "Quality"), fits.md (the same
answer as a table per variant, also printed), points.csv, plots and the MLflow runs. A parameter
efficiency is withheld, with the reason, where its interval is unbounded or a fit has not converged
(ours). The isoFLOP analysis (`swbert.scaling.isoflop`) writes its answer with the same helpers."""

from __future__ import annotations

import functools
import json
import textwrap
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from swbert.models.config import SIZES, SWBertConfig
from swbert.models.flops import layer_params
from swbert.scaling.fit import Fit, equivalent_size, fit_or_reason
from swbert.scaling.report import floor_lines, line_style, save_plot
from swbert.studies.outputs import markdown_table, new_axes, write_csv
from swbert.studies.runner import StudyLog

FITS = {"L(N)": "non_embedding_params", "L(C)": "train_flops"}  # each fit's label and x
PLOTS = {"non_embedding_params": "loss_vs_params", "train_flops": "loss_vs_flops"}
POINT_KEYS = ("name", "size", "seed", "params", "non_embedding_params", "tokens", "train_flops", "val_loss")
WIDTH = 96  # the table's wrapped lines fit an ordinary terminal


def non_embedding_params(config: SWBertConfig) -> int:
    """Encoder layers and the MLM transform (dense + LayerNorm): Kaplan et al.'s N for an encoder."""
    d = config.hidden_size
    return config.num_hidden_layers * layer_params(config) + d * d + 3 * d


def marked_best(cfg: Any, rows: list[dict[str, Any]], floors: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per (size, variant, seed, budget): of an LR sweep's runs, the finished one with the
    lowest held-out loss (the first when none finished), with `lr_sweep`: each scale's loss (rows
    that are no sweep's pass through). Given the data's `floors` (ours; docs/scaling.md, "Floors"),
    with `below_unigram` (the unigram floor of its seed's masks, minus its held-out loss) and
    `at_floor` (finished and less than cfg.floor_margin nats below it)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["size"], row["attention"], row["seed"], row.get("budget")), []).append(row)
    best = []
    for group in groups.values():
        done = [r for r in group if r["status"] == "done"]
        row = min(done, key=lambda r: r["val_loss"]) if done else group[0]
        if row.get("lr_scale") is not None:
            row = {**row, "lr_sweep": {f"{r['lr_scale']:g}": r["val_loss"] for r in group}}
        best.append(row)
    for row in best if floors is not None else []:
        loss = row.get("val_loss")
        floor = floors.get("by_seed", {}).get(str(row.get("seed")), floors)["unigram"]  # its own masks
        row["below_unigram"] = None if loss is None else floor - loss
        row["at_floor"] = (
            row["status"] == "done" and loss is not None and row["below_unigram"] < cfg.floor_margin
        )
    return best


def fitted_rows(cfg: Any, mine: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """The rows the fits use, and those left out with their reason: not finished, or at the unigram
    floor (unless --fit-floor-points)."""
    used, excluded = [], []
    for r in mine:
        if r["status"] != "done":
            excluded.append({"name": r["name"], "reason": r["reason"]})
        elif r.get("at_floor") and not cfg.fit_floor_points:
            below = r["below_unigram"]
            side = f"{below:.3g} nats below it" if below >= 0 else f"{-below:.3g} nats above it"
            reason = f"at the unigram floor: {side}, less than --floor-margin {cfg.floor_margin:g}"
            excluded.append({"name": r["name"], "reason": reason})
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
        losses = [r["val_loss"] for r in used]
        fit, why = fit_or_reason([r[key] for r in used], losses, cfg.bootstrap, cfg.level)
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
    cfg: Any, attention: str, by_n: dict[str, Fit], rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """The variant's parameter efficiency against the reference (`by_n`: L(N) fits by variant), at its
    measured sizes (with warnings) and at the --extrapolate-to sizes ({"size", "withheld": why} when
    it should not be read)."""
    target, reference = by_n[attention], by_n[cfg.reference]
    fits = {attention: target, cfg.reference: reference}
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
    marked beforehand (`marked_best`)."""
    variants: dict[str, Any] = {}
    fitted: dict[str, dict[str, Fit]] = {}
    for attention in dict.fromkeys(cfg.attentions):
        variants[attention], fitted[attention] = variant_entry(
            cfg, [r for r in rows if r["attention"] == attention]
        )
    by_n = {attention: fits["L(N)"] for attention, fits in fitted.items() if "L(N)" in fits}
    efficiency = {
        attention: efficiency_entry(cfg, attention, by_n, rows)
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


# ---- writing an answer ---------------------------------------------------------------------------


def law_metrics(laws: dict[str, dict[str, Any]], prefix: str = "") -> dict[str, float]:
    """Each variant's fitted alpha and E as MLflow metrics (`standard.alpha`); a law not fitted has none."""
    return {f"{a}.{prefix}{k}": law[k] for a, law in laws.items() if "alpha" in law for k in ("alpha", "E")}


def write_answer(
    cfg: Any,
    stem: str,
    answer: dict[str, Any],
    table: str,
    rows: list[dict[str, Any]],
    study: StudyLog | None,
    metrics: dict[str, float],
    draw: Callable[[Path], list[Path]],
    plots: Iterable[str],
) -> dict[str, Any]:
    """OUT/{stem}.json, OUT/{stem}.md (the table, also printed) and OUT/points.csv (every row), OUT
    being cfg.output_dir; OUT/plots/{plots}.png drawn by `draw` into that folder, unless a re-run
    found the same answer and every plot (then kept); all of it logged to the study's MLflow run,
    with `metrics`. Returns the answer."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, table_path = out / f"{stem}.json", out / f"{stem}.md"
    pngs = [out / "plots" / f"{name}.png" for name in plots]
    text = json.dumps(answer, indent=2, default=float) + "\n"
    unchanged = json_path.is_file() and json_path.read_text() == text and all(p.is_file() for p in pngs)
    json_path.write_text(text)
    print(table, flush=True)  # the study's answer, on the console
    table_path.write_text(table)
    files = [json_path, table_path, write_csv(rows, out / "points.csv")]
    files += pngs if unchanged else draw(out / "plots")
    if study is not None:
        study.tracker.log(study.parent, metrics)
        study.tracker.log_files(study.parent, files)
    return answer


def write_outputs(
    cfg: Any,
    rows: list[dict[str, Any]],
    study: StudyLog | None = None,
    floors: dict[str, float] | None = None,
) -> dict[str, Any]:
    """fits.json, fits.md, points.csv and plots/ (`write_answer`, with each variant's alpha and E);
    returns the fits. The fits take each point's best run over the LR scales, those at the unigram
    floor of `floors` marked, and left out unless cfg.fit_floor_points."""
    best = marked_best(cfg, rows, floors)
    fits, fitted = build_fits(cfg, best, floors)
    metrics = law_metrics({attention: entry["L(N)"] for attention, entry in fits["variants"].items()})
    draw = functools.partial(plot_fits, best, fitted, fits)
    return write_answer(cfg, "fits", fits, render_table(fits), rows, study, metrics, draw, PLOTS.values())


# ---- the table (console and fits.md) -------------------------------------------------------------


def spelled(value: float | None, bounds: Sequence[float] | None = None, digits: int = 3) -> str:
    """`4.51 [4.48, 4.55]`: a value with its interval ("-" for none)."""
    if value is None:
        return "-"
    return f"{value:.{digits}g}" + (f" [{bounds[0]:.{digits}g}, {bounds[1]:.{digits}g}]" if bounds else "")


def _count(n: float) -> str:
    """A parameter count as 85.1M, 120k."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def _bullet(text: str) -> str:
    return textwrap.fill(text, WIDTH, initial_indent="- ", subsequent_indent="  ")


def fit_table(entry: dict[str, Any]) -> list[str]:
    """A variant's fits: alpha, E, converged, rmse against the seed spread."""
    rows = []
    for label in FITS:
        law = entry[label]
        if "error" in law:
            rows.append([label, "no fit (see warnings)", "-", "-", "-"])
            continue
        ratio = law["rmse_over_seed_sd"]
        spread = f"{spelled(law['rmse'], digits=2)} / {spelled(law['seed_sd'], digits=2)}"
        spread += f" = {ratio:.1f}x" if ratio else ""
        alpha, E = (
            spelled(law["alpha"], law["intervals"]["alpha"]),
            spelled(law["E"], law["intervals"]["E"], 4),
        )
        rows.append([label, alpha, E, "yes" if law["converged"] else "NO", spread])
    return markdown_table(["fit", "alpha", "E (nats)", "converged", "rmse / seed sd"], rows, padded=True)


def efficiency_lines(attention: str, entry: dict[str, Any] | None, level: float) -> list[str]:
    """The variant's parameter efficiency at its measured sizes and the extrapolation sizes."""
    if not entry:
        return []
    ref = entry["reference"]
    lines = [
        f"Efficiency vs {ref} ({ref} parameters reaching {attention}'s loss / {attention}'s, {level:.0%}):"
    ]
    for at in entry["measured"]:
        text = f"at {_count(at['size'])} (measured): {spelled(at['ratio'], at['ratio_interval'])}"
        lines.append(_bullet(text + "".join(f"; warning: {w}" for w in at["warnings"])))
    for name, at in entry["extrapolated"].items():
        withheld = f"withheld: {at['withheld']}" if "withheld" in at else ""
        ratio = withheld or spelled(at["ratio"], at["ratio_interval"])
        lines.append(_bullet(f"at {name} ({_count(at['size'])}, extrapolated): {ratio}"))
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
            f"Floors: unigram {floors['unigram']:.3f} nats, bigram {spelled(floors['bigram'], digits=4)} "
            f"nats; a point less than {floors['margin']:g} nats below the unigram floor is at the floor."
        )
    lines += [textwrap.fill(said, WIDTH), ""]
    for attention, entry in fits["variants"].items():
        fitted, left = len(entry["points"]), len(entry["excluded"])
        lines += [f"## {attention}", "", f"{fitted} point(s) fitted, {left} left out.", ""]
        lines += [*fit_table(entry), ""]
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
        xlabel = "non-embedding parameters" if key == "non_embedding_params" else "training FLOPs"
        title = f"{label}: E + A x^-alpha, {level:.0%} bands"
        fig, ax = new_axes(title, xlabel, "held-out MLM loss", figsize=(6, 4))
        for i, attention in enumerate(fits["variants"]):
            done = [r for r in rows if r["attention"] == attention and r["status"] == "done"]
            if done:
                draw_variant(ax, attention, f"C{i}", key, done, fitted[attention].get(label))
        floor_lines(ax, fits.get("floors"))
        written.append(save_plot(fig, ax, folder / f"{PLOTS[key]}.png"))
    return written


def draw_variant(
    ax: Any, attention: str, color: str, key: str, done: list[dict[str, Any]], fit: Fit | None
) -> None:
    """One variant's points against `key` (filled; hollow at the floor), its fitted curve and band."""
    at = np.array([bool(r.get("at_floor")) for r in done])
    x = np.array([r[key] for r in done], dtype=float)
    y = np.array([r["val_loss"] for r in done], dtype=float)
    ax.scatter(x[~at], y[~at], s=18, color=color, label=attention)
    if at.any():
        ax.scatter(x[at], y[at], s=18, facecolors="none", edgecolors=color, label=f"{attention} at the floor")
    if fit is not None:
        grid = np.geomspace(fit.x.min() / 1.5, fit.x.max() * 1.5, 100)
        ax.plot(grid, fit.law.loss(grid), line_style(attention), color=color)
        ax.fill_between(grid, *fit.band(grid), alpha=0.15, color=color)
