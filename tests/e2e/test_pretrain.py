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
from tests.golden import check_golden
from tests.launch_utils import (
    HANG_S,
    REPO,
    free_port,
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


@pytest.mark.slow
@pytest.mark.golden
# ZeRO-1 in make test-long: DeepSpeed's stage 1 is its stage-2 optimizer without gradient partitioning
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.long), 2, 3])
def test_zero_stage_trains_exports_and_resumes_exactly(stage, data_dir, tmp_path):
    """The loss falls and the exported folder reloads with the engine's logits. A run is killed
    (kill -9) after its checkpoint at step k: under ZeRO-2 a second run, two steps later; under
    ZeRO-3 the run itself, in the middle of its save at step 2k (shards written, `latest` not
    moved), so it has trained all 2k steps uninterrupted and its log is the reference. Resumed with
    --resume auto, it logs every loss and LR of the uninterrupted run exactly (under ZeRO-3 the
    resumed run is the finished one whose export is checked). Dropout is on, so the RNG state must
    resume too. Under ZeRO-2 and 3 a NaN loss injected at step 7 is skipped and counted (DeepSpeed
    checks gradients for both in fp32 too); under ZeRO-1 no step is skipped."""
    k = 15
    args = [
        "--deepspeed-config", f"ds_configs/zero{stage}.json", "--train-steps", str(2 * k),
        "--log-interval", "1", "--save-interval", str(k), "--eval-interval", "1000",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--keep-checkpoints", "1",
    ]  # fmt: skip
    fault = {}
    if stage >= 2:  # one injected non-finite loss: skipped, counted, and the run goes on
        fault = {"SWBERT_FAULT_NONFINITE_STEPS": "7"}
        args += ["--cpu-kernels", "off"]  # exactly the model path a GPU runs, resume included
    dump = ["--dump-logits", str(tmp_path / "logits.pt")]
    cut, ckpts = tmp_path / "cut", tmp_path / "cut" / "checkpoints"
    if stage < 3:
        full = tmp_path / "full"
        result = launch(
            2,
            [*tiny_args(data_dir, full, *args), *dump],
            script="tests/scripts/pretrain_and_dump.py",
            env=job_env(**fault),
        )
        check_ok(result)
        metrics = read_metrics(full)
    else:
        # Killed in the middle of its save at step 2k, the run has trained and logged all 2k steps
        # as an uninterrupted run does: its log is the reference the resumed run must repeat, and
        # the resumed run (which finishes, exports and dumps the logits) is the finished run.
        full = cut
        result = launch(
            2, tiny_args(data_dir, cut, *args), env=job_env(**fault, SWBERT_FAULT_KILL=f"in_save:{2 * k}")
        )
        assert result.returncode != 0
        metrics = read_metrics(cut)
        assert max(metrics) == 2 * k
        assert (ckpts / "latest").read_text() == f"step_{k:08d}"
        # the cut-off save is there, under its in-progress name (renamed only once complete)
        assert (ckpts / f"step_{2 * k:08d}.partial").is_dir() and not (ckpts / f"step_{2 * k:08d}").exists()
        resumed = launch(
            2,
            [*tiny_args(data_dir, cut, *args, "--resume", "auto"), *dump],
            script="tests/scripts/pretrain_and_dump.py",
            env=job_env(**fault),
        )
        check_ok(resumed)
    if stage >= 2:
        assert "model path: plain PyTorch ops, the path a GPU runs" in result.stderr
    else:  # on a CPU the default swaps in swbert.runtime.cpu's kernels
        assert "model path: CPU kernels from swbert.runtime.cpu (attention)" in result.stderr
    check_golden(f"tiny_cpu-zero{stage}-2ranks", metrics)  # every logged loss, bit for bit
    losses = [metrics[s]["loss"] for s in sorted(metrics) if s != 7]
    assert losses[-1] < losses[0] - 0.5, losses
    final = read_metrics(full)[2 * k]  # the finished run's last record (under ZeRO-3: after resume)
    for key in ("loss", "lr", "tokens_per_s", "mlm_acc", "grad_norm", "samples_per_s", "tflops_per_device"):
        assert key in final, key
    assert final["grad_norm"] > 0 and final["mem_rss_gib"] > 0
    # keep the newest 1; the client state holds the data position, and every rank its RNG
    last = f"step_{2 * k:08d}"
    assert {p.name for p in (full / "checkpoints").glob("step_*")} == {last}
    assert (full / "checkpoints" / "latest").read_text() == last
    tag = full / "checkpoints" / last
    assert {p.name for p in tag.glob("rng_rank*.pt")} == {"rng_rank00000.pt", "rng_rank00001.pt"}
    client = torch.load(min(tag.glob("*model_states.pt")), map_location="cpu", weights_only=False)
    samples = 2 * k * 8  # global batch 8 of 64-token sequences
    assert (client["step"], client["samples_consumed"]) == (2 * k, samples)
    assert client["tokens_seen"] == samples * 64
    sampler = client["sampler"]
    assert sampler["epoch"] * sampler["num_samples"] + sampler["consumed"] == samples
    assert "val_loss" in final and "val_ppl" in final
    if stage >= 2:
        # under ZeRO-3 `final` is the resumed run's: the skip before its checkpoint is still counted
        assert metrics[7]["skipped_steps"] == 1 and final["skipped_total"] == 1
        assert final["skipped_steps"] == 0
        assert "step 7 skipped" in result.stderr
    else:
        assert final["skipped_total"] == 0
    model = AutoModelForMaskedLM.from_pretrained(full / "export").eval()
    dumped = torch.load(tmp_path / "logits.pt")
    with torch.no_grad():
        logits = model(input_ids=dumped["input_ids"]).logits
    assert_close(logits, dumped["logits"], rtol=1e-5, atol=1e-5)
    assert (full / "export" / "tokenizer.json").is_file() or any((full / "export").glob("*.model"))
    if stage == 1:
        return

    if stage == 2:
        last = k + 2
        killed = launch(
            2, tiny_args(data_dir, cut, *args), env=job_env(**fault, SWBERT_FAULT_KILL=f"after_step:{last}")
        )
        assert killed.returncode != 0
        assert max(read_metrics(cut)) == last
        assert (ckpts / "latest").read_text() == f"step_{k:08d}"
        resumed = launch(2, tiny_args(data_dir, cut, *args, "--resume", "auto"), env=job_env(**fault))
        check_ok(resumed)
    assert "model path: plain PyTorch ops" in resumed.stderr
    assert f"resumed from {ckpts / f'step_{k:08d}'}" in resumed.stdout
    assert f"resolved config ({cut / 'resolved_config.yaml'}):" in resumed.stdout
    assert (ckpts / "latest").read_text() == f"step_{2 * k:08d}"
    assert {p.name for p in ckpts.glob("step_*")} == {f"step_{2 * k:08d}"}  # the older one pruned
    after = read_metrics(cut)
    for step in range(k + 1, 2 * k + 1):
        assert after[step]["loss"] == metrics[step]["loss"], (
            step,
            metrics[step]["loss"],
            after[step]["loss"],
        )
        assert after[step]["lr"] == metrics[step]["lr"]
    first, last = after[k + 1]["loss"], after[2 * k]["loss"]  # the closing summary shows the loss falling
    closing = f"loss:{' ' * 24}{first:.4f} at step {k + 1} -> {last:.4f} at step {2 * k}"
    assert f"done: {2 * k} steps" in resumed.stdout and closing in resumed.stdout, resumed.stdout[-2000:]
    assert f"model (Hugging Face folder): {cut / 'export'}" in resumed.stdout


