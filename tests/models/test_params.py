"""Parameter and FLOP accounting against the paper and the hand formulas of DESIGN.md."""

import pytest

from swbert import SWBertConfig
from swbert.models.attention import attention_class
from swbert.models.flops import layer_forward_flops, masked_lm_flops, masked_lm_params, qkv_params
from swbert.params import PAPER_BASE_TOTALS, count_attention_block, count_instantiated, table
from tests.model_helpers import PAPER_VARIANTS

EXPECTED_BASE = {
    "standard": 109_514_298,
    "symmetric": 102_427_194,
    "pairwise": 103_017_018,
    "shared": 95_367_738,
}


@pytest.mark.parametrize("variant", PAPER_VARIANTS)
def test_base_counts_from_instantiated_models(variant):
    config = SWBertConfig.from_size("base", attention_type=variant)
    assert count_instantiated(config) == EXPECTED_BASE[variant]
    assert masked_lm_params(config) == EXPECTED_BASE[variant]


def test_paper_figures_and_reconciliation():
    for variant in ("standard", "symmetric", "pairwise"):
        assert PAPER_BASE_TOTALS[variant] == EXPECTED_BASE[variant]
    gap = EXPECTED_BASE["shared"] - PAPER_BASE_TOTALS["shared"]
    assert gap == 30_520  # within two of the decoder bias (vocab 30,522)
    text = table("base")
    assert "30,520" in text and "66.54%" in text and "95,367,738" in text


@pytest.mark.parametrize("size", ["tiny", "small", "large"])
def test_formula_matches_models_at_other_sizes(size):
    for variant in PAPER_VARIANTS:
        config = SWBertConfig.from_size(size, attention_type=variant)
        assert count_instantiated(config) == masked_lm_params(config)


def test_xl_size_is_over_one_billion():
    assert count_instantiated(SWBertConfig.from_size("xl", attention_type="shared")) > 1_000_000_000


def test_attention_block_counts_from_instantiated_layers():
    d, h, dh = 768, 12, 64
    expected = {
        "standard": 3 * (d * d + d),
        "shared": d * d + 4 * d,
        "symmetric": 2 * (d * d + d),
        "pairwise": 2 * (d * d + d) + h * dh * dh,
    }
    for variant in PAPER_VARIANTS:
        config = SWBertConfig.from_size("base", attention_type=variant)
        assert count_attention_block(config) == qkv_params(config) == expected[variant], variant
    assert count_attention_block(SWBertConfig.from_size("base", attention_type="shared")) == 592_896
    assert "592,896" in table("base")


def test_qkv_reduction_at_768():
    std = qkv_params(SWBertConfig.from_size("base", attention_type="standard"))
    shared = qkv_params(SWBertConfig.from_size("base", attention_type="shared"))
    assert std == 3 * 768**2 + 3 * 768 and shared == 768**2 + 4 * 768
    assert round(100 * (1 - shared / std), 2) == 66.54


def test_flops_match_the_hand_formula():
    d, s = 768, 128
    std = SWBertConfig.from_size("base", attention_type="standard")
    shared = SWBertConfig.from_size("base", attention_type="shared")
    assert layer_forward_flops(std, s) == 24 * d * d + 4 * s * d
    assert layer_forward_flops(shared, s) == 20 * d * d + 4 * s * d
    # K = Q: one projection fewer; pairwise adds K = Q U^T, a Dh x Dh product per head
    symmetric = SWBertConfig.from_size("base", attention_type="symmetric")
    pairwise = SWBertConfig.from_size("base", attention_type="pairwise")
    assert layer_forward_flops(symmetric, s) == 22 * d * d + 4 * s * d
    assert layer_forward_flops(pairwise, s) == 22 * d * d + 2 * d * 64 + 4 * s * d
    speedup = (
        masked_lm_flops(std, s, last_layer_on_predicted=False).encoder
        / masked_lm_flops(shared, s, last_layer_on_predicted=False).encoder
    )
    assert 1.19 <= speedup < 1.20
    # the last layer's output projection and MLP (18 d^2 of it) on the predicted 15% only
    full, pruned = (masked_lm_flops(std, s, 0.15, last_layer_on_predicted=x).encoder for x in (False, True))
    assert full == 12 * (24 * d * d + 4 * s * d)
    assert full - pruned == pytest.approx(0.85 * 18 * d * d)
    assert masked_lm_flops(std, s, 1.0).encoder == full  # every position predicted: nothing to skip
    # the MLM head on 15% of tokens vs on all of them
    head_all = masked_lm_flops(std, s, 1.0).mlm_head
    assert masked_lm_flops(std, s, 0.15).mlm_head == pytest.approx(0.15 * head_all)
    assert head_all == 2 * d * d + 2 * d * 30522
    assert masked_lm_flops(std, s).training == 3 * masked_lm_flops(std, s).forward


def test_shared_without_bias_is_the_papers_table_3_form():
    """bs is ours: shared_bias=False gives Ws and the diagonals only, d^2 + 3d per layer."""
    d, L = 768, 12
    with_bias = SWBertConfig.from_size("base", attention_type="shared")
    without = SWBertConfig.from_size("base", attention_type="shared", shared_bias=False)
    assert with_bias.shared_bias and count_attention_block(with_bias) == d * d + 4 * d == 592_896
    assert count_attention_block(without) == qkv_params(without) == d * d + 3 * d == 592_128
    assert attention_class("shared").closed_form_qkv_params(without) == 592_128
    assert count_instantiated(without) == masked_lm_params(without) == 95_367_738 - L * d == 95_358_522
    rows = {line.split("  ")[0].strip(): line for line in table("base").splitlines()}
    assert rows["shared, no bs"].split()[3:6] == ["592,128", "592,128", "95,358,522"]
    paper = [
        line.split()[-3:] for line in table("base").splitlines() if line.startswith(" ") and "no bs" in line
    ]
    assert paper == [["95,337,218", "95,358,522", "21,304"]]  # against the paper's printed total too
    # the other variants have no bs: the field changes nothing for them
    for variant in ("standard", "symmetric", "pairwise"):
        config = SWBertConfig.from_size("base", attention_type=variant, shared_bias=False)
        assert count_instantiated(config) == EXPECTED_BASE[variant]


def test_the_training_config_sets_shared_bias():
    from types import SimpleNamespace

    from swbert.training.build import build_model_config
    from swbert.training.config import TrainConfig, build_config

    assert TrainConfig().shared_bias is True  # checkpoints trained so far have bs
    cfg = build_config("tiny_cpu", ["--shared-bias", "false"])
    config = build_model_config(cfg, SimpleNamespace(vocab_size=96, special_ids=SimpleNamespace(pad=0)))
    assert config.shared_bias is False and count_attention_block(config) == 64 * 64 + 3 * 64
