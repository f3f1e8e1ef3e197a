"""The GPU's default engine, compiled, through the real launcher on CPU (inductor, CPU kernels off):
every ZeRO stage trains, equals eager (with activation checkpointing too), and resumes exactly;
tensor parallelism with sequence parallelism trains like TP=1.

Tolerances: compiled and eager differ by float32 rounding only (inductor fuses and reorders), so
over 10 steps the losses agree within 1e-3 relative (measured: under 1e-7). A compiled run
against itself (golden file, resume) is bit for bit on the machine that made the golden file.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.golden import ASSETS, check_golden
from tests.launch_utils import job_env, launch, read_metrics

STEPS, SAVE, KILL = 10, 5, 7
EAGER_RTOL = 1e-3


def _args(data_dir, out, *extra: str) -> list[str]:
    return [
        "--config", "tiny_cpu", "--data-dir", str(data_dir), "--output-dir", str(out), "--mlflow", "false",
        "--train-steps", str(STEPS), "--log-interval", "1", "--save-interval", str(SAVE),
        "--eval-interval", "1000", "--export", "false", *extra,
    ]  # fmt: skip


def _ok(result) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


def _close(got: dict[int, dict], want: dict[int, dict], steps: range, rtol: float) -> None:
    for step in steps:
        a, b = got[step]["loss"], want[step]["loss"]
        assert math.isclose(a, b, rel_tol=rtol), f"step {step}: {a} vs {b} (rtol {rtol})"


def _eager_tp1() -> dict[int, dict]:
    """The eager reference: the golden losses of the single-process run of the same recipe, eager
    with the CPU kernels off (tests/parallel/test_parallel_pretrain.py runs it and holds it to this file). Data parallelism, ZeRO and
    tensor parallelism all see the same global batches, so every engine's losses equal these up to
    float rounding, and a compiled run must stay within EAGER_RTOL of them."""
    tp1 = json.loads((ASSETS / "tiny_cpu-tp1-zero2-1rank.json").read_text())["loss"]
    return {int(s): {"loss": v} for s, v in tp1.items()}


@pytest.mark.golden
@pytest.mark.parametrize(
    "stage", [pytest.param(1, marks=pytest.mark.long), pytest.param(2, marks=pytest.mark.long), 3]
)
@pytest.mark.slow
def test_compiled_zero_stage_trains_and_resumes_exactly(stage, data_dir, tmp_path):
    """Killed (kill -9) after step 7 with a checkpoint at 5, then resumed: steps 6 and 7 are logged
    twice and must be equal bit for bit, and all 10 steps match the compiled golden file. Under
    ZeRO-3 (parameters gathered per block, the failing case before) the losses agree with the eager
    single-process run's within 1e-3 relative."""
    args = ["--deepspeed-config", f"ds_configs/zero{stage}.json", "--compile", "on"]
    run = tmp_path / "run"
    killed = launch(2, _args(data_dir, run, *args), env=job_env(SWBERT_FAULT_KILL=f"after_step:{KILL}"))
    assert killed.returncode != 0
    assert "wrap 3/4: compiled per unit (2 blocks, MLM head)" in killed.stderr
    first = read_metrics(run)
    assert max(first) == KILL
    resumed = launch(2, _args(data_dir, run, *args, "--resume", "auto"))
    _ok(resumed)
    after = read_metrics(run)  # the resumed run's records follow the killed run's in the file
    for step in range(SAVE + 1, KILL + 1):
        assert after[step]["loss"] == first[step]["loss"], (step, first[step]["loss"], after[step]["loss"])
    metrics = {**first, **after}
    assert sorted(metrics) == list(range(1, STEPS + 1))
    check_golden(f"tiny_cpu-zero{stage}-2ranks-compiled", metrics)
    if stage == 3:
        _close(metrics, _eager_tp1(), range(1, STEPS + 1), EAGER_RTOL)


@pytest.mark.slow
@pytest.mark.golden
def test_compiled_tensor_parallel_with_sequence_parallelism_trains_like_tp1(data_dir, tmp_path):
    """TP=2 with sequence parallelism, compiled (no graph break), against the eager TP=1 golden run
    of tests/parallel/test_parallel_pretrain.py: the same global batches."""
    out = tmp_path / "tp2"
    args = [
        "--tensor-parallel",
        "2",
        "--sequence-parallel",
        "true",
        "--deepspeed-config",
        "ds_configs/zero1.json",
    ]
    result = launch(2, _args(data_dir, out, *args, "--compile", "on"), env=job_env(TORCH_LOGS="graph_breaks"))
    _ok(result)
    assert "wrap 1/4: tensor parallel 2 with sequence parallelism" in result.stderr
    assert "Graph break" not in result.stderr, result.stderr[-5000:]
    metrics = read_metrics(out)
    check_golden("tiny_cpu-tp2-sp-zero1-2ranks-compiled", metrics)
    _close(metrics, _eager_tp1(), range(1, STEPS + 1), EAGER_RTOL)
