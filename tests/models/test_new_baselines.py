"""The two baselines of later QKV-sharing work (ours, not the paper's variants): `qkv_single`
(Q = K = V = X Ws + bs, no diagonals) and `kv_shared` (Q from its own projection, K = V from one
shared projection). Counts against their closed forms, each layer against its definition written
out, qkv_single against the shared variant with unit diagonals, and TP=2 against TP=1."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from transformers import AutoModelForMaskedLM

from swbert.models import SWBertConfig, SWBertForMaskedLM
from swbert.models.attention import attention_class, unpack_heads
from swbert.models.flops import layer_forward_flops, masked_lm_params, qkv_params
from swbert.parallel.plan import attention_plan
from swbert.params import count_attention_block, count_instantiated, table
from swbert.scaling.activations import attention_trace
from tests.parallel.test_parallel_harness import mlm_batch, reference_model, run_ranks, tiny_config
from tests.parallel.test_parallel_model import _check_variant

NEW = ("qkv_single", "kv_shared")


def written_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """softmax(Q K^T / sqrt(Dh)) V per head, from (B, S, d) tensors; (B, S, d)."""
    B, S, d = q.shape

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(B, S, heads, d // heads).transpose(1, 2)  # (B, H, S, Dh)

    q, k, v = split(q), split(k), split(v)
    probs = (q @ k.transpose(-1, -2) / math.sqrt(d // heads)).softmax(-1)  # (B, H, S, S)
    return (probs @ v).transpose(1, 2).reshape(B, S, d)


@pytest.mark.parametrize("size", ["tiny", "base"])
@pytest.mark.parametrize("shared_bias", [True, False])
def test_parameter_counts_equal_the_closed_forms(size, shared_bias):
    """qkv_single: d^2 + d (d^2 without bs); kv_shared: 2(d^2 + d); whole models as built."""
    for variant in NEW:
        config = SWBertConfig.from_size(size, attention_type=variant, shared_bias=shared_bias)
        d = config.hidden_size
        expected = d * d + (d if shared_bias else 0) if variant == "qkv_single" else 2 * (d * d + d)
        assert attention_class(variant).closed_form_qkv_params(config) == expected, variant
        assert qkv_params(config) == count_attention_block(config) == expected, variant
        assert count_instantiated(config) == masked_lm_params(config), variant
    if size == "base" and shared_bias:  # against BERT-base's attention: 66.7% and 33.3% fewer
        standard = qkv_params(SWBertConfig.from_size("base", attention_type="standard"))
        single = qkv_params(SWBertConfig.from_size("base", attention_type="qkv_single"))
        kv = qkv_params(SWBertConfig.from_size("base", attention_type="kv_shared"))
        assert (single, kv, standard) == (590_592, 1_181_184, 1_771_776)
        text = table("base")
        assert "qkv_single" in text and "kv_shared" in text and "qkv_single, no bs" in text


def test_flop_counts_equal_the_closed_forms():
    """Forward FLOPs per token and layer with f = 4d: qkv_single 20 d^2 + 4 s d (shared's, without
    its elementwise scalings), kv_shared 22 d^2 + 4 s d (standard's is 24 d^2 + 4 s d)."""
    for s in (128, 512):
        for variant, coefficient in (("qkv_single", 20), ("kv_shared", 22), ("standard", 24)):
            config = SWBertConfig.from_size("base", attention_type=variant)
            d = config.hidden_size
            assert config.intermediate_size == 4 * d
            assert layer_forward_flops(config, s) == coefficient * d * d + 4 * s * d, variant


def test_the_tensor_parallel_plans_split_every_parameter_by_heads():
    assert attention_class("qkv_single").tp_plan() == {"proj": "column", "out_proj": "row"}
    assert attention_class("kv_shared").tp_plan() == {"in_proj": "column", "out_proj": "row"}
    for variant in NEW:  # every parameter placed (the plan refuses one it does not place)
        assert attention_plan(SWBertForMaskedLM(tiny_config(variant)).bert.encoder.layers[0].attn)


def test_the_declared_activation_units_are_what_the_layer_keeps():
    """Per token, (units - 26) d bytes plus the fp32 log-sum-exp of each head (as the paper's variants
    are held in tests/scaling/test_memory_estimate.py): qkv_single keeps S alone, kv_shared Q and K = V."""
    for variant in NEW:
        config = SWBertConfig.from_size("base", attention_type=variant)
        d, h = config.hidden_size, config.num_attention_heads
        per_token = (attention_trace(config, 1, 16).saved - attention_trace(config, 1, 8).saved) / 8
        assert per_token == (attention_class(variant).activation_units - 26) * d + 4 * h, variant


@pytest.mark.parametrize("shared_bias", [True, False])
def test_qkv_single_is_the_shared_variant_with_unit_diagonals(shared_bias):
    """The same Ws (and bs) loaded into both: the same logits, loss and gradients of Ws, bs."""
    config = tiny_config("qkv_single", shared_bias=shared_bias)
    single = reference_model(config)
    shared = SWBertForMaskedLM(tiny_config("shared", shared_bias=shared_bias))
    missing, unexpected = shared.load_state_dict(single.state_dict(), strict=False)
    assert unexpected == [] and {k.rsplit(".", 1)[-1] for k in missing} == {"dq", "dk", "dv"}
    layer = shared.bert.encoder.layers[0].attn
    assert all(torch.equal(p, torch.ones_like(p)) for p in (layer.dq, layer.dk, layer.dv))
    batch = mlm_batch(seed=3, vocab=config.vocab_size)
    want, got = shared(**batch), single(**batch)
    assert_close(got.logits, want.logits)
    assert_close(got.loss, want.loss)
    want.loss.backward()
    got.loss.backward()
    ref = dict(shared.named_parameters())
    for name, p in single.named_parameters():
        assert_close(p.grad, ref[name].grad, msg=lambda m, n=name: f"{n}: {m}")
    # and the layer against its definition: softmax(S S^T / sqrt(Dh)) S, then the output projection
    attn = single.bert.encoder.layers[1].attn.eval()
    x = torch.randn(2, 9, config.hidden_size)
    s = attn.proj(x)
    expected = attn.out_proj(written_out(s, s, s, config.num_attention_heads))
    assert_close(attn(x), expected, rtol=1e-5, atol=1e-6)


def test_kv_shared_keys_are_its_values_and_the_queries_have_their_own_projection():
    config = tiny_config("kv_shared")
    attn = reference_model(config).bert.encoder.layers[0].attn.eval()
    x = torch.randn(2, 9, config.hidden_size)
    q, k, v = attn.qkv(x)
    assert torch.equal(k, v) and not torch.equal(q, k)
    wq, wkv = unpack_heads(attn.in_proj.weight, 2, config.head_dim)
    bq, bkv = unpack_heads(attn.in_proj.bias, 2, config.head_dim)
    q_ref, kv_ref = F.linear(x, wq, bq), F.linear(x, wkv, bkv)  # (B, S, d) each
    heads = config.num_attention_heads
    assert_close(attn.merge_heads(q, None), q_ref, rtol=1e-5, atol=1e-6)
    assert_close(attn.merge_heads(k, None), kv_ref, rtol=1e-5, atol=1e-6)
    expected = attn.out_proj(written_out(q_ref, kv_ref, kv_ref, heads))
    assert_close(attn(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", NEW)
def test_each_baseline_trains_and_round_trips_through_a_hugging_face_folder(variant, tmp_path):
    """Saved with the separate projections (kv_shared's q_proj and kv_proj), loaded back exactly."""
    model = reference_model(tiny_config(variant))
    batch = mlm_batch(seed=4, vocab=model.config.vocab_size)
    model(**batch).loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    model.eval().save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "model.safetensors")
    if variant == "kv_shared":
        assert "bert.encoder.layers.0.attn.kv_proj.weight" in saved
        assert not any(".in_proj." in k for k in saved)
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    assert loaded.config.attention_type == variant
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)


def _both_baselines() -> None:
    for variant in NEW:
        for sequence_parallel in (False, True):
            _check_variant(variant, sequence_parallel)
    _check_variant("qkv_single", False, shared_bias=False)


@pytest.mark.slow
def test_tp2_equals_tp1_for_both_baselines():
    """Real 2-rank gloo groups: loss, logits, gathered gradients and state dicts equal TP=1's."""
    run_ranks(_both_baselines, 2)
