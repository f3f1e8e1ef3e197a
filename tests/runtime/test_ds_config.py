"""swbert's DeepSpeed and optimizer settings for GPU runs: the throughput timer off in every config
swbert writes, bf16 gradients accumulated in fp32 and reduced in bf16 (and DeepSpeed honouring it at every
ZeRO stage, on real engines), bucket sizes that let the reduction overlap the backward, torch's
fused AdamW as the GPU default and FusedAdam's build failures as one line naming the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from swbert.models import SWBertConfig
from swbert.models.flops import masked_lm_params
from swbert.runtime.ds_config import BatchShape, build_ds_config, load_ds_config
from swbert.runtime.optim import build_optimizer
from swbert.training.build import pretraining_ds_config
from swbert.training.config import TrainConfig
from tests.launch_utils import REPO, job_env
from tests.parallel.test_parallel_harness import mlm_batch, reference_model, run_ranks, tiny_config

SHIPPED = ["zero1.json", "zero2.json", "zero3.json", "zero3_offload.json"]
TIMER_OFF = {"throughput": {"enabled": False, "synchronized": False}}


def _build(template: str | Path, precision: str) -> dict:
    return pretraining_ds_config(
        TrainConfig(deepspeed_config=str(template), global_batch_size=32, micro_batch_size=4), 2, precision
    )


def _template(tmp_path: Path, **changes: object) -> Path:
    ds = load_ds_config("ds_configs/zero2.json")
    ds.update(changes)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return path


@pytest.mark.parametrize("name", SHIPPED)
def test_the_timer_is_off_and_bf16_accumulates_in_fp32(name):
    bf16 = _build(f"ds_configs/{name}", "bf16")
    assert bf16["timers"] == TIMER_OFF
    assert bf16["communication_data_type"] == "bf16"
    if name == "zero1.json":  # see test_zero_0_and_1_accumulate_bf16_in_bf16
        assert "data_types" not in bf16
    else:
        assert bf16["data_types"] == {"grad_accum_dtype": "fp32"}
    fp32 = _build(name, "fp32")
    assert fp32["timers"] == TIMER_OFF
    assert "data_types" not in fp32 and "communication_data_type" not in fp32  # fp32 already


def test_fine_tuning_configs_get_the_same_settings():
    from swbert.finetune.trainer import FinetuneConfig, deepspeed_config

    ds = deepspeed_config("zero2.json", FinetuneConfig(batch_size=8), 2, "bf16")
    assert ds["timers"] == TIMER_OFF and ds["data_types"] == {"grad_accum_dtype": "fp32"}


def test_what_a_template_sets_explicitly_is_kept(tmp_path):
    on = {"throughput": {"enabled": True}}
    assert _build(_template(tmp_path, timers=on), "bf16")["timers"] == on  # asked for: kept, synchronised
    half_off = {"throughput": {"enabled": False, "synchronized": True}}
    assert _build(_template(tmp_path, timers=half_off), "bf16")["timers"] == TIMER_OFF
    chosen = _build(
        _template(tmp_path, data_types={"grad_accum_dtype": "bf16"}, communication_data_type="bf16"), "bf16"
    )
    assert (
        chosen["data_types"] == {"grad_accum_dtype": "bf16"} and chosen["communication_data_type"] == "bf16"
    )
    auto = _build(_template(tmp_path, data_types={"grad_accum_dtype": "auto"}), "bf16")
    assert auto["data_types"] == {"grad_accum_dtype": "fp32"}


def test_zero_0_and_1_accumulate_bf16_in_bf16(tmp_path, caplog):
    """DeepSpeed 0.19.8 refuses fp32 accumulation of bf16 gradients without ZeRO ("unsupported mix of
    model_dtype and grad_accum_dtype") and at stage 1 switches to its BF16_Optimizer, whose
    checkpoints its zero_to_fp32 refuses ("is not a zero checkpoint"), so the export at the end of
    a run would fail: stages 0 and 1 reduce in fp32 only, a template asking for fp32 accumulation
    there is refused naming the fix, and a run that accumulates is told which config sums in fp32."""
    for stage in (0, 1):
        template = tmp_path / f"zero{stage}.json"
        template.write_text(json.dumps({"zero_optimization": {"stage": stage}}))
        with caplog.at_level("INFO", logger="swbert.runtime.ds_config"):
            ds = _build(template, "bf16")  # 32 = 2 ranks x 4 x accumulation 4
        assert "data_types" not in ds and ds["communication_data_type"] == "bf16"
        assert f"ZeRO stage {stage} in bf16 sums the 4 micro-batches of each step in bf16" in caplog.text
        template.write_text(
            json.dumps({"zero_optimization": {"stage": stage}, "data_types": {"grad_accum_dtype": "bf16"}})
        )
        assert _build(template, "bf16")["data_types"] == {"grad_accum_dtype": "bf16"}  # as written
        template.write_text(
            json.dumps({"zero_optimization": {"stage": stage}, "data_types": {"grad_accum_dtype": "fp32"}})
        )
        with pytest.raises(ValueError, match=rf"grad_accum_dtype='fp32' at ZeRO stage {stage}.*zero2\.json"):
            _build(template, "bf16")


def test_shipped_buckets_let_the_reduction_overlap_the_backward():
    """Gradients are reduced in buckets during backward (overlap_comm): a bucket of a quarter or less
    of the shared BERT-base's 95M gradients starts the first reduction early and leaves little to
    reduce after the last layer; one of 16M elements or more (64 MB in fp32) keeps each all-reduce
    large enough for NCCL to run at its bus bandwidth."""
    base = masked_lm_params(SWBertConfig.from_size("base", vocab_size=30522))
    for name in [*SHIPPED, "zero2_fp16.json"]:
        zero = load_ds_config(f"ds_configs/{name}")["zero_optimization"]
        assert zero["overlap_comm"] is True and zero["contiguous_gradients"] is True, name
        assert 16_000_000 <= zero["reduce_bucket_size"] <= base // 4, name


def _accumulation_in_fp32(stages: tuple[int, ...]) -> None:
    """Each micro-batch pair is the same batch twice, the second with its loss scaled by 2**-10: the
    accumulated gradient is g (1 + 2**-10), which bf16 (8 bits of mantissa) rounds back to g and
    fp32 keeps. With lr 0 the weights stay put, so a second step with the second loss scaled by 0
    gives |g| for the ratio. ZeRO-1, which accumulates in bf16, shows that the check can fail."""
    import deepspeed

    config = tiny_config("shared")
    rank = torch.distributed.get_rank()
    batch = mlm_batch(7 + rank)
    for stage in stages:
        ds = build_ds_config(f"ds_configs/zero{stage}.json", BatchShape(16, 4, 2), 1.0, "bf16")
        model = reference_model(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
        assert engine.communication_data_type == torch.bfloat16
        norms = []
        for second in (2.0**-10, 0.0):
            for scale in (1.0, second):
                loss = engine(**batch).loss * scale
                engine.backward(loss)
                engine.step()
            norms.append(float(engine.get_global_grad_norm()))
        ratio = norms[0] / norms[1]
        if stage >= 2:
            assert engine.get_data_types() == (torch.bfloat16, torch.float32)
            assert abs(ratio - (1 + 2**-10)) < 2**-14, (stage, ratio)
        else:
            assert engine.get_data_types() == (torch.bfloat16, torch.bfloat16)
            assert ratio == 1.0, (stage, ratio)  # bf16 lost the second micro-batch
        del engine


@pytest.mark.slow
def test_bf16_engines_accumulate_gradients_in_fp32_at_zero_2_and_3():
    run_ranks(_accumulation_in_fp32, 2, (1, 2, 3), deepspeed=True)


def test_the_optimizer_auto_builds():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    gpu = build_optimizer(model, 1e-3, 0.01, on_gpu=True)  # torch's fused kernel runs on CPU too
    assert type(gpu) is torch.optim.AdamW and gpu.defaults["fused"] is True
    cpu = build_optimizer(model, 1e-3, 0.01)
    assert type(cpu) is torch.optim.AdamW and not cpu.defaults["fused"]
    assert [g["weight_decay"] for g in gpu.param_groups] == [0.01, 0.0]
    with pytest.raises(ValueError, match="--optimizer torch_adamw cannot run with ZeRO optimizer offload"):
        build_optimizer(model, 1e-3, 0.01, kind="torch_adamw", offload=True)


@pytest.mark.slow
def test_a_fused_adam_that_cannot_be_built_is_one_line_naming_the_fix(tmp_path):
    """A real failed build: an empty extension cache and no working C++ compiler (CXX=false)."""
    code = (
        "import torch\nfrom swbert.runtime.optim import build_optimizer\n"
        "build_optimizer(torch.nn.Linear(4, 4), 1e-3, 0.01, kind='fused_adam')\n"
    )
    env = job_env(CXX="false", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode != 0
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(
        "ValueError: --optimizer fused_adam: DeepSpeed's FusedAdam could not be built ("
    ), error
    assert "or run with --optimizer torch_adamw" in error
    assert ("CUDA toolkit matching torch's CUDA" if torch.version.cuda else "C++ compiler") in error


def test_a_lock_left_by_a_killed_fused_adam_build_is_named(tmp_path, monkeypatch):
    """torch's extension builder waits forever on the lock file a killed build leaves behind."""
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = Path(_get_build_directory("fused_adam", verbose=False)) / "lock"
    lock.touch()
    stale = time.time() - 3600
    os.utime(lock, (stale, stale))
    with pytest.raises(
        ValueError,
        match=rf"^--optimizer fused_adam: {lock} is the lock of an extension build that was killed",
    ):
        build_optimizer(torch.nn.Linear(4, 4), 1e-3, 0.01, kind="fused_adam")
