"""The H100 budget script runs, and its arithmetic follows the models' own counts."""

from __future__ import annotations

import json
import runpy

import pytest

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


def _script():
    return runpy.run_path(str(REPO / "benchmarks" / "h100_budget.py"), run_name="budget")


def test_communication_hides_behind_the_backward_after_the_measured_first_reduce(tmp_path):
    """The reduce-scatter hides in the part of the backward left after ZeRO's first gradient reduce
    (compile_overlap.py's figure for the mode); its last bucket and the all-gather do not."""
    script = _script()
    parse, budget = script["parse_args"], script["budget"]
    assert [script["first_reduce_at"](parse(flags)) for flags in ([], ["--eager"], ["--whole-model"])] == [
        0.053,
        0.035,
        0.829,
    ]
    # within one NVLink node the full buckets fit either window: per block and whole model expose the same
    per_block, whole = budget(parse([]), "standard"), budget(parse(["--whole-model"]), "standard")
    assert per_block["step_ms"] == whole["step_ms"] and 0.25 < per_block["hidden"] < 0.5
    # across nodes the whole-model graph's 17% window is too short, the per-block 95% is not
    slow = ["--nvlink-gbps", "25"]
    per_block, whole = budget(parse(slow), "standard"), budget(parse([*slow, "--whole-model"]), "standard")
    assert whole["communication"] > per_block["communication"] and whole["mfu"] < per_block["mfu"]
    # nothing hidden before the first reduce: at 1.0 all but the full buckets' share is exposed
    assert budget(parse([*slow, "--first-reduce-at", "1.0"]), "standard")["hidden"] == pytest.approx(
        0, abs=1e-12
    )
    # the bucket is the DeepSpeed config's: one bucket for every gradient leaves nothing to overlap
    config = tmp_path / "one_bucket.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 10**9}}))
    assert budget(parse(["--ds-config", str(config)]), "standard")["hidden"] == pytest.approx(0, abs=1e-12)
    # a fresh measurement replaces the recorded one
    measured = tmp_path / "overlap.json"
    measured.write_text(json.dumps({mode: {"first_reduce_fraction": 0.5} for mode in ("eager", "per_block")}))
    assert script["first_reduce_at"](parse(["--first-reduce-json", str(measured)])) == 0.5
