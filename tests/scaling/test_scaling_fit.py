"""Power-law fits of the quality scaling study against synthetic points whose truth is known."""

from __future__ import annotations

import numpy as np
import pytest

from swbert.scaling.fit import FitError, equivalent_size, fit_power_law

TRUTH = {"E": 2.0, "A": 100.0, "alpha": 0.3}
SIZES = np.repeat(np.geomspace(1e5, 1e8, 6), 2)  # six sizes, two seeds each


def _points(rng: np.random.Generator, sigma: float, x: np.ndarray = SIZES) -> np.ndarray:
    return TRUTH["E"] + TRUTH["A"] * x ** -TRUTH["alpha"] + rng.normal(0, sigma, len(x))


def test_recovers_a_known_exponent_and_offset_from_noisy_points():
    """Stated tolerance: with noise of 0.01 nats (about 0.3% of the loss) the exponent within
    0.01 and the floor within 0.05 nats, and the intervals hold the truth."""
    fit = fit_power_law(SIZES, _points(np.random.default_rng(0), 0.01), draws=500)
    assert fit.converged
    assert fit.law.alpha == pytest.approx(TRUTH["alpha"], abs=0.01)
    assert fit.law.E == pytest.approx(TRUTH["E"], abs=0.05)
    assert fit.law.A == pytest.approx(TRUTH["A"], rel=0.3)
    for name, value in TRUTH.items():
        lo, hi = fit.intervals[name]
        assert lo <= value <= hi and np.isfinite([lo, hi]).all()


def test_intervals_cover_the_truth_at_about_their_nominal_rate():
    """90% intervals over 200 independent draws: the coverage binomial's sd is 0.021, so a
    rate in [0.83, 0.96] is the nominal one within about 3 sd (a naive percentile bootstrap of
    these 12 points covers about 0.85; with four points, about 0.68)."""
    rng = np.random.default_rng(1)
    hits = dict.fromkeys(TRUTH, 0)
    draws = 200
    for i in range(draws):
        fit = fit_power_law(SIZES, _points(rng, 0.02), draws=300, level=0.9, seed=i)
        for name, value in TRUTH.items():
            lo, hi = fit.intervals[name]
            hits[name] += lo <= value <= hi
    for name, n in hits.items():
        assert 0.83 <= n / draws <= 0.96, (name, n / draws)


def test_a_ladder_with_too_few_points_is_refused_with_what_to_add():
    with pytest.raises(FitError, match=r"2 point\(s\) at 2 distinct size\(s\).*at least 4 points at 3"):
        fit_power_law([1e5, 1e6], [3.0, 2.5])
    with pytest.raises(FitError, match="3 point"):  # three sizes but no residual left for the bootstrap
        fit_power_law([1e5, 1e6, 1e7], [3.0, 2.5, 2.2])
    with pytest.raises(FitError, match="does not fall with size"):
        fit_power_law([1e5, 1e6, 1e7, 1e8], [2.0, 2.5, 3.0, 3.5])


def test_equivalent_size_recovers_a_known_parameter_efficiency_ratio():
    """A variant whose curve is the reference's at 1.25x the size is worth 1.25x its parameters
    at every size, measured or extrapolated."""
    rng = np.random.default_rng(3)
    reference = fit_power_law(SIZES, _points(rng, 0.005), draws=400)
    shifted = TRUTH["E"] + TRUTH["A"] * (1.25 * SIZES) ** -TRUTH["alpha"] + rng.normal(0, 0.005, len(SIZES))
    target = fit_power_law(SIZES, shifted, draws=400, seed=1)
    result = equivalent_size(target, reference, [1e6, 1e9])
    for at in result["at"]:
        lo, hi = at["ratio_interval"]
        assert at["ratio"] == pytest.approx(1.25, rel=0.1)
        assert lo <= 1.25 <= hi
        assert at["equivalent"] == pytest.approx(at["ratio"] * at["size"])
