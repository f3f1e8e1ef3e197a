"""Kill -9 anywhere in a run, resume with --resume auto, and get the uninterrupted run bit for bit.

Points (swbert.training.faults): mid-step, during the shard writes of a save, after the shards
but before the completeness marker, amid pruning an older checkpoint, during the final export,
after a step; on rank 0 or rank 1. Layouts: ZeRO 1/2/3, gradient accumulation 1 and 2, TP=2.
Every deterministic logged field of every step and the exported weights must equal the
uninterrupted run's (fp32 on CPU, dropout on, so the RNG streams must resume too).

CI runs a fixed sample (two points on one layout); `make test-faults` runs the whole matrix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.launch_utils import job_env, launch, read_metrics

pytestmark = pytest.mark.slow

FULL = os.environ.get("SWBERT_FULL_FAULT_MATRIX") == "1"
STEPS = 8
# fields that must repeat exactly; timings and memory are the machine's
DETERMINISTIC = ("loss", "mlm_acc", "lr", "grad_norm", "skipped_steps", "skipped_total", "tokens_seen",
                 "val_loss", "val_ppl", "val_mlm_acc")  # fmt: skip
LAYOUTS = {  # name: (ZeRO stage, gradient accumulation, tensor parallel)
    "z2-accum2": (2, 2, 1),
    "z1-accum1": (1, 1, 1),
    "z3-accum2": (3, 2, 1),
    "tp2-z1": (1, 2, 2),
    "mix-z2": (2, 1, 1),  # --data-mix A=0.75 B=0.25 in place of --data-dir
}
KILLS = ["in_step:5@1", "after_step:5", "in_save_shards:6", "in_save:6@1", "in_prune:6", "in_export:8"]
# CI runs one case (a rank killed inside a step); `make test-faults` runs the whole matrix
SAMPLE = [("z2-accum2", "in_step:5@1")]
CASES = [(layout, kill) for layout in LAYOUTS for kill in KILLS] if FULL else SAMPLE
# a weighted mix of two folders resumes exactly too (its schedule is a function of the position)
CASES += [] if FULL else [pytest.param("mix-z2", "after_step:5", marks=pytest.mark.long)]


def _data(layout: str, request: pytest.FixtureRequest) -> list[str]:
    """The data flags of a layout: the shared folder, or a mix of two (fixture `mix_dirs`)."""
    if layout.startswith("mix"):
        a, b = request.getfixturevalue("mix_dirs")
        return ["--data-mix", f"{a}=0.75", f"{b}=0.25"]
    return ["--data-dir", str(request.getfixturevalue("data_dir"))]


def _args(data: list[str], out: Path, layout: str, *extra: str) -> list[str]:
    stage, accum, tp = LAYOUTS[layout]
    micro = 8 // ((2 // tp) * accum)  # global batch 8 on 2 processes
    return [
        "--config", "tiny_cpu", *data, "--output-dir", str(out), "--mlflow", "false",
        "--deepspeed-config", f"ds_configs/zero{stage}.json", "--tensor-parallel", str(tp),
        "--micro-batch-size", str(micro), "--train-steps", str(STEPS), "--log-interval", "1",
        "--eval-interval", "4", "--save-interval", "3", "--keep-checkpoints", "1",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--cpu-kernels", "off", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reference(request, tmp_path_factory):
    """The uninterrupted run of each layout, made once: (metrics, exported weights)."""
    made: dict[str, tuple[dict, dict]] = {}

    def get(layout: str) -> tuple[dict, dict]:
        if layout not in made:
            out = tmp_path_factory.mktemp(f"ref-{layout}")
            result = launch(2, _args(_data(layout, request), out, layout))
            assert result.returncode == 0, result.stderr[-4000:]
            made[layout] = read_metrics(out), load_file(out / "export" / "model.safetensors")
        return made[layout]

    return get


@pytest.mark.parametrize("layout, kill", CASES)
def test_killed_anywhere_the_resumed_run_equals_the_uninterrupted_one(
    layout, kill, request, tmp_path, reference
):
    expected_metrics, expected_weights = reference(layout)
    out, data = tmp_path / "run", _data(layout, request)
    killed = launch(2, _args(data, out, layout), env=job_env(SWBERT_FAULT_KILL=kill))
    assert killed.returncode != 0, f"{kill} did not kill the run"
    resumed = launch(2, _args(data, out, layout, "--resume", "auto"))
    assert resumed.returncode == 0, resumed.stderr[-4000:]

    got = read_metrics(out)  # a step logged before the kill and again after the resume: the later one
    assert sorted(got) == sorted(expected_metrics) == list(range(1, STEPS + 1))
    mixed = ("val_loss/A", "val_loss/B", "val_mlm_acc/A", "val_mlm_acc/B") if layout.startswith("mix") else ()
    for step, want in expected_metrics.items():
        for key in DETERMINISTIC + mixed:
            assert got[step].get(key) == want.get(key), (kill, step, key, got[step].get(key), want.get(key))
    weights = load_file(out / "export" / "model.safetensors")
    assert weights.keys() == expected_weights.keys()
    for name, tensor in expected_weights.items():
        assert torch.equal(weights[name], tensor), (kill, name)
    # nothing was deleted but older complete checkpoints; cut-off saves were moved aside
    ckpts = out / "checkpoints"
    if mixed:  # validated per folder; the mix and each folder's epochs recorded
        assert "val_loss/A" in got[STEPS] and "val_loss/B" in got[STEPS]
        meta = json.loads((ckpts / f"step_{STEPS:08d}" / "swbert_meta.json").read_text())
        assert meta["run"]["data"].startswith("A=3/4@") and meta["data_mix"]["window"] == 4
        assert meta["data_position"]["folders"]["A"]["drawn"] == 3 * 8 * STEPS // 4
        assert "# data_mix, resolved: every window of 4 samples" in (out / "resolved_config.yaml").read_text()
    assert (ckpts / "latest").read_text() == f"step_{STEPS:08d}"
    if "@" not in kill and kill.startswith(("in_save_shards", "in_save:", "in_prune")):  # rank 0 cut it off
        assert any((ckpts / "incomplete").iterdir()), "the cut-off folder was not kept"
