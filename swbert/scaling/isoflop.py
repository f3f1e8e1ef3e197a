"""The isoFLOP analysis of a quality study (docs/scaling.md, "isoFLOP mode"): at each training-compute
budget C, held-out loss against size is a profile with a loss-optimal size N*(C) and loss L*(C);
the compute-optimal frontier is L*(C) across budgets, and variants are compared at equal compute
by L*_variant(C) - L*_reference(C) (the method of Hoffmann et al., 2022, approach 2).

Each profile is a parabola in ln N fitted by least squares, with intervals from a residual
bootstrap (`swbert.scaling.fit.resample`); a profile whose minimum lies outside its sizes, or that
does not curve upward, gets no optimum instead of an extrapolated one (ours)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from swbert.scaling.fit import fit_or_reason, percentile_interval, resample
from swbert.scaling.quality_report import fitted_rows, law_metrics, marked_best, spelled, write_answer
from swbert.scaling.report import floor_lines, line_style, save_plot
from swbert.studies.outputs import markdown_table, new_axes, pyplot
from swbert.studies.runner import StudyLog

PROFILE_SIZES = 3  # a parabola has three parameters
FRONTIER_BUDGETS = 4  # L*(C) = E + A C^-alpha: three parameters and one residual degree of freedom
ROW_KEYS = ("name", "size", "attention", "seed", "budget", "lr_scale", "non_embedding_params", "tokens",
            "steps", "train_flops", "status", "reason", "val_loss")  # fmt: skip


def budget_label(budget: float) -> str:
    """A budget as point names and tables spell it: 3e13, 1.5e14, 500."""
    mantissa, _, exponent = f"{budget:.3g}".partition("e")
    return mantissa + (f"e{int(exponent)}" if exponent else "")


@dataclass
class Profile:
    """loss = a + b u + c u^2 with u = ln N - centre, and its bootstrap replicates."""

    coef: np.ndarray  # (3,): a, b, c
    replicates: np.ndarray  # (draws, 3); empty when the points leave no residual to resample
    centre: float
    u: np.ndarray  # ln N - centre of the points
    level: float

    def optimum(self, coef: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(N*, L*) of each row of `coef`: inf and -inf where the parabola has no minimum (c <= 0)."""
        a, b, c = coef[..., 0], coef[..., 1], coef[..., 2]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            u_star = np.where(c > 0, -b / (2 * c), np.inf)
            n_star = np.exp(u_star + self.centre)
            l_star = np.where(c > 0, a - b * b / (4 * c), -np.inf)
        return n_star, l_star

    def loss(self, n: Any) -> np.ndarray:
        u = np.log(np.asarray(n, dtype=float)) - self.centre
        return self.coef[0] + self.coef[1] * u + self.coef[2] * u * u

    def why_no_optimum(self) -> str:
        """Why the profile gives no optimum ("" when its minimum lies within its sizes)."""
        (n_star, _), sizes = self.optimum(self.coef), np.exp(self.u + self.centre)
        if not self.coef[2] > 0:
            return "no minimum: the loss does not curve upward in log N at this budget"
        if n_star > sizes.max():
            return f"optimum beyond the largest size ({sizes.max():.3g} non-embedding parameters)"
        if n_star < sizes.min():
            return f"optimum below the smallest size ({sizes.min():.3g} non-embedding parameters)"
        return ""


def fit_profile(n: list[float], loss: list[float], draws: int, level: float, seed: int = 0) -> Profile:
    """The least-squares parabola of `loss` in ln `n` and `draws` residual-bootstrap replicates (none
    with only three points: nothing to resample)."""
    u = np.log(np.asarray(n, dtype=float))
    centre = float(u.mean())
    u = u - centre
    y = np.asarray(loss, dtype=float)
    X = np.stack([np.ones_like(u), u, u * u], axis=1)
    solve = np.linalg.pinv(X)  # (3, n)
    coef = solve @ y
    if len(y) <= 3:
        return Profile(coef, np.empty((0, 3)), centre, u, level)
    leverage = np.clip(np.einsum("ij,ji->i", X, solve), 0.0, 0.99)  # the hat matrix's diagonal
    return Profile(coef, resample(y, X @ coef, leverage, draws, seed) @ solve.T, centre, u, level)


