"""Honest fits: `converged` is false, with its reasons, when the exponent or its interval reaches the
searched range or the floor E is negative; the residual error is reported against the spread of
seeds at one size, with a warning when it is more than RESIDUAL_WARN_RATIO times larger (ours)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from torch.testing import assert_close

from swbert.scaling.fit import ALPHAS, RESIDUAL_WARN_RATIO, fit_power_law, seed_spread

SIZES = np.repeat(np.geomspace(1e5, 1e8, 6), 2)  # six sizes, two seeds each


def law(x: np.ndarray, E: float = 2.0, A: float = 100.0, alpha: float = 0.3) -> np.ndarray:
    return E + A * x**-alpha


def test_a_well_determined_fit_converges_with_no_reason():
    fit = fit_power_law(SIZES, law(SIZES) + np.random.default_rng(0).normal(0, 0.01, len(SIZES)), draws=300)
    out = fit.to_json()
    assert out["converged"] and out["why_not_converged"] == []
    lo, hi = fit.intervals["alpha"]
    assert ALPHAS[1] < lo < hi < ALPHAS[-2] and fit.law.E > 0  # the criteria, checked by hand
    json.dumps(out)  # plain JSON


def test_alpha_at_the_grid_edge_and_a_negative_floor_are_not_converged():
    """A loss falling as a straight line in log x: the best exponent is the smallest searched, E is
    hugely negative, and the interval reaches the range; each is one plain-sentence reason."""
    y = 5 - 0.1 * np.log(SIZES) + np.random.default_rng(0).normal(0, 0.005, len(SIZES))
    fit = fit_power_law(SIZES, y, draws=300)
    assert fit.law.alpha == ALPHAS[0] and fit.law.E < 0
    reasons = fit.to_json()["why_not_converged"]
    assert not fit.converged and not fit.to_json()["converged"]
    assert len(reasons) == 3
    assert "is at an end of the searched range [0.001, 4]" in reasons[0]
    assert "interval" in reasons[1] and "reaches the searched range" in reasons[1]
    assert f"E = {fit.law.E:.3g} is negative" in reasons[2]


def test_a_negative_floor_alone_is_not_converged():
    y = law(SIZES, E=-1.0, A=10.0) + np.random.default_rng(1).normal(0, 0.005, len(SIZES))
    fit = fit_power_law(SIZES, y, draws=300)
    assert fit.law.E < 0 and ALPHAS[1] < fit.intervals["alpha"][0] < fit.intervals["alpha"][1] < ALPHAS[-2]
    assert not fit.converged
    (reason,) = fit.why_not_converged
    assert "is negative" in reason


@pytest.mark.parametrize("seed", [0, 3])
def test_an_interval_reaching_the_searched_range_is_not_converged(seed):
    """Four noisy points: the best exponent is inside the range but its interval is not bounded by
    the data (it reaches the end of the search)."""
    x = np.geomspace(1e5, 1e7, 4)
    fit = fit_power_law(x, law(x, E=3.0, A=40.0) + np.random.default_rng(seed).normal(0, 0.05, 4), draws=300)
    lo, hi = fit.intervals["alpha"]
    assert ALPHAS[0] < fit.law.alpha < ALPHAS[-1] and fit.law.E > 0
    assert lo <= ALPHAS[1] or hi >= ALPHAS[-2]
    assert not fit.converged
    (reason,) = fit.why_not_converged
    assert f"the alpha interval [{lo:.3g}, {hi:.3g}] reaches the searched range" in reason


def test_seed_spread_is_the_pooled_within_size_standard_deviation():
    rng = np.random.default_rng(2)
    x = np.array([1.0, 1.0, 1.0, 2.0, 2.0, 3.0])  # three seeds, two seeds, one seed
    y = rng.normal(size=6)
    groups = [y[:3], y[3:5]]
    pooled = np.sqrt(sum(np.var(g, ddof=1) * (len(g) - 1) for g in groups) / (2 + 1))
    assert_close(seed_spread(x, y), float(pooled))
    assert seed_spread(np.array([1.0, 2.0, 3.0]), y[:3]) is None  # no size with two seeds


def test_rmse_against_the_seed_spread_and_its_warning():
    """Seeds 0.002 apart, and a curve missing one size by 0.1: the rmse is far above the seed spread
    and warned about; the same curve with seeds as spread as its misfit is not."""
    bump = np.where(SIZES == SIZES[4], 0.1, 0.0)
    seeds = np.tile([0.001, -0.001], 6)
    fit = fit_power_law(SIZES, law(SIZES) + bump + seeds, draws=200)
    out = fit.to_json()
    rmse = np.sqrt(np.mean((fit.law.loss(SIZES) - fit.y) ** 2))
    assert_close(out["rmse"], float(rmse))
    assert_close(out["seed_sd"], 0.002 / np.sqrt(2))
    assert_close(out["rmse_over_seed_sd"], float(rmse / (0.002 / np.sqrt(2))))
    assert out["rmse_over_seed_sd"] > RESIDUAL_WARN_RATIO
    (warning,) = out["warnings"]
    assert f"{out['rmse_over_seed_sd']:.1f}x the spread of seeds" in warning
    noisy = fit_power_law(SIZES, law(SIZES) + bump + 50 * seeds, draws=200).to_json()
    assert noisy["rmse_over_seed_sd"] < RESIDUAL_WARN_RATIO and noisy["warnings"] == []
    one_seed = fit_power_law(SIZES[::2], law(SIZES[::2]) + bump[::2], draws=200).to_json()
    assert (
        one_seed["seed_sd"] is None and one_seed["rmse_over_seed_sd"] is None and one_seed["warnings"] == []
    )
