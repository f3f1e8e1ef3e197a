"""Power-law fits of held-out loss, L(x) = E + A x^-alpha, with bootstrap intervals (docs/scaling.md,
"Fits"). x is a size (non-embedding parameters) or training compute (FLOPs). For a fixed alpha the
best E and A are a linear least-squares solution in closed form, so the fit is a one-dimensional
search over alpha, run for every bootstrap replicate at once as matrix products (ours)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MIN_SIZES = 3  # three parameters: E, A, alpha
MIN_POINTS = 4  # at least one residual degree of freedom, for the bootstrap's residuals
ALPHAS = np.geomspace(1e-3, 4.0, 512)  # the exponents searched; one at either end: not converged
_RANGE = f"[{ALPHAS[0]:g}, {ALPHAS[-1]:g}]"
# A fit whose residual error is more than this many times the spread of repeated seeds at one size
# misses something the seeds do not explain (a curve of the wrong shape, points at a floor): warned (ours).
RESIDUAL_WARN_RATIO = 3.0


class FitError(ValueError):
    """The points cannot determine the curve (too few, or the loss does not fall with x)."""


@dataclass(frozen=True)
class PowerLaw:
    """L(x) = E + A x^-alpha: one law, or (`of`) one per bootstrap replicate, as columns."""

    E: Any
    A: Any
    alpha: Any

    @classmethod
    def of(cls, replicates: np.ndarray) -> PowerLaw:
        """Each row's law (E, A, alpha), as (draws, 1) columns that broadcast against a row of x."""
        return cls(replicates[:, :1], replicates[:, 1:2], replicates[:, 2:3])

    def loss(self, x: Any) -> Any:
        return self.E + self.A * np.asarray(x, dtype=float) ** -self.alpha

    def reach(self, loss: Any) -> np.ndarray:
        """The x at which the curve reaches `loss`; inf where it never does (loss at or below E)."""
        gap = np.asarray(loss, dtype=float) - self.E
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            out = (self.A / gap) ** (1.0 / self.alpha)
        return np.where(gap > 0, out, np.inf)


@dataclass
class Fit:
    """A fitted power law, its bootstrap replicates and percentile intervals at `level`."""

    law: PowerLaw
    replicates: np.ndarray  # (draws, 3): E, A, alpha of each bootstrap replicate
    level: float
    x: np.ndarray
    y: np.ndarray
    best_at_edge: bool  # the best exponent lies at an end of the searched range
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    rmse: float = field(init=False)  # of the fitted curve at the points
    seed_sd: float | None = field(init=False)  # the spread of seeds at one size (`seed_spread`)

    def __post_init__(self) -> None:
        for i, name in enumerate(("E", "A", "alpha")):
            self.intervals[name] = percentile_interval(self.replicates[:, i], self.level)
        self.rmse = float(np.sqrt(np.mean((self.law.loss(self.x) - self.y) ** 2)))
        self.seed_sd = seed_spread(self.x, self.y)

    @property
    def why_not_converged(self) -> list[str]:
        """Why the numbers should not be read (empty: converged): the best exponent or its interval
        at the searched range's end, or a negative floor E (these criteria are ours)."""
        reasons = []
        if self.best_at_edge:
            reasons.append(
                f"the best exponent alpha = {self.law.alpha:.3g} is at an end of the searched range {_RANGE}"
            )
        lo, hi = self.intervals["alpha"]
        if lo <= ALPHAS[1] or hi >= ALPHAS[-2]:  # within one grid step of an end
            reasons.append(f"the alpha interval [{lo:.3g}, {hi:.3g}] reaches the searched range {_RANGE}")
        if self.law.E < 0:
            reasons.append(f"the fitted floor E = {self.law.E:.3g} is negative: no loss falls below zero")
        return reasons

    @property
    def converged(self) -> bool:
        return not self.why_not_converged

    @property
    def warnings(self) -> list[str]:
        """The residual error against the seed spread, when it is more than RESIDUAL_WARN_RATIO x."""
        sd = self.seed_sd
        if not sd or self.rmse <= RESIDUAL_WARN_RATIO * sd:
            return []
        return [
            f"the residual error (rmse {self.rmse:.3g}) is {self.rmse / sd:.1f}x the spread of seeds at "
            f"one size ({sd:.3g}), more than {RESIDUAL_WARN_RATIO:g}x: the curve misses more than seed noise"
        ]

    def band(self, x: Any) -> tuple[np.ndarray, np.ndarray]:
        """The pointwise interval of the fitted curve at `x`, from the replicates."""
        curves = PowerLaw.of(self.replicates).loss(np.asarray(x, dtype=float)[None, :])  # (draws, len(x))
        tail = (1 - self.level) / 2 * 100
        return np.percentile(curves, tail, axis=0), np.percentile(curves, 100 - tail, axis=0)

    def to_json(self) -> dict[str, Any]:
        law, sd = self.law, self.seed_sd
        return {
            "E": law.E,
            "A": law.A,
            "alpha": law.alpha,
            "intervals": {k: list(v) for k, v in self.intervals.items()},
            "level": self.level,
            "bootstrap_draws": int(len(self.replicates)),
            "converged": self.converged,
            "why_not_converged": self.why_not_converged,
            "rmse": self.rmse,
            "seed_sd": sd,
            "rmse_over_seed_sd": self.rmse / sd if sd else None,
            "warnings": self.warnings,
        }


