"""Batch resolution on a cluster's data-parallel sizes: global = micro x data-parallel ranks x
accumulation, with the recipe's micro-batch as the most one rank runs per pass.

Every shipped recipe either keeps its global batch on 1 GPU, 8 GPUs (one node), 64 GPUs (8 nodes x 8)
and 2 nodes x 8 GPUs at tensor-parallel size 2, or is refused with a message that names the nearest
global batches that run there, each of which then resolves.
"""

from __future__ import annotations

import logging
import re

import pytest

from swbert.runtime.ranks import ParallelDims
from swbert.training import build
from swbert.training.config import RECIPES_DIR, TrainConfig, build_config, nearest_global_batches

# (GPUs, tensor-parallel size): one GPU, one node of 8, 8 nodes of 8, and 2 nodes of 8 at TP 2 and
# 8 nodes of 8 at TP 2 (data-parallel sizes 1, 8, 64, 8 and 32).
LAYOUTS = [(1, 1), (8, 1), (64, 1), (16, 2), (64, 2)]

# recipe -> data-parallel size -> (global, micro, accumulation), or the nearest global batches a
# refusal names. The recipes' global batches are never changed.
EXPECTED: dict[str, dict[int, tuple[int, int, int] | list[int]]] = {
    "default": {1: (32, 16, 2), 8: (32, 4, 1), 64: [64], 32: (32, 1, 1)},
    "tiny_cpu": {1: (8, 4, 2), 8: (8, 1, 1), 64: [64], 32: [32]},
    # the paper's 528 = 4 x 132: 8 ranks run 66 each (as docs/pretraining.md says), 64 do not divide it
    "paper_base": {1: (528, 132, 4), 8: (528, 66, 1), 64: [512, 576], 32: [512, 544]},
    # ours, 4096 at a most of 256 per pass: 2 per step on a node, one of 64 each on 8 nodes
    "base_shared": {1: (4096, 256, 16), 8: (4096, 256, 2), 64: (4096, 64, 1), 32: (4096, 128, 1)},
    # ours: the modern recipe at mini (the default's batches) and at base (512 at a most of 32 per pass)
    "modern": {1: (32, 16, 2), 8: (32, 4, 1), 64: [64], 32: (32, 1, 1)},
    "modern_base": {1: (512, 32, 16), 8: (512, 32, 2), 64: (512, 8, 1), 32: (512, 16, 1)},
}


def test_every_recipe_is_in_the_table():
    assert sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("world, tp", LAYOUTS, ids=[f"{w}gpus-tp{t}" for w, t in LAYOUTS])
@pytest.mark.parametrize("recipe", sorted(EXPECTED))
def test_recipe_resolves_or_names_the_nearest_global_batch(recipe: str, world: int, tp: int):
    # document attention (the modern recipes') does not run under tensor parallelism yet
    tensor_parallel = ["--tensor-parallel", str(tp), "--document-attention", "false"]
    cfg = build_config(recipe, tensor_parallel if tp > 1 else [])
    dp = ParallelDims.plan(world, cfg.tensor_parallel).dp_size
    expected = EXPECTED[recipe][dp]
    if isinstance(expected, tuple):
        layout = cfg.batch_layout(dp)
        assert layout == expected
        g, micro, accum = layout
        assert g == micro * dp * accum == cfg.global_batch_size and micro <= cfg.micro_batch_size
        return
    with pytest.raises(ValueError) as refused:
        cfg.batch_layout(dp)
    message = str(refused.value)
    assert f"{cfg.global_batch_size} is not divisible by {dp} data-parallel ranks" in message
    named = [int(g) for g in re.findall(r"--global-batch-size (\d+)", message)]
    assert named == expected, message
    for g in named:  # each batch the refusal names runs there, at the recipe's micro-batch at most
        g_out, micro, accum = build_config(recipe, ["--global-batch-size", str(g)]).batch_layout(dp)
        assert g_out == g == micro * dp * accum and micro <= cfg.micro_batch_size


