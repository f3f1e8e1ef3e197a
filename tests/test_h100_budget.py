"""The H100 budget script runs, and its arithmetic follows the models' own counts."""

from __future__ import annotations

import runpy

from tests.launch_utils import REPO


def test_budget_follows_the_flop_counts(capsys):
    script = runpy.run_path(str(REPO / "benchmarks" / "h100_budget.py"), run_name="budget")
    args = script["parse_args"]([])
    standard, shared = script["budget"](args, "standard"), script["budget"](args, "shared")
    assert 0 < shared["mfu"] < standard["mfu"] < 1  # the same elementwise work over fewer FLOPs
    assert shared["samples_per_s"] > standard["samples_per_s"]
    # the GEMM time scales with the projection weights: 20 d^2 against 24 d^2 per token and layer
    assert abs(standard["gemm"] / shared["gemm"] - 24 / 20) < 1e-9
    eager = script["budget"](script["parse_args"](["--eager"]), "standard")
    assert eager["elementwise"] == 2 * standard["elementwise"] and eager["mfu"] < standard["mfu"]
    slow_loader = script["budget"](script["parse_args"](["--loader-samples-per-s", "1000"]), "standard")
    assert slow_loader["samples_per_s"] > 1000 and slow_loader["step_ms"] == 256 / 1000 * 1e3
    script["main"]([])
    assert capsys.readouterr().out.count("%") >= 4 * 2  # a row per variant with its MFU