def seed_spread(x: np.ndarray, y: np.ndarray) -> float | None:
    """The pooled within-size standard deviation of `y`: repeated seeds at the same `x` (None
    when no size has two)."""
    _, which, counts = np.unique(x, return_inverse=True, return_counts=True)
    dof = int(np.sum(counts - 1))
    if dof == 0:
        return None
    means = np.bincount(which, weights=y) / counts
    return float(np.sqrt(np.sum((y - means[which]) ** 2) / dof))


def percentile_interval(values: np.ndarray, level: float) -> tuple[float, float]:
    """The central `level` range of `values` (inf allowed: sorted, not interpolated, so an
    interval reaching an infinite replicate says inf rather than nan)."""
    v = np.sort(np.asarray(values, dtype=float))
    tail = (1 - level) / 2
    lo = int(np.floor(tail * (len(v) - 1)))
    hi = int(np.ceil((1 - tail) * (len(v) - 1)))
    return float(v[lo]), float(v[hi])


def _profile(xs: np.ndarray, Y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Best (E, A', alpha, at_edge) of each row of `Y` against scaled sizes `xs` (A' is for xs).

    For each alpha on the grid the closed-form least squares of y on [1, xs^-alpha] gives the
    residual sum of squares; A' <= 0 is ruled out; a parabola in log alpha through the best grid
    point and its neighbours refines the exponent."""
    Z = xs[None, :] ** -ALPHAS[:, None]  # (G, n)
    Zc = Z - Z.mean(axis=1, keepdims=True)
    Yc = Y - Y.mean(axis=1, keepdims=True)  # (B, n)
    cov = Zc @ Yc.T  # (G, B)
    var = (Zc**2).sum(axis=1)[:, None]
    sse = (Yc**2).sum(axis=1)[None, :] - cov**2 / var
    sse = np.where(cov > 0, sse, np.inf)
    best = np.argmin(sse, axis=0)  # (B,)
    cols = np.arange(Y.shape[0])
    at_edge = (best == 0) | (best == len(ALPHAS) - 1) | ~np.isfinite(sse[best, cols])
    u = np.log(ALPHAS)
    step = u[1] - u[0]
    inner = np.clip(best, 1, len(ALPHAS) - 2)
    s0, s1, s2 = sse[inner - 1, cols], sse[inner, cols], sse[inner + 1, cols]
    with np.errstate(invalid="ignore", divide="ignore"):
        offset = 0.5 * (s0 - s2) / (s0 - 2 * s1 + s2)
    offset = np.where(np.isfinite(offset) & ~at_edge, np.clip(offset, -1, 1), 0.0)
    alpha = np.exp(u[inner] + offset * step)
    alpha = np.where(at_edge, ALPHAS[best], alpha)
    z = xs[None, :] ** -alpha[:, None]  # (B, n)
    zc = z - z.mean(axis=1, keepdims=True)
    a = (zc * Yc).sum(axis=1) / (zc**2).sum(axis=1)
    a = np.where(np.isfinite(sse[best, cols]), a, 0.0)  # no falling curve at all: the flat one, A = 0
    e = Y.mean(axis=1) - a * z.mean(axis=1)
    return e, a, alpha, at_edge


def _leverage(xs: np.ndarray, a: float, alpha: float) -> np.ndarray:
    """Each point's leverage in the linearised fit: residuals shrink by sqrt(1 - h) on average, so
    the bootstrap divides them by it (Davison and Hinkley, 1997, eq. 6.9), capped below 1."""
    z = xs**-alpha
    J = np.stack([np.ones_like(xs), z, -a * z * np.log(xs)], axis=1)  # d/d(E, A', alpha)
    h = np.einsum("ij,jk,ik->i", J, np.linalg.pinv(J.T @ J), J)
    return np.clip(h, 0.0, 0.99)


def resample(y: np.ndarray, fitted: np.ndarray, leverage: np.ndarray, draws: int, seed: int) -> np.ndarray:
    """(draws, n) replicate losses for a residual bootstrap of a three-parameter fit: the fitted
    values plus resampled residuals, widened for their leverage and centred, scaled by a draw of the
    noise level's own spread."""
    n = len(y)
    residuals = (y - fitted) / np.sqrt(1 - leverage)
    residuals -= residuals.mean()
    rng = np.random.default_rng(seed)
    noise = np.sqrt((n - 3) / rng.chisquare(n - 3, size=(draws, 1)))
    return fitted[None, :] + noise * residuals[rng.integers(0, n, size=(draws, n))]


def fit_power_law(
    x: Sequence[float], y: Sequence[float], draws: int = 1000, level: float = 0.95, seed: int = 0
) -> Fit:
    """Fit L = E + A x^-alpha to the points and bootstrap `draws` replicates (see the module doc);
    FitError unless the points can determine the curve."""
    x_arr, y_arr = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x_arr) != len(y_arr):
        raise FitError(f"the fit: {len(x_arr)} sizes but {len(y_arr)} losses")
    if not (np.all(np.isfinite(x_arr)) and np.all(x_arr > 0) and np.all(np.isfinite(y_arr))):
        raise FitError("the fit: sizes must be positive and losses finite")
    distinct = len(np.unique(x_arr))
    if distinct < MIN_SIZES or len(x_arr) < MIN_POINTS:
        raise FitError(
            f"the fit: {len(x_arr)} point(s) at {distinct} distinct size(s); L = E + A x^-alpha needs at "
            f"least {MIN_POINTS} points at {MIN_SIZES} or more sizes: add sizes (or seeds)"
        )
    scale = float(np.exp(np.mean(np.log(x_arr))))  # sizes near 1 keep x^-alpha well conditioned
    xs = x_arr / scale
    e, a, alpha, edge = _profile(xs, y_arr[None, :])
    if not np.isfinite(e[0]) or a[0] <= 0:
        raise FitError("the fit: the loss does not fall with size at these points; no power law fits")
    law = PowerLaw(float(e[0]), float(a[0] * scale ** alpha[0]), float(alpha[0]))
    fitted = e[0] + a[0] * xs ** -alpha[0]
    be, ba, balpha, _ = _profile(xs, resample(y_arr, fitted, _leverage(xs, a[0], alpha[0]), draws, seed))
    replicates = np.stack([be, ba * scale**balpha, balpha], axis=1)
    return Fit(law, replicates, level, x_arr, y_arr, best_at_edge=bool(edge[0]))


