"""Parameter and FLOP accounting against the paper and the hand formulas of DESIGN.md."""

import pytest

from swbert import ATTENTION_TYPES, SWBertConfig
from swbert.models.flops import layer_forward_flops, masked_lm_flops, masked_lm_params, qkv_params
from swbert.params import PAPER_BASE_TOTALS, count_attention_block, count_instantiated, table

EXPECTED_BASE = {
    "standard": 109_514_298,
    "symmetric": 102_427_194,
    "pairwise": 103_017_018,
    "shared": 95_367_738,
}


@pytest.mark.parametrize("variant", ATTENTION_TYPES)
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
    for variant in ATTENTION_TYPES:
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
    for variant in ATTENTION_TYPES:
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
