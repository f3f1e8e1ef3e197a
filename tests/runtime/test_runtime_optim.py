"""Unit tests of the optimizer's parameter groups and the learning-rate schedule
(swbert.runtime.optim), shared by pretraining and fine-tuning."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from swbert.models import SWBertConfig, SWBertForMaskedLM
from swbert.runtime.optim import (
    apply_hyperparameters,
    build_optimizer,
    build_scheduler,
    lr_factor,
    param_groups,
    resolve_optimizer,
    schedule_change,
)


def _tiny() -> nn.Module:
    config = SWBertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, attention_variant="shared",
    )  # fmt: skip
    return SWBertForMaskedLM(config)


def test_matrices_and_embeddings_decay_biases_norms_and_scales_do_not():
    model = _tiny()
    decay, no_decay = param_groups(model, 0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    undecayed = {names[id(p)] for p in no_decay["params"]}
    assert decayed and undecayed and not decayed & undecayed
    assert decayed | undecayed == set(names.values())
    assert any("word_embeddings" in n for n in decayed)
    assert all(not n.endswith(".bias") and "LayerNorm" not in n for n in decayed)
    assert any(n.endswith(("dq", "dk", "dv")) for n in undecayed)  # the shared layer's diagonals


def test_frozen_parameters_are_left_out():
    model = _tiny()
    model.get_input_embeddings().weight.requires_grad_(False)
    grouped = [p for g in param_groups(model, 0.1) for p in g["params"]]
    assert all(p is not model.get_input_embeddings().weight for p in grouped)


def test_auto_optimizer_and_offload():
    assert resolve_optimizer("auto", offload=False) == "torch_adamw"
    assert resolve_optimizer("auto", offload=True) == "cpu_adam"
    with pytest.raises(ValueError, match="--optimizer torch_adamw cannot run with ZeRO optimizer offload"):
        build_optimizer(_tiny(), 1e-3, 0.1, kind="torch_adamw", offload=True)
    opt = build_optimizer(_tiny(), 1e-3, 0.1, betas=(0.9, 0.98), eps=1e-6)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["betas"] == (0.9, 0.98) and opt.param_groups[0]["eps"] == 1e-6


def test_linear_warmup_then_linear_decay_to_the_floor():
    f = lr_factor(total=110, warmup=10, schedule="linear", floor=0.1)
    assert [f(s) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert f(9) == pytest.approx(1.0) and f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)


def test_cosine_and_constant_schedules():
    cos = lr_factor(total=100, warmup=0, schedule="cosine")
    assert cos(0) == pytest.approx(1.0) and cos(100) == pytest.approx(0.0)
    assert cos(50) == pytest.approx(0.5)
    assert cos(25) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    const = lr_factor(total=100, warmup=4, schedule="constant")
    assert const(1) == pytest.approx(0.5) and const(4) == const(99) == 1.0


def test_the_scheduler_steps_the_factor_once_per_step():
    opt = build_optimizer(_tiny(), 1e-3, 0.0)
    sched = build_scheduler(opt, total=10, warmup=2)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    factor = lr_factor(10, 2)
    assert lrs == pytest.approx([1e-3 * factor(s) for s in range(4)])


def test_settings_given_on_resume_replace_the_restored_ones_and_say_so():
    opt = build_optimizer(_tiny(), 1e-3, 0.1)
    sched = build_scheduler(opt, total=10, warmup=0)
    for _ in range(5):
        opt.step()
        sched.step()
    changes = apply_hyperparameters(opt, sched, 2e-3, 0.01, (0.9, 0.95), 1e-8)
    assert "lr: 0.001 -> 0.002" in changes and "weight_decay: 0.1 -> 0.01" in changes
    assert any(c.startswith("betas:") for c in changes) and len(changes) == len(set(changes))
    assert opt.param_groups[0]["weight_decay"] == 0.01 and opt.param_groups[1]["weight_decay"] == 0.0
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-3 * lr_factor(10, 0)(5))
    assert apply_hyperparameters(opt, sched, 2e-3, 0.01, (0.9, 0.95), 1e-8) == []


def test_a_longer_run_says_where_its_lr_goes():
    said = schedule_change(100, 200, 100, 1e-3, 0, "linear", 0.0)
    assert "spans 200 steps instead of 100" in said and "step 101 runs at LR 0.0005" in said
    assert "no step runs" in schedule_change(100, 50, 80, 1e-3, 0, "linear", 0.0)
    assert "stays (constant schedule)" in schedule_change(100, 200, 10, 1e-3, 0, "constant", 0.0)