def interval(values: np.ndarray, level: float) -> list[float] | None:
    return list(percentile_interval(values, level)) if len(values) else None


def profile_entry(profile: Profile, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A profile's part of isoflop.json: its parabola, N* and L* with intervals, or why not."""
    why = profile.why_no_optimum()
    a, b, c = (float(v) for v in profile.coef)
    entry: dict[str, Any] = {
        "points": [r["name"] for r in rows],
        "sizes": len({r["non_embedding_params"] for r in rows}),
        "parabola": {"a": a, "b": b, "c": c, "centre_ln_n": profile.centre},
    }
    if why:
        return {**entry, "optimum": None, "reason": why}
    n_star, l_star = profile.optimum(profile.coef)
    reps_n, reps_l = profile.optimum(profile.replicates)
    return {
        **entry,
        "optimum": {"n_star": float(n_star), "l_star": float(l_star)},
        "intervals": {"n_star": interval(reps_n, profile.level), "l_star": interval(reps_l, profile.level)},
        "no_minimum_share": float(np.mean(~np.isfinite(reps_n))) if len(reps_n) else None,
        "reason": "" if len(reps_n) else "3 points for 3 parameters: no interval (add a size or a seed)",
    }


def frontier_entry(cfg: Any, entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One variant's L*(C): the budgets with an optimum, and a power law through them (>= 4) or why not."""
    points = [
        {
            "budget": e["budget"],
            "l_star": e["optimum"]["l_star"],
            "interval": e["intervals"]["l_star"],
            "n_star": e["optimum"]["n_star"],
            "n_star_interval": e["intervals"]["n_star"],
        }
        for e in entries.values()
        if e["optimum"] is not None
    ]
    if len(points) < FRONTIER_BUDGETS:
        why = (
            f"{len(points)} budget(s) with an optimum within their sizes; L*(C) = E + A C^-alpha needs "
            f"{FRONTIER_BUDGETS}: add budgets (or sizes)"
        )
        return {"points": points, "fit": {"error": why}}
    x, y = [p["budget"] for p in points], [p["l_star"] for p in points]
    fit, why = fit_or_reason(x, y, cfg.bootstrap, cfg.level)
    return {"points": points, "fit": fit.to_json() if fit else {"error": why}}


def compare(
    cfg: Any, profiles: dict[str, dict[str, dict[str, Any]]], fits: dict[tuple[str, str], Profile]
) -> dict[str, Any]:
    """Each variant against cfg.reference at equal compute: L*_variant - L*_reference at each budget,
    its interval from replicate b against replicate b (independent runs, so any pairing is fair)."""
    reference = profiles.get(cfg.reference, {})
    out: dict[str, Any] = {}
    for attention, entries in profiles.items():
        if attention == cfg.reference or not reference:
            continue
        at = []
        for label, mine in entries.items():
            theirs = reference[label]
            row: dict[str, Any] = {"budget": mine["budget"]}
            if mine["optimum"] is None or theirs["optimum"] is None:
                row["reason"] = "no optimum within the sizes for both variants at this budget"
            else:
                row["difference"] = mine["optimum"]["l_star"] - theirs["optimum"]["l_star"]
                ours, ref = fits[(attention, label)], fits[(cfg.reference, label)]
                a, b = ours.optimum(ours.replicates)[1], ref.optimum(ref.replicates)[1]  # L* replicates
                draws = min(len(a), len(b))
                with np.errstate(invalid="ignore"):  # both without a minimum: no difference (dropped)
                    diff = a[:draws] - b[:draws]
                row["interval"] = interval(diff[~np.isnan(diff)], cfg.level)
            at.append(row)
        out[attention] = {"reference": cfg.reference, "at": at}
    return out


def analyse(
    cfg: Any, rows: list[dict[str, Any]], floors: dict[str, float] | None
) -> tuple[dict[str, Any], dict[tuple[str, str], Profile]]:
    """isoflop.json's content, and the profiles by (variant, budget label) (for the plots). The
    profiles take each point's best run over the LR scales, finished and off the unigram floor
    (unless cfg.fit_floor_points)."""
    best = marked_best(cfg, rows, floors)
    used = fitted_rows(cfg, best)[0]
    fits: dict[tuple[str, str], Profile] = {}
    profiles: dict[str, dict[str, dict[str, Any]]] = {}
    for attention in dict.fromkeys(cfg.attentions):
        profiles[attention] = {}
        for budget in cfg.isoflop_budgets:
            label = budget_label(budget)
            mine = [r for r in used if r["attention"] == attention and r["budget"] == budget]
            entry: dict[str, Any] = {"budget": budget, "attention": attention}
            if len({r["non_embedding_params"] for r in mine}) < PROFILE_SIZES:
                why = f"{len(mine)} finished point(s) off the floor; a profile needs {PROFILE_SIZES} sizes"
                entry.update(points=[r["name"] for r in mine], optimum=None, reason=why)
            else:
                n, loss = [r["non_embedding_params"] for r in mine], [r["val_loss"] for r in mine]
                fits[(attention, label)] = fit_profile(n, loss, cfg.bootstrap, cfg.level)
                entry.update(profile_entry(fits[(attention, label)], mine))
            profiles[attention][label] = entry
    result = {
        "study": {
            "budgets": cfg.isoflop_budgets,
            "lr_scales": cfg.lr_scales,
            "min_steps": cfg.min_steps,
            "level": cfg.level,
            "reference": cfg.reference,
            "profile": "held-out loss = a + b u + c u^2, u = ln N - centre_ln_n, N non-embedding parameters",
        },
        "floors": floors,
        "at_floor": {
            "margin": cfg.floor_margin,
            "names": [r["name"] for r in best if r.get("at_floor")],
            "left_out": not cfg.fit_floor_points,
        },
        "profiles": profiles,
        "frontier": {a: frontier_entry(cfg, entries) for a, entries in profiles.items()},
        "comparison": compare(cfg, profiles, fits),
        "points": [{k: r.get(k) for k in (*ROW_KEYS, "lr_sweep", "at_floor", "below_unigram")} for r in best],
    }
    return result, fits


def write_isoflop(
    cfg: Any,
    rows: list[dict[str, Any]],
    study: StudyLog | None = None,
    floors: dict[str, float] | None = None,
) -> dict[str, Any]:
    """isoflop.json, isoflop.md, points.csv and plots/{isoflop,frontier}.png under cfg.output_dir
    (`write_answer`; each variant's frontier alpha and E to the study's MLflow run); returns
    isoflop.json's content."""
    result, profiles = analyse(cfg, rows, floors)
    metrics = law_metrics({attention: f["fit"] for attention, f in result["frontier"].items()}, "frontier_")
    draw = functools.partial(plot_isoflop, result, profiles)
    plots = ("isoflop", "frontier")
    return write_answer(cfg, "isoflop", result, markdown(result), rows, study, metrics, draw, plots)


def markdown(result: dict[str, Any]) -> str:
    """isoflop.md: per budget and variant, N*, L* and the difference to the reference at equal
    compute, with intervals; then the frontiers, the floors and the LR sweep's winners."""
    spec, ref = result["study"], result["study"]["reference"]
    diffs = {(a, d["budget"]): d for a, c in result["comparison"].items() for d in c["at"]}
    rows = []
    for attention, entries in result["profiles"].items():
        for label, e in entries.items():
            opt, iv = e["optimum"] or {}, e.get("intervals") or {}
            d = diffs.get((attention, e["budget"]), {})
            optimum = [spelled(opt.get(k), iv.get(k)) for k in ("n_star", "l_star")]
            gap = spelled(d.get("difference"), d.get("interval"))
            note = e.get("reason") or d.get("reason", "")
            rows.append([label, attention, str(e.get("sizes", len(e["points"]))), *optimum, gap, note])
    header = ["budget (FLOPs)", "variant", "sizes", "N*", "L*", f"L* - L*({ref})", "note"]
    title = f"## isoFLOP profiles ({spec['level']:.0%} intervals)"
    lines = [title, "", *markdown_table(header, rows, padded=True), ""]
    lines += [f"- frontier, {a}: {frontier_said(f['fit'])}" for a, f in result["frontier"].items()]
    lines.append(floors_said(result["floors"], result["at_floor"]))
    won = [p["name"] for p in result["points"] if p.get("lr_sweep")]
    if won:
        scales = " ".join(f"{s:g}" for s in spec["lr_scales"])
        lines.append(f"- LR sweep ({scales} x LR(N)), the best scale of each point: {', '.join(won)}")
    return "\n".join(lines) + "\n"


def frontier_said(fit: dict[str, Any]) -> str:
    if "error" in fit:
        return f"not fitted: {fit['error']}"
    alpha, e = spelled(fit["alpha"], fit["intervals"]["alpha"]), spelled(fit["E"], fit["intervals"]["E"])
    why = "" if fit.get("converged") else f" (not converged: {'; '.join(fit.get('why_not_converged', []))})"
    return f"L*(C) = E + A C^-alpha, alpha {alpha}, E {e}{why}"


def floors_said(floors: dict[str, float] | None, at: dict[str, Any]) -> str:
    if floors is None:
        return "- floors: not computed; no point was checked against the unigram floor"
    kept = "kept (--fit-floor-points)" if not at["left_out"] else "left out of the profiles"
    names = f": {', '.join(at['names'])}" if at["names"] else ""
    return (
        f"- floors: unigram {floors['unigram']:.3f}, bigram {floors['bigram']:.3f} nats; {len(at['names'])} "
        f"point(s) within {at['margin']:g} nats of the unigram floor, {kept}{names}"
    )


def plot_isoflop(
    result: dict[str, Any], profiles: dict[tuple[str, str], Profile], folder: Path
) -> list[Path]:
    """plots/isoflop.png: held-out loss against size, one colour per budget, a line style per
    variant, the fitted parabolas and their minima, and the floors; plots/frontier.png: L*(C) per
    variant with its intervals, and the power law when fitted."""
    title = "isoFLOP profiles: a parabola in log N per budget (star: optimum)"
    fig, ax = new_axes(title, "non-embedding parameters", "held-out MLM loss")
    budgets = result["study"]["budgets"]
    cmap = pyplot().get_cmap("viridis")
    for attention, entries in result["profiles"].items():
        marker = "o" if attention == result["study"]["reference"] else "^"
        for label, e in entries.items():
            colour = cmap(budgets.index(e["budget"]) / max(1, len(budgets) - 1))
            mine = [p for p in result["points"] if p["attention"] == attention and p["budget"] == e["budget"]]
            mine = [p for p in mine if p["val_loss"]]
            xs, ys = [p["non_embedding_params"] for p in mine], [p["val_loss"] for p in mine]
            ax.scatter(xs, ys, color=colour, s=16, marker=marker)
            profile = profiles.get((attention, label))
            if profile is None:
                continue
            sizes = np.exp(profile.u + profile.centre)
            grid = np.geomspace(sizes.min() / 1.3, sizes.max() * 1.3, 100)
            style, name = line_style(attention), f"{attention}, C = {label}"
            ax.plot(grid, profile.loss(grid), style, color=colour, label=name)
            if e.get("optimum"):
                ax.plot(e["optimum"]["n_star"], e["optimum"]["l_star"], "*", color=colour, markersize=10)
    floor_lines(ax, result["floors"])
    return [save_plot(fig, ax, folder / "isoflop.png"), plot_frontier(result, folder)]


def plot_frontier(result: dict[str, Any], folder: Path) -> Path:
    """plots/frontier.png: L*(C) per variant with its intervals, and the power law when fitted."""
    title = f"compute-optimal frontier ({result['study']['level']:.0%} intervals)"
    fig, ax = new_axes(title, "training FLOPs", "L*: loss at the optimal size", figsize=(6, 4))
    for attention, frontier in result["frontier"].items():
        pts = frontier["points"]
        if not pts:
            continue
        c = np.array([p["budget"] for p in pts])
        y = np.array([p["l_star"] for p in pts])
        iv = [p["interval"] or [p["l_star"], p["l_star"]] for p in pts]
        err = np.clip(np.array([[y[i] - lo, hi - y[i]] for i, (lo, hi) in enumerate(iv)]).T, 0, 10)
        bars = ax.errorbar(c, y, yerr=err, fmt="o", capsize=3, label=attention)
        fit = frontier["fit"]
        if "alpha" in fit:
            grid = np.geomspace(c.min() / 1.5, c.max() * 1.5, 100)
            curve = fit["E"] + fit["A"] * grid ** -fit["alpha"]
            ax.plot(grid, curve, line_style(attention), color=bars[0].get_color())
    floor_lines(ax, result["floors"])
    return save_plot(fig, ax, folder / "frontier.png", fontsize=8)
