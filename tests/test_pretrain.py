"""The pretraining job end to end: real DeepSpeed processes on gloo, 2 ranks, tiny model."""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForMaskedLM

import swbert  # noqa: F401  (registers the Auto classes)
from tests.launch_utils import (
    REPO,
    job_env,
    launch,
    read_metrics,
    run_single,
)


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
def test_zero_stage_trains_exports_and_resumes_exactly(stage, data_dir, tmp_path):
    """The loss falls and the exported folder reloads with the engine's logits. For stages 2 and 3
    a second run is killed (kill -9) after its checkpoint at step k: under ZeRO-2 two steps later,
    under ZeRO-3 in the middle of the save at step 2k (shards written, `latest` not moved). Resumed
    with --resume auto, it logs every loss and LR of the uninterrupted run exactly. Dropout is on,
    so the RNG state must resume too."""
    k = 15
    args = [
        "--deepspeed-config", f"ds_configs/zero{stage}.json", "--train-steps", str(2 * k),
        "--log-interval", "1", "--save-interval", str(k), "--eval-interval", "1000",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
    ]  # fmt: skip
    if stage == 2:  # one injected non-finite loss: skipped, counted, and the run goes on
        args += ["--fault-nonfinite-steps", "7"]
    full = tmp_path / "full"
    result = launch(
        2,
        [*tiny_args(data_dir, full, *args), "--dump-logits", str(tmp_path / "logits.pt")],
        script="tests/scripts/pretrain_and_dump.py",
    )
    check_ok(result)
    metrics = read_metrics(full)
    losses = [metrics[s]["loss"] for s in sorted(metrics) if s != 7]
    assert losses[-1] < losses[0] - 0.5, losses
    for key in ("loss", "lr", "tokens_per_s", "mlm_acc", "grad_norm", "samples_per_s", "tflops_per_device"):
        assert key in metrics[2 * k], key
    assert "val_loss" in metrics[2 * k] and "val_ppl" in metrics[2 * k]
    if stage == 2:
        assert metrics[7]["skipped_steps"] == 1 and metrics[2 * k]["skipped_total"] == 1
        assert "step 7 skipped" in result.stderr
    else:
        assert metrics[2 * k]["skipped_total"] == 0
    model = AutoModelForMaskedLM.from_pretrained(full / "export").eval()
    dumped = torch.load(tmp_path / "logits.pt")
    with torch.no_grad():
        logits = model(input_ids=dumped["input_ids"]).logits
    assert_close(logits, dumped["logits"], rtol=1e-5, atol=1e-5)
    assert (full / "export" / "tokenizer.json").is_file() or any((full / "export").glob("*.model"))
    if stage == 1:
        return

    cut, ckpts = tmp_path / "cut", tmp_path / "cut" / "checkpoints"
    fault, last = (
        ("SWBERT_FAULT_KILL_AFTER_STEP", k + 2) if stage == 2 else ("SWBERT_FAULT_KILL_IN_SAVE", 2 * k)
    )
    killed = launch(2, tiny_args(data_dir, cut, *args), env=job_env(**{fault: str(last)}))
    assert killed.returncode != 0
    assert max(read_metrics(cut)) == last
    assert (ckpts / "latest").read_text() == f"step_{k:08d}"
    if stage == 3:
        assert (ckpts / f"step_{2 * k:08d}").is_dir()  # the cut-off save is there, but not pointed to
    resumed = launch(2, tiny_args(data_dir, cut, *args, "--resume", "auto"))
    check_ok(resumed)
    assert f"resumed from {ckpts / f'step_{k:08d}'}" in resumed.stdout
    assert (ckpts / "latest").read_text() == f"step_{2 * k:08d}"
    after = read_metrics(cut)
    for step in range(k + 1, 2 * k + 1):
        assert after[step]["loss"] == metrics[step]["loss"], (
            step,
            metrics[step]["loss"],
            after[step]["loss"],
        )
        assert after[step]["lr"] == metrics[step]["lr"]


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


def refused(argv: list[str], capsys) -> str:
    """`launchers/pretrain.py ARGV` run in this process: it must exit with status 2 before any
    process group exists; returns what it printed to stderr."""
    from swbert.training.cli import main

    with mock.patch.dict(os.environ), pytest.raises(SystemExit) as exit_:  # the launcher sets RANK, ...
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    return err


def test_bad_input_errors_name_what_to_change(data_dir, tmp_path, capsys):
    """Each is refused at start-up, before any process group exists, naming what to change."""
    out = tmp_path / "run"
    err = refused(tiny_args(data_dir, out, "--global-batch-size", "6", "--micro-batch-size", "4"), capsys)
    assert "global_batch_size=6 is not divisible by micro_batch_size=4" in err
    assert "fp16 needs a GPU" in refused(tiny_args(data_dir, out, "--precision", "fp16"), capsys)
    err = refused(tiny_args(tmp_path, out), capsys)
    assert "holds no manifest.json" in err and "data_prep.preprocess" in err
    err = refused(
        tiny_args(data_dir, out, "--deepspeed-config", str(REPO / "ds_configs" / "zero2_fp16.json")), capsys
    )
    assert "fp16.enabled=True but the run's precision is fp32" in err
    # a run folder that already holds checkpoints (a real run), and a checkpoint of another shape
    check_ok(run_single(tiny_args(data_dir, out, "--train-steps", "2", "--save-interval", "2")))
    err = refused(tiny_args(data_dir, out, "--train-steps", "2"), capsys)
    assert "already holds a run with checkpoints; pass --resume auto" in err
    err = refused(tiny_args(data_dir, out, "--attention-type", "standard", "--resume", "auto"), capsys)
    assert "attention_type: checkpoint 'shared' vs this run 'standard'" in err
    # the exit status and message of a real process
    bad = run_single(tiny_args(data_dir, tmp_path / "other", "--precision", "fp16"))
    assert bad.returncode == 2 and "fp16 needs a GPU" in bad.stderr


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