def equivalent_size(target: Fit, reference: Fit, x: Any) -> dict[str, Any]:
    """The reference-variant size that reaches the target variant's loss at size `x`, with its
    interval: target replicate b against reference replicate b (independent experiments, so any
    pairing is fair). Returns the equivalent size and the ratio (equivalent / x), each with its
    interval; inf where the reference curve never gets that low (its floor E is above the loss)."""
    x_arr = np.atleast_1d(np.asarray(x, dtype=float))
    point = reference.law.reach(target.law.loss(x_arr))
    draws = min(len(target.replicates), len(reference.replicates))
    losses = PowerLaw.of(target.replicates[:draws]).loss(x_arr[None, :])
    rep = PowerLaw.of(reference.replicates[:draws]).reach(losses)  # (draws, k)
    out = []
    for j, size in enumerate(x_arr):
        lo, hi = percentile_interval(rep[:, j], target.level)
        out.append({
            "size": float(size),
            "equivalent": float(point[j]),
            "equivalent_interval": [lo, hi],
            "ratio": float(point[j] / size),
            "ratio_interval": [lo / size, hi / size],
            "unreached_share": float(np.mean(~np.isfinite(rep[:, j]))),
        })  # fmt: skip
    return {"level": target.level, "at": out}


def fit_or_reason(x: Sequence[float], y: Sequence[float], draws: int, level: float) -> tuple[Fit | None, str]:
    """`fit_power_law` of the points, or None and why no curve could be fitted."""
    try:
        return fit_power_law(x, y, draws=draws, level=level), ""
    except FitError as err:
        return None, str(err)
