"""Host syncs per optimizer step, counted on the real engine path and held to a budget.

A 2-rank bf16 pretraining job on gloo (ZeRO-2 and ZeRO-3, gradient accumulation 2) runs under
tests/scripts/count_syncs.py, which counts every call that makes a GPU's host wait for the device:
tensor reads (`item`, `tolist`, `__bool__`, `__float__`, `__int__`, `__index__`, `cpu`, `numpy`),
device synchronisation (`torch.cuda.synchronize`, DeepSpeed's `get_accelerator().synchronize`)
and `torch.tensor(..., device=...)` (a copy of host data, which on a GPU waits for the queue).
The optimizer is the one `--optimizer auto` picks on a GPU.

The budget per step, by who makes the call:
- swbert: one (`Trainer._agree`: the stop flag and the non-finite check, read together); a logging
  step adds one (the window's counts and the gradient norm), an evaluation one more.
- DeepSpeed: the calls its config cannot remove, each listed below by function, per step and rank
  (docs/performance.md, "Host syncs per step", says why each is there). The first step is
  DeepSpeed's warm-up and is held to swbert's budget only: ZeRO-3 records the order parameters
  are used in and checks it against every rank's, one read per module.

Excluded, as host memory on a GPU too: calls made inside torch's DataLoader (the base seed it draws
on the host when its workers start) and on its pin-memory thread (a GPU's loader pins its batches).
Everything else counts, on every thread (on a GPU the backward runs on autograd's device thread).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tests.launch_utils import job_env, launch
from tests.scripts.count_syncs import on_pin_memory_thread

STEPS, LOG_EVERY = 6, 3
SWBERT = Counter({"tolist@_agree": 1})
LOGGED = Counter({"tolist@reduce_counts<-record": 1})
EVALUATED = Counter({"tolist@reduce_counts<-_evaluate_folder": 1})  # one per data folder
DEEPSPEED = {
    # swbert's flat ZeRO-2 gradients (swbert.runtime.flat_grads): the overflow agreed in `_agree`, the
    # norm and clipping on the device, no hook or epilogue of DeepSpeed's (whose overlap_comm branch
    # synchronises after every backward on a GPU) left to run. DeepSpeed's own ZeRO-1/2 path makes 6:
    # has_overflow's item, is_invalid_grad_norm in step and per group in clipping, and the norm's
    # mask per group (docs/performance.md).
    2: Counter(),
    3: Counter(
        {
            "host_to_device@get_grad_norm_direct<-_get_norm_groups": 2,  # per parameter group
            "__bool__@is_invalid_grad_norm<-step": 1,
        }
    ),
}


def _owner(stack: list[str]) -> tuple[str, str] | None:
    """(who, call) for one counted call: the innermost frame of swbert or DeepSpeed and its caller;
    None for a call on host memory (inside torch's DataLoader)."""
    if any(frame.startswith("torch/utils/data/") for frame in stack):
        return None
    frames = [f for f in reversed(stack) if not f.startswith(("torch/", "deepspeed/utils/nvtx.py"))]
    who = frames[0].split("/", 1)[0]
    assert who in ("swbert", "deepspeed"), f"a sync from outside swbert and DeepSpeed: {stack}"
    name, caller = frames[0].rsplit(":", 1)[1], frames[1].rsplit(":", 1)[1]
    return who, f"{name}<-{caller}" if who == "deepspeed" or name == "reduce_counts" else name


def _count(calls: list[dict]) -> dict[str, Counter]:
    counts: dict[str, Counter] = {"swbert": Counter(), "deepspeed": Counter()}
    for call in calls:
        if on_pin_memory_thread(call):
            continue
        owner = _owner(call["stack"])
        if owner is not None:
            counts[owner[0]][f"{call['kind']}@{owner[1]}"] += 1
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.long)])
def test_host_syncs_per_step_stay_within_the_budget(stage, data_dir, tmp_path):
    out, syncs = tmp_path / "run", tmp_path / "syncs"
    args = [
        "--syncs-out", str(syncs), "--config", "tiny_cpu", "--data-dir", str(data_dir),
        "--output-dir", str(out), "--mlflow", "false", "--precision", "bf16",
        "--deepspeed-config", f"ds_configs/zero{stage}.json", "--micro-batch-size", "2",  # 2 ranks x 2 x accum 2
        "--train-steps", str(STEPS), "--log-interval", str(LOG_EVERY), "--save-interval", "1000",
        "--eval-interval", "1000", "--cpu-kernels", "off",
    ]  # fmt: skip
    result = launch(2, args, script="tests/scripts/count_syncs.py", env=job_env())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]

    # the DeepSpeed config the run wrote: the throughput timer off, bf16 accumulated in fp32, reduced in bf16
    ds = json.loads((out / "ds_config.json").read_text())
    assert ds["gradient_accumulation_steps"] == 2 and ds["bf16"]["enabled"] is True
    assert ds["timers"] == {"throughput": {"enabled": False, "synchronized": False}}
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"} and ds["communication_data_type"] == "bf16"
    flat = "ZeRO-2 gradients: one flat buffer per group" in result.stdout + result.stderr
    assert flat is (stage == 2)

    for rank in (0, 1):
        per_step = json.loads((syncs / f"rank{rank}.json").read_text())
        assert sorted(map(int, per_step)) == list(range(1, STEPS + 1))
        for step in range(1, STEPS + 1):
            counts = _count(per_step[str(step)])
            expected = SWBERT + (LOGGED if step % LOG_EVERY == 0 else Counter())
            expected += EVALUATED if step == STEPS else Counter()
            where = f"ZeRO-{stage}, rank {rank}, step {step}"
            assert counts["swbert"] == expected, f"{where}: swbert {dict(counts['swbert'])}"
            if step > 1:
                stacks = "".join(f"\n  {c['kind']}: {c['stack'][-3:]}" for c in per_step[str(step)])
                assert counts["deepspeed"] == DEEPSPEED[stage], (
                    f"{where}: {dict(counts['deepspeed'])}{stacks}"
                )