@pytest.mark.slow
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
            "--max-nonfinite-steps",
            "3",
        ),
        env=job_env(SWBERT_FAULT_NONFINITE_STEPS="5,6,7"),
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
    from swbert.launchers.pretrain import main

    started = AssertionError("the process group started before the input was checked")
    with (
        mock.patch.dict(os.environ),  # the launcher sets RANK, ...
        mock.patch("swbert.training.build.init_distributed", side_effect=started),
        pytest.raises(SystemExit) as exit_,
    ):
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    return err


@pytest.mark.slow
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
    # a data folder made with another tokenizer than the checkpoint's
    from data_prep.preprocess import preprocess
    from data_prep.train_tokenizer import train_tokenizer

    corpus = str(data_dir.parent / "corpus.txt")
    train_tokenizer([corpus], tmp_path / "tok90", vocab_size=90, threads=1)
    preprocess([corpus], tmp_path / "tok90", tmp_path / "data90", workers=1, progress=False)
    err = refused(tiny_args(tmp_path / "data90", out, "--resume", "auto"), capsys)
    assert "vocab_size: checkpoint 96 vs this run 90" in err and "tokenizer_hash: checkpoint" in err
    # what exact resume depends on: the data (same tokenizer, other documents), the seed, the layout
    half = tmp_path / "half.txt"
    half.write_text("".join(open(corpus).readlines()[::2]))
    preprocess([str(half)], data_dir.parent / "tok", tmp_path / "half", workers=1, progress=False)
    err = refused(tiny_args(tmp_path / "half", out, "--resume", "auto"), capsys)
    assert "would change what exact resume depends on (data: checkpoint" in err
    assert "--allow-resume-change data" in err
    err = refused(tiny_args(data_dir, out, "--seed", "99", "--resume", "auto"), capsys)
    assert "seed: checkpoint 1234 vs this run 99" in err and "--allow-resume-change seed" in err
    err = refused(
        tiny_args(data_dir, out, "--deepspeed-config", "ds_configs/zero1.json", "--resume", "auto"), capsys
    )
    assert "another ZeRO stage or data-parallel size (zero_stage 2 -> 1)" in err
    assert f"python -m swbert.parallel.convert universal {out / 'checkpoints'} NEW_DIR" in err
    err = refused(tiny_args(data_dir, out, "--allow-resume-change", "sede", "--resume", "auto"), capsys)
    assert "'sede' is not a setting a resume may change; did you mean 'seed'?" in err
    # an optimizer setting is never silently ignored: refused, or applied; its kind cannot change
    err = refused(tiny_args(data_dir, out, "--lr", "1e-3", "--resume", "auto"), capsys)
    assert "lr: checkpoint 0.002 vs this run 0.001" in err and "--allow-resume-change lr" in err
    err = refused(tiny_args(data_dir, out, "--optimizer", "cpu_adam", "--resume", "auto"), capsys)
    assert "holds the state of --optimizer torch_adamw, which --optimizer cpu_adam cannot load" in err
    # a deliberate change proceeds, and the MLflow run records it
    args = ["--seed", "99", "--lr", "1e-3", "--allow-resume-change", "seed,lr", "--resume", "auto"]
    changed = run_single([*tiny_args(data_dir, out, *args, "--train-steps", "3"), "--mlflow", "true"])
    check_ok(changed)
    assert "resume changes seed: 1234 -> 99 (--allow-resume-change)" in changed.stderr
    assert "resume applies lr: 0.002 -> 0.001 to the restored optimizer" in changed.stderr
    assert read_metrics(out)[3]["lr"] == pytest.approx(1e-3 * 4 / 5)  # warm-up step 4 of 5, new peak
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out.parent / 'mlflow.db'}")
    run = client.get_run((out / "mlflow_run_id").read_text().strip())
    assert run.data.tags["resume_change.step_00000002"] == "seed: 1234 -> 99; lr: 0.002 -> 0.001"
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
        ["--config", "tiny_cpu", "--lr", "5e-4", "--local_rank=0", "--allow-resume-change", "seed,data"]
    )
    assert config.lr == 5e-4 and config.size == "tiny" and config.allow_resume_change == ["seed", "data"]
    assert (REPO / "swbert" / "recipes" / "default.yaml").is_file()
    # compile was a boolean once, and YAML reads `on` as one: true/false mean on/off everywhere
    assert [parse_args(["--compile", v]).compile for v in ("true", "False", "on", "auto")] == [
        "on",
        "off",
        "on",
        "auto",
    ]


