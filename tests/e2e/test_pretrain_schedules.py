"""The schedules of a run end to end (ours, not the paper's): a WSD learning rate, a masking rate
going from 0.30 to 0.15 and a batch-size warm-up, in real 2-rank jobs on gloo with the tiny model.

`unbroken` runs them for 10 steps without a break: the reference both tests compare with, step for
step and bit for bit (every logged loss, gradient norm and LR).
"""

from __future__ import annotations

import pytest

from swbert.runtime.optim import lr_factor
from tests.e2e.test_pretrain import check_ok, tiny_args
from tests.launch_utils import job_env, launch, read_metrics

STEPS = 10
# WSD with warm-up 2 and decay fraction 0.5: the peak over steps 2-4, the decay from step 5 on;
# masks at 0.30 at step 0 down to 0.15 at step 9; global batch 8 at step 0 (2 micro-batches of 2
# on each of the 2 ranks), 16 from step 1 on (4 micro-batches each)
SCHEDULES = [
    "--lr-schedule", "wsd", "--lr-decay-fraction", "0.5", "--warmup-steps", "2",
    "--mlm-probability", "0.3", "--mlm-probability-final", "0.15",
    "--global-batch-size", "16", "--micro-batch-size", "2",
    "--batch-size-warmup-steps", "1", "--batch-size-start", "8",
]  # fmt: skip
COMMON = ["--log-interval", "1", "--eval-interval", "1000", "--export", "false", "--keep-checkpoints", "1"]


def run_args(data_dir, out, *extra: str) -> list[str]:
    return tiny_args(data_dir, out, *SCHEDULES, *COMMON, *extra)


@pytest.fixture(scope="module")
def unbroken(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("unbroken")
    check_ok(launch(2, run_args(data_dir, out, "--train-steps", str(STEPS), "--save-interval", "100")))
    return read_metrics(out)


def assert_same_steps(got: dict[int, dict], want: dict[int, dict], steps: range) -> None:
    for step in steps:
        for key in ("loss", "grad_norm", "lr", "tokens_seen"):
            assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])


@pytest.mark.slow
def test_a_run_resumed_across_the_stable_to_decay_boundary_repeats_the_unbroken_one(
    unbroken, data_dir, tmp_path
):
    """Saved at step 3 (stable LR), killed after step 4, resumed: steps 4-10 cross the start of the
    decay (step 5) and repeat the unbroken run's losses exactly, masks at each step's rate included."""
    factor = lr_factor(STEPS, 2, "wsd", 0.0, 0.5)
    assert [unbroken[s]["lr"] for s in range(1, STEPS + 1)] == pytest.approx(
        [2e-3 * factor(s) for s in range(1, STEPS + 1)], rel=1e-12
    )  # the LR of the next step: the peak for steps 2-4, the decay from step 5
    assert unbroken[1]["tokens_seen"] == 8 * 64 and unbroken[2]["tokens_seen"] == 24 * 64  # 8, then 16
    out = tmp_path / "cut"
    args = run_args(data_dir, out, "--train-steps", str(STEPS), "--save-interval", "3")
    killed = launch(2, args, env=job_env(SWBERT_FAULT_KILL="after_step:4"))
    assert killed.returncode != 0 and max(read_metrics(out)) == 4
    resumed = launch(2, [*args, "--resume", "auto"])
    check_ok(resumed)
    assert "resumed from" in resumed.stdout and "step_00000003" in resumed.stdout
    assert_same_steps(read_metrics(out), unbroken, range(4, STEPS + 1))


@pytest.mark.slow
def test_the_batch_warm_up_equals_a_smaller_batch_then_the_full_one(unbroken, data_dir, tmp_path):
    """Step 0 of the warm-up (8 sequences: 2 of DeepSpeed's 4 configured micro-batches, the loss
    the mean over 2) equals a 1-step run of global batch 8; resumed with global batch 16, the rest
    equals the warm-up run exactly: the same gradients (their norm), updates, stream positions and
    masks (each sample's step, through the resume's anchor)."""
    out = tmp_path / "two-batches"
    small = ["--global-batch-size", "8", "--batch-size-warmup-steps", "0", "--save-interval", "100"]
    check_ok(launch(2, run_args(data_dir, out, "--train-steps", "1", *small)))
    assert_same_steps(read_metrics(out), unbroken, range(1, 2))
    allow = "global_batch_size,batch_size_warmup_steps,batch_size_start"
    resumed = run_args(data_dir, out, "--train-steps", str(STEPS), "--save-interval", "100")
    check_ok(launch(2, [*resumed, "--resume", "auto", "--allow-resume-change", allow]))
    assert_same_steps(read_metrics(out), unbroken, range(2, STEPS + 1))