def test_layouts_that_divide_evenly_are_unchanged():
    """Where micro-batch x ranks divides the global batch (every layout that ran before the micro-batch
    became a most), nothing is lowered: the golden-loss runs (tiny_cpu on 1 and 2 ranks) are these."""
    for g in range(1, 130):
        for micro in range(1, 9):
            for dp in range(1, 9):
                if g % (micro * dp) == 0:
                    layout = TrainConfig(global_batch_size=g, micro_batch_size=micro).batch_layout(dp)
                    assert layout == (g, micro, g // (micro * dp)), (g, micro, dp)


def test_a_share_that_is_no_whole_number_of_micro_batches_is_refused():
    """A rank's share at or above the micro-batch is never lowered silently (6 per rank at most 4 per
    pass would become 3 or 1 per pass): the refusal names the micro-batch that keeps the global
    batch and the nearest global batches at this one."""
    with pytest.raises(ValueError) as refused:
        TrainConfig(global_batch_size=6, micro_batch_size=4).batch_layout(1)
    message = str(refused.value)
    assert "global_batch_size=6 is not divisible by micro_batch_size=4" in message  # as before
    assert "--micro-batch-size 3" in message
    assert "--global-batch-size 4 or --global-batch-size 8" in message
    assert TrainConfig(global_batch_size=6, micro_batch_size=3).batch_layout(1) == (6, 3, 2)


def test_grad_accum_steps_given_must_agree_exactly():
    """All three given: nothing is derived or lowered (tests/e2e/test_multinode.py pins two ranks so)."""
    pinned = TrainConfig(global_batch_size=8, micro_batch_size=4, grad_accum_steps=1)
    assert pinned.batch_layout(2) == (8, 4, 1)
    with pytest.raises(ValueError, match=r"!= micro_batch_size=4 x 1 data-parallel ranks x grad_accum"):
        pinned.batch_layout(1)
    with pytest.raises(ValueError, match="drop --grad-accum-steps"):  # would otherwise lower to 1 per pass
        pinned.batch_layout(8)


def _runs(global_batch: int, micro: int, dp: int) -> bool:
    try:
        TrainConfig(global_batch_size=global_batch, micro_batch_size=micro).batch_layout(dp)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("dp", [1, 2, 3, 8, 12])
@pytest.mark.parametrize("micro", [1, 2, 4, 5])
def test_nearest_global_batches_are_the_nearest_that_run(micro: int, dp: int):
    """Against a search of every global batch: the largest below and the smallest above that resolve."""
    runs = [g for g in range(1, 200) if _runs(g, micro, dp)]
    for g in range(1, 120):
        below = [r for r in runs if r < g]
        expected = ([below[-1]] if below else []) + [next(r for r in runs if r > g)]
        assert nearest_global_batches(g, micro, dp) == expected, (g, micro, dp)


def test_the_run_plan_lowers_the_micro_batch_and_says_so(monkeypatch, caplog):
    """base_shared on 64 ranks: the plan, the DeepSpeed config, the memory check and the config the
    loader and the saved run read all carry the micro-batch that runs (64), and a status line says so."""
    for key, value in {"WORLD_SIZE": "64", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    # room for 64 sequences of 128 tokens at size base on a CPU (1.7 GiB), not for 256 (6.9 GiB)
    monkeypatch.setattr(build, "device_memory", lambda on_gpu: 3 << 30)
    monkeypatch.setattr(build.torch.cuda, "is_available", lambda: False)
    cfg = build_config("base_shared", ["--compile", "off"])
    with caplog.at_level(logging.INFO, logger="swbert.status"):
        plan = build.plan_run(cfg)
    batch, ds = plan.batch, plan.ds_config
    assert (plan.dims.dp_size, batch.global_batch, batch.micro_batch, batch.accum) == (64, 4096, 64, 1)
    assert ds["train_batch_size"] == 4096 and ds["train_micro_batch_size_per_gpu"] == 64
    assert ds["gradient_accumulation_steps"] == 1
    assert cfg.micro_batch_size == 64 and cfg.global_batch_size == 4096
    assert "micro-batch 64 per rank" in caplog.text and "micro_batch_size=256" in caplog.text
    # on one node nothing is lowered, and nothing is said
    monkeypatch.setenv("WORLD_SIZE", "8")
    caplog.clear()
    cfg = build_config("base_shared", ["--compile", "off"])
    monkeypatch.setattr(build, "device_memory", lambda on_gpu: 16 << 30)
    with caplog.at_level(logging.INFO, logger="swbert.status"):
        plan = build.plan_run(cfg)
    assert (plan.batch.micro_batch, plan.batch.accum, cfg.micro_batch_size) == (256, 2, 256)
    assert "micro-batch" not in caplog.text