def test_a_yaml_recipe_compile_on_is_on(tmp_path):
    from swbert.training.cli import parse_args

    recipe = tmp_path / "run.yaml"
    recipe.write_text("size: tiny\ncompile: on\n")  # YAML 1.1: `on` is true
    assert parse_args(["--config", str(recipe)]).compile == "on"


def test_config_typos_in_a_toml_recipe(tmp_path):
    from swbert.training.cli import parse_args

    recipe = tmp_path / "run.toml"
    recipe.write_text('size = "tiny"\nattention_type = "pairwise"\nlr = 3e-4\ntrain_steps = 7\n')
    config = parse_args(["--config", str(recipe), "--train-steps", "9"])
    assert (config.size, config.attention_type, config.lr) == ("tiny", "pairwise", 3e-4)
    assert config.train_steps == 9  # the command line wins over the recipe
    recipe.write_text('size = "tiny"\nwarmup_step = 10\n')
    typo = f"unknown config key 'warmup_step' in recipe {recipe}.*did you mean 'warmup_steps'"
    with pytest.raises(ValueError, match=typo):
        parse_args(["--config", str(recipe)])


def test_deepspeed_configs_take_batch_lr_and_precision_from_the_training_config(tmp_path):
    """Every shipped JSON is filled from TrainConfig; a hard-coded value that disagrees with it, or an
    optimizer/scheduler section (its own LR), is an error naming the flag, never a silent override."""
    from swbert.runtime.ds_config import load_ds_config, offloads_optimizer, zero_stage
    from swbert.training.build import pretraining_ds_config
    from swbert.training.config import TrainConfig

    shipped = {p.name for p in (REPO / "ds_configs").glob("*.json")}
    assert shipped == {"zero1.json", "zero2.json", "zero3.json", "zero2_fp16.json", "zero3_offload.json"}
    batch = dict(global_batch_size=32, micro_batch_size=4, grad_clip=0.5)

    def build(path: str, precision: str = "fp32") -> dict:
        return pretraining_ds_config(TrainConfig(deepspeed_config=path, **batch), 2, precision)

    for name, stage in [("zero1.json", 1), ("zero2.json", 2), ("zero3.json", 3), ("zero3_offload.json", 3)]:
        ds = build(f"ds_configs/{name}", "bf16")
        assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"]) == (32, 4)
        assert ds["gradient_accumulation_steps"] == 4 and ds["gradient_clipping"] == 0.5
        assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
        assert zero_stage(ds) == stage and offloads_optimizer(ds) == (name == "zero3_offload.json")
        assert build(name)["bf16"]["enabled"] is False  # a shipped name, found from anywhere
    fp16 = build("ds_configs/zero2_fp16.json", "fp16")["fp16"]
    assert fp16["enabled"] is True and fp16["loss_scale"] == 0  # 0: dynamic loss scaling

    template = load_ds_config("ds_configs/zero2.json")
    path = tmp_path / "ds.json"
    for key, value, flag in [
        ("train_batch_size", 64, "global-batch-size"),
        ("train_micro_batch_size_per_gpu", 8, "micro-batch-size"),
        ("gradient_accumulation_steps", 1, "grad-accum-steps"),
        ("gradient_clipping", 1.0, "grad-clip"),
    ]:
        path.write_text(json.dumps({**template, key: value}))
        conflict = f"sets {key}={value!r} but the training config gives .*--{flag}"
        with pytest.raises(ValueError, match=conflict):
            build(str(path))
    path.write_text(json.dumps({**template, "train_batch_size": 32, "gradient_accumulation_steps": 4}))
    assert build(str(path))["train_batch_size"] == 32  # a hard-coded value that agrees is fine
    for section, value in [("optimizer", {"type": "AdamW", "params": {"lr": 1e-4}}), ("scheduler", {})]:
        path.write_text(json.dumps({**template, section: value}))
        with pytest.raises(ValueError, match=f"has a '{section}' section.*--lr"):
            build(str(path))


@pytest.mark.slow
def test_make_pretrain_job_on_the_gpu_model_path(tmp_path):
    """`make pretrain`'s job as it runs it (the deepspeed launcher, 2 ranks, the embedded default
    recipe: mini model, seq 128, global batch 32, ZeRO-2, dropout 0.1, the default corpus) with the
    CPU kernels off, i.e. exactly the model path a GPU runs; shortened to 10 steps (two logged, at an
    interval of 5; the loss already falls between them)."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "default"
    cmd = [
        str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
        "launchers/pretrain.py", "--output-dir", str(out), "--cpu-kernels", "off", "--train-steps", "10",
        "--log-interval", "5", "--mlflow", "false", "--progress-bar", "false",
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=HANG_S)
    check_ok(result)
    log = result.stdout + result.stderr
    assert "model path: plain PyTorch ops, the path a GPU runs" in log
    metrics = read_metrics(out)
    assert sorted(metrics) == [5, 10]
    assert metrics[10]["loss"] < metrics[5]["loss"], metrics
    assert "val_loss" in metrics[10] and metrics[10]["skipped_total"] == 0
    assert (out / "export" / "model.safetensors").is_file()
