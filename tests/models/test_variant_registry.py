"""A variant is one class that knows itself: a fifth attention variant, registered in this file alone,
gets everything swbert derives from a variant class (config validation, parameter and FLOP counts,
the parameter table, tensor parallelism, the memory estimate) with no edit under swbert/.

The toy variant is registered by a module fixture and unregistered after, so other test modules see
the paper's four only. Ranks started by `run_ranks` (fresh processes) register it themselves.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from swbert.models import SWBertConfig, SWBertForMaskedLM
from swbert.models.attention import (
    SelfAttention,
    attention_class,
    attention_types,
    meta_attention,
    register_attention,
    unregister_attention,
)
from swbert.models.flops import layer_forward_flops, masked_lm_flops, masked_lm_params, qkv_params
from swbert.parallel import destroy, initialize, parallelize
from swbert.parallel.layers import ColumnLinear
from swbert.parallel.plan import attention_plan, partition_dim
from swbert.params import count_attention_block, count_instantiated, table
from swbert.scaling.activations import activation_memory
from swbert.scaling.grid import build_grid, estimate
from swbert.scaling.memory import Layout, model_state_bytes, model_tensors, params_per_rank
from swbert.scaling.report import line_style
from swbert.training.config import TrainConfig
from tests.model_helpers import BUILTIN_VARIANTS, PAPER_VARIANTS
from tests.parallel.test_parallel_harness import run_ranks, tiny_config
from tests.parallel.test_parallel_model import _check_variant

NAME = "test_kv_gain"  # not a name anyone would choose for a real variant


class KVGainAttention(SelfAttention):
    """Q = X Wq + bq;  K = X Wkv + bkv;  V = K * g, with a learned per-feature gain g (ones at init).

    One projection serves keys and values; g is a per-head parameter split by heads and an
    elementwise product, which FLOP counts leave out.
    """

    qkv_plan = {"q_proj": "column", "kv_proj": "column", "gain": "heads"}

    def __init__(self, config: SWBertConfig) -> None:
        super().__init__(config)
        d = config.hidden_size
        self.q_proj = nn.Linear(d, d)
        self.kv_proj = nn.Linear(d, d)
        self.gain = nn.Parameter(torch.empty(d))
        self.init_parameters()

    @torch.no_grad()
    def init_parameters(self) -> None:
        self.gain.fill_(1.0)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kv = self.kv_proj(x)  # (B, S, d)
        return self.split_heads(self.q_proj(x)), self.split_heads(kv), self.split_heads(kv * self.gain)


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_attention(NAME)(KVGainAttention)
    yield
    unregister_attention(NAME)


def test_the_registry_accepts_the_new_name_everywhere_a_name_is_checked():
    assert attention_types() == (*BUILTIN_VARIANTS, NAME)
    assert attention_class(NAME) is KVGainAttention and KVGainAttention.attention_type == NAME
    assert SWBertConfig.from_size("tiny", attention_type=NAME).attention_type == NAME
    TrainConfig(size="tiny", attention_type=NAME).check()
    assert [p.attention for p in build_grid(["tiny"], [NAME], ["z0"])] == [NAME]
    listed = f"{', '.join(BUILTIN_VARIANTS)}, {NAME}"
    with pytest.raises(ValueError, match=f"attention_type='nope' is not one of {listed}"):
        SWBertConfig(attention_type="nope")
    with pytest.raises(ValueError, match=f"attention_type='nope' is not one of {listed}"):
        TrainConfig(attention_type="nope").check()
    with pytest.raises(ValueError, match=f"known: {listed}"):
        build_grid(["tiny"], ["nope"], ["z0"])
    register_attention(NAME)(KVGainAttention)  # the same class again: a no-op

    class Other(KVGainAttention):
        pass

    with pytest.raises(ValueError, match=f"{NAME!r} is already registered to KVGainAttention"):
        register_attention(NAME)(Other)
    with pytest.raises(ValueError, match="not among"):
        register_attention("test_bad_plan")(
            type("BadPlan", (KVGainAttention,), {"qkv_plan": {"q_proj": "col"}})
        )
    assert attention_types()[-1] == NAME
    unregister_attention(NAME)
    try:
        with pytest.raises(ValueError, match=f"attention_type='{NAME}' is not one of"):
            SWBertConfig(attention_type=NAME)
    finally:
        register_attention(NAME)(KVGainAttention)


def test_parameter_counts_come_from_the_class():
    config = tiny_config(NAME)
    d = config.hidden_size
    model = SWBertForMaskedLM(config)
    attn = model.bert.encoder.layers[0].attn
    assert type(attn) is KVGainAttention
    per_layer = 2 * (d * d + d) + d  # Wq, Wkv, their biases and g
    assert qkv_params(config) == count_attention_block(config) == per_layer
    total = sum(p.numel() for p in model.parameters())
    assert count_instantiated(config) == masked_lm_params(config) == total
    # the params table has a row for it, with no closed form ("-") and the model's counts
    tiny_total = count_instantiated(SWBertConfig.from_size("tiny", attention_type=NAME))
    row = next(line for line in table("tiny").splitlines() if line.startswith(NAME))
    assert row.split()[1:4] == [f"{per_layer:,}", "-", f"{tiny_total:,}"]
    # its own initialisation, through the model's _init_weights
    assert torch.equal(attn.gain, torch.ones(d))
    with torch.no_grad():
        attn.gain.add_(1.0)
    model._init_weights(attn)
    assert torch.equal(attn.gain, torch.ones(d))


def test_flops_come_from_the_class():
    config = SWBertConfig.from_size("base", attention_type=NAME)
    d, f, L, V, s = 768, 3072, 12, 30522, 128
    layer = 2 * (2 * d * d) + 2 * d * d + 4 * d * f + 4 * s * d  # Wq, Wkv; out_proj; MLP; QK^T, AV
    assert layer_forward_flops(config, s) == layer
    last = layer - 0.85 * (2 * d * d + 4 * d * f)  # the last layer's out_proj and MLP on 15% of rows
    got = masked_lm_flops(config, s, predicted_fraction=0.15)
    assert got.encoder == pytest.approx((L - 1) * layer + last, rel=1e-12)
    assert got.mlm_head == pytest.approx(0.15 * (2 * d * d + 2 * d * V), rel=1e-12)
    assert meta_attention(config).extra_flops_per_token() == 0


def test_memory_tensors_are_the_models_with_the_plan_deciding_the_shards():
    config = tiny_config(NAME)
    with torch.device("meta"):
        model = SWBertForMaskedLM(config)
    tensors = {t.name: t for t in model_tensors(config)}
    assert {n: p.numel() for n, p in model.named_parameters()} == {n: t.numel for n, t in tensors.items()}
    attn = {n: t.tp_sharded for n, t in tensors.items() if ".layers.0.attn." in n}
    assert attn == {
        "bert.encoder.layers.0.attn.out_proj.weight": True,
        "bert.encoder.layers.0.attn.out_proj.bias": False,  # added once, after the all-reduce
        "bert.encoder.layers.0.attn.q_proj.weight": True,
        "bert.encoder.layers.0.attn.q_proj.bias": True,
        "bert.encoder.layers.0.attn.kv_proj.weight": True,
        "bert.encoder.layers.0.attn.kv_proj.bias": True,
        "bert.encoder.layers.0.attn.gain": True,
    }
    assert partition_dim("bert.encoder.layers.1.attn.gain", config) == 0
    assert params_per_rank(config) == sum(p.numel() for p in model.parameters())
    point = build_grid(["tiny"], [NAME], ["tp2-z1"])[0]
    assert estimate(point, gpus=2, vocab_size=128)["params"] == count_instantiated(point.model_config(128))
    # Q, K and V kept apart: the default activation units, the same bytes as standard's
    standard = tiny_config("standard")
    assert activation_memory(config, 128, 8, tp=2).peak == activation_memory(standard, 128, 8, tp=2).peak


@pytest.mark.parametrize("size", ["tiny", "base", "xl"])
def test_the_builtin_closed_forms_equal_the_derived_counts(size):
    """The hand formulas (standard 3(d^2+d) as in the paper's Table 3; shared d^2+d+3d, the paper's
    d^2+3d plus our bias bs; ...) stay as documentation that must agree with what is read off the built
    layers; the new variant has none."""
    for variant in PAPER_VARIANTS:
        config = SWBertConfig.from_size(size, attention_type=variant)
        assert attention_class(variant).closed_form_qkv_params(config) == qkv_params(config), variant
    assert KVGainAttention.closed_form_qkv_params(tiny_config(NAME)) is None


def test_plot_styles_follow_the_registration_order():
    assert [line_style(v) for v in PAPER_VARIANTS] == ["--", "-", ":", "-."]  # as before the registry
    assert line_style(NAME) == ":" and line_style("not-registered") == "-"  # the 7th: the cycle's 3rd


def test_a_parameter_the_plan_does_not_place_is_refused():
    class Unplaced(KVGainAttention):
        qkv_plan = {"q_proj": "column", "kv_proj": "column"}  # g left out: wrong under TP

    with torch.device("meta"):
        attn = Unplaced(tiny_config(NAME))
    with pytest.raises(ValueError, match=r"\['gain'\] that its qkv_plan does not place"):
        attention_plan(attn)


def _tp2_equals_tp1_and_memory_matches() -> None:
    register_attention(NAME)(KVGainAttention)  # a rank is a fresh process: the fixture ran elsewhere
    for sequence_parallel in (False, True):
        _check_variant(NAME, sequence_parallel)  # loss, logits, gathered gradients, state dicts
    config = tiny_config(NAME)
    initialize(2)
    model = parallelize(SWBertForMaskedLM(config), 2)
    attn = model.bert.encoder.layers[0].attn
    assert isinstance(attn.kv_proj, ColumnLinear) and attn.gain.shape == (config.hidden_size // 2,)
    held = sum(p.numel() for p in model.parameters())  # this rank's shards, the tied decoder once
    assert params_per_rank(config, tp=2) == held < params_per_rank(config)
    states = model_state_bytes(config, Layout(tp=2, zero=0), dp=1, precision="fp32")
    assert states.params == states.grads == 4 * held
    destroy()


@pytest.mark.slow
def test_tp2_equals_tp1_and_the_memory_estimate_holds_the_real_shards():
    run_ranks(_tp2_equals_tp1_and_memory_matches, 2)
