"""The pretraining job end to end: real DeepSpeed processes on gloo, 2 ranks, tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForMaskedLM

import swbert  # noqa: F401  (registers the Auto classes)
from tests.launch_utils import (
    REPO,
    job_env,
    launch,
    make_data_dir,
    read_metrics,
    run_single,
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("pretrain-data"))


def tiny_args(data_dir, out, *extra: str) -> list[str]:
    return [
        "--config",
        "tiny_cpu",
        "--data-dir",
        str(data_dir),
        "--output-dir",
        str(out),
        "--mlflow",
        "false",
        *extra,
    ]


def check_ok(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_loss_falls_and_export_matches_engine(stage, data_dir, tmp_path):
    out = tmp_path / "run"
    extra = [
        "--deepspeed-config",
        f"ds_configs/zero{stage}.json",
        "--train-steps",
        "30",
        "--log-interval",
        "5",
    ]
    if stage == 2:  # one injected non-finite loss: skipped, counted, and the run goes on
        extra += ["--fault-nonfinite-steps", "7"]
    result = launch(
        2,
        [*tiny_args(data_dir, out, *extra), "--dump-logits", str(tmp_path / "logits.pt")],
        script="tests/scripts/pretrain_and_dump.py",
    )
    check_ok(result)
    metrics = read_metrics(out)
    losses = [metrics[s]["loss"] for s in sorted(metrics)]
    assert losses[-1] < losses[0] - 0.5, losses
    for key in ("loss", "lr", "tokens_per_s", "mlm_acc", "grad_norm", "samples_per_s", "tflops_per_device"):
        assert key in metrics[30], key
    assert "val_loss" in metrics[30] and "val_ppl" in metrics[30]
    if stage == 2:
        assert metrics[10]["skipped_steps"] == 1 and metrics[30]["skipped_total"] == 1
        assert "step 7 skipped" in result.stderr
    else:
        assert metrics[30]["skipped_total"] == 0
    # the exported folder reloads with the engine's logits
    model = AutoModelForMaskedLM.from_pretrained(out / "export").eval()
    dumped = torch.load(tmp_path / "logits.pt")
    with torch.no_grad():
        logits = model(input_ids=dumped["input_ids"]).logits
    assert_close(logits, dumped["logits"], rtol=1e-5, atol=1e-5)
    assert (out / "export" / "tokenizer.json").is_file() or any((out / "export").glob("*.model"))


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_after_kill_is_exact(stage, data_dir, tmp_path):
    k = 6
    common = [
        "--deepspeed-config",
        f"ds_configs/zero{stage}.json",
        "--train-steps",
        str(2 * k),
        "--log-interval",
        "1",
        "--save-interval",
        str(k),
        "--eval-interval",
        "1000",
        "--hidden-dropout",
        "0.1",
        "--attention-dropout",
        "0.1",
    ]  # dropout: RNG state must resume too
    full = tmp_path / "full"
    check_ok(launch(2, tiny_args(data_dir, full, *common)))
    cut = tmp_path / "cut"
    killed = launch(
        2, tiny_args(data_dir, cut, *common), env=job_env(SWBERT_FAULT_KILL_AFTER_STEP=str(k + 2))
    )
    assert killed.returncode != 0  # kill -9 two steps after the checkpoint at step k
    assert max(read_metrics(cut)) == k + 2
    assert (cut / "checkpoints" / "latest").read_text() == f"step_{k:08d}"
    resumed = launch(2, tiny_args(data_dir, cut, *common, "--resume", "auto"))
    check_ok(resumed)
    assert f"resumed from {cut / 'checkpoints' / f'step_{k:08d}'}" in resumed.stdout
    a, b = read_metrics(full), read_metrics(cut)
    for step in range(k + 1, 2 * k + 1):
        assert b[step]["loss"] == a[step]["loss"], (step, a[step]["loss"], b[step]["loss"])
        assert b[step]["lr"] == a[step]["lr"]


def test_kill_during_checkpoint_save_keeps_previous(data_dir, tmp_path):
    out = tmp_path / "run"
    args = tiny_args(data_dir, out, "--train-steps", "12", "--save-interval", "4", "--log-interval", "1")
    crashed = launch(2, args, env=job_env(SWBERT_FAULT_KILL_IN_SAVE="8"))
    assert crashed.returncode != 0
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000004"
    assert (ckpts / "step_00000008").is_dir()  # the cut-off save is there, but not pointed to
    resumed = launch(2, [*args, "--resume", "auto"])
    check_ok(resumed)
    assert "resumed from" in resumed.stdout and "step_00000004" in resumed.stdout
    assert (ckpts / "latest").read_text() == "step_00000012"


def test_nonfinite_steps_in_a_row_stop_cleanly(data_dir, tmp_path):
    out = tmp_path / "run"
    result = launch(
        2,
        tiny_args(
            data_dir,
            out,
            "--train-steps",
            "20",
            "--save-interval",
            "2",
            "--log-interval",
            "1",
            "--fault-nonfinite-steps",
            "5,6,7",
            "--max-nonfinite-steps",
            "3",
        ),
    )
    assert result.returncode != 0
    assert "3 steps in a row had a non-finite loss" in result.stderr
    assert "step_00000004" in result.stderr  # names the last good checkpoint
    assert (out / "checkpoints" / "latest").read_text() == "step_00000004"
    meta = json.loads((out / "checkpoints" / "step_00000004" / "swbert_meta.json").read_text())
    assert meta["step"] == 4


def test_bad_input_errors_name_what_to_change(data_dir, tmp_path):
    """Each is refused at start-up, before any process group exists, naming what to change."""
    out = tmp_path / "run"
    bad = run_single(tiny_args(data_dir, out, "--global-batch-size", "6", "--micro-batch-size", "4"))
    assert bad.returncode == 2 and "global_batch_size=6 is not divisible by micro_batch_size=4" in bad.stderr
    bad = run_single(tiny_args(data_dir, out, "--precision", "fp16"))
    assert bad.returncode == 2 and "fp16 needs a GPU" in bad.stderr
    bad = run_single(tiny_args(tmp_path, out))
    assert (
        bad.returncode == 2
        and "holds no manifest.json" in bad.stderr
        and "data_prep.preprocess" in bad.stderr
    )
    bad = run_single(
        tiny_args(data_dir, out, "--deepspeed-config", str(REPO / "ds_configs" / "zero2_fp16.json"))
    )
    assert bad.returncode == 2 and "fp16.enabled=True but the run's precision is fp32" in bad.stderr
    # a run folder that already holds checkpoints, and a checkpoint of another shape
    check_ok(run_single(tiny_args(data_dir, out, "--train-steps", "2", "--save-interval", "2")))
    bad = run_single(tiny_args(data_dir, out, "--train-steps", "2"))
    assert bad.returncode == 2 and "already holds a run with checkpoints; pass --resume auto" in bad.stderr
    bad = run_single(tiny_args(data_dir, out, "--attention-type", "standard", "--resume", "auto"))
    assert bad.returncode == 2 and "attention_type: checkpoint 'shared' vs this run 'standard'" in bad.stderr


def test_config_typos_and_recipes():
    from swbert.training.cli import parse_args

    with pytest.raises(ValueError, match="unknown config key 'lr-shedule'.*did you mean 'lr_schedule'"):
        parse_args(["--lr-shedule", "cosine"])
    with pytest.raises(ValueError, match="lr_schedule='cosinus' is not one of linear, cosine, constant"):
        parse_args(["--lr-schedule", "cosinus"])
    config = parse_args(
        ["--config", "tiny_cpu", "--lr", "5e-4", "--local_rank=0", "--fault-nonfinite-steps", "3,4"]
    )
    assert config.lr == 5e-4 and config.size == "tiny" and config.fault_nonfinite_steps == [3, 4]
    assert (REPO / "swbert" / "recipes" / "default.yaml").is_file()
