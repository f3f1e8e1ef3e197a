"""The attention variants, the heads and the Hugging Face integration."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from transformers import (
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
)

from swbert import (
    SWBertConfig,
    SWBertForMaskedLM,
    SWBertForQuestionAnswering,
    SWBertForSequenceClassification,
    SWBertModel,
)
from swbert.convert import fused_projections, separate_projections
from swbert.models.attention import (
    EagerKernel,
    SDPAKernel,
    SharedAttention,
    build_attention,
    pack_heads,
    unpack_heads,
)
from tests.model_helpers import PAPER_VARIANTS, with_eager_kernels


def tiny(**overrides) -> SWBertConfig:
    return SWBertConfig.from_size("tiny", vocab_size=101, max_position_embeddings=64, **overrides)


def batch(B: int = 2, S: int = 10) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 101, (B, S), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, S // 2 :] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("shared_bias", [True, False])
def test_shared_layer_equals_the_paper_formula_by_hand(shared_bias):
    torch.manual_seed(0)
    config = tiny(attention_type="shared", attention_probs_dropout_prob=0.0, shared_bias=shared_bias)
    attn = SharedAttention(config).eval()
    with torch.no_grad():
        for p in (attn.dq, attn.dk, attn.dv):
            p.uniform_(0.5, 1.5)  # away from the ones they start at
    x = torch.randn(2, 7, config.hidden_size)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 5:] = False
    # the paper's form (plus our bias bs): S = X Ws + bs; Q = S diag(dq); K = S diag(dk); V = S diag(dv);
    # per-head softmax attention
    Ws, bs = attn.proj.weight.T, attn.proj.bias
    assert (bs is not None) == shared_bias  # bs is ours; the paper's Table 3 form has none
    S = x @ Ws + (bs if shared_bias else 0)
    Q, K, V = S @ torch.diag(attn.dq), S @ torch.diag(attn.dk), S @ torch.diag(attn.dv)
    H, Dh = config.num_attention_heads, config.head_dim
    heads = []
    for h in range(H):
        sl = slice(h * Dh, (h + 1) * Dh)
        scores = Q[..., sl] @ K[..., sl].transpose(-1, -2) / math.sqrt(Dh)
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        heads.append(scores.softmax(-1) @ V[..., sl])
    expected = torch.cat(heads, dim=-1) @ attn.out_proj.weight.T + attn.out_proj.bias
    got = attn(x, mask[:, None, None, :])
    assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert attn.proj.weight.shape == (config.hidden_size, config.hidden_size)  # one d x d matrix
    folded = SharedAttention(config).eval()
    folded.load_state_dict(attn.state_dict())
    folded.fold_for_inference()
    assert_close(folded(x, mask[:, None, None, :]), expected, rtol=1e-5, atol=1e-5)


def test_shared_without_bias_saves_and_loads_as_such(tmp_path):
    torch.manual_seed(0)
    model = SWBertForMaskedLM(tiny(attention_type="shared", shared_bias=False)).eval()
    assert not any(n.endswith("attn.proj.bias") for n, _ in model.named_parameters())
    perturb_(model)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    assert loaded.config.shared_bias is False and loaded.bert.encoder.layers[0].attn.proj.bias is None
    inputs = batch()
    assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)
    # a config saved before the field existed has the bias, as those models do
    assert SWBertConfig.from_dict({"attention_type": "shared"}).shared_bias is True
    with pytest.raises(ValueError, match="shared_bias='no' must be true or false"):
        tiny(shared_bias="no")


def test_an_export_with_the_old_attention_kernel_field_loads_and_is_saved_without_it(tmp_path):
    """swbert once wrote the inner kernel (`"attention_kernel": "sdpa"`) into every config.json; such
    folders load (to the one kernel every model builds) and are saved without the field."""
    torch.manual_seed(0)
    model = SWBertForMaskedLM(tiny()).eval()
    model.save_pretrained(tmp_path / "new")
    written = json.loads((tmp_path / "new" / "config.json").read_text())
    assert "attention_kernel" not in written
    model.save_pretrained(tmp_path / "old")
    (tmp_path / "old" / "config.json").write_text(json.dumps({**written, "attention_kernel": "eager"}))
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path / "old").eval()
    assert not hasattr(loaded.config, "attention_kernel")
    assert {type(m) for m in loaded.modules()} >= {SDPAKernel} and EagerKernel not in map(
        type, loaded.modules()
    )
    inputs = batch()
    assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)
    loaded.save_pretrained(tmp_path / "resaved")
    assert "attention_kernel" not in json.loads((tmp_path / "resaved" / "config.json").read_text())
    with pytest.raises(ValueError, match="unknown SWBertConfig field 'attention_kernel'"):
        tiny(attention_kernel="eager")  # not a setting: an override naming it is a typo


def test_shared_scores_are_symmetric_in_the_tokens():
    """Q K^T = S diag(dq*dk) S^T: symmetric for any fixed dq*dk (property over random draws)."""
    config = tiny(attention_type="shared")
    for seed in range(5):
        torch.manual_seed(seed)
        attn = SharedAttention(config)
        with torch.no_grad():
            attn.dq.normal_()
            attn.dk.copy_(torch.randn(config.hidden_size))
        x = torch.randn(3, 9, config.hidden_size)
        q, k, _ = attn.paper_qkv(x)
        scores = q @ k.transpose(-1, -2)  # (B, H, S, S)
        assert_close(scores, scores.transpose(-1, -2), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(q, k)  # symmetric although Q != K
        # only the product dq*dk matters
        with torch.no_grad():
            attn.dq.mul_(2.0)
            attn.dk.div_(2.0)
        q2, k2, _ = attn.paper_qkv(x)
        assert_close(q2 @ k2.transpose(-1, -2), scores, rtol=1e-5, atol=1e-5)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attention_type", PAPER_VARIANTS)
@pytest.mark.parametrize("form", ["labels", "positions"])
@pytest.mark.parametrize("masked_only", [True, False])
@pytest.mark.parametrize("last_layer_on_labels", [True, False])
def test_every_masked_lm_form_gives_the_full_models_loss_logits_and_gradients(
    attention_type, form, masked_only, last_layer_on_labels
):
    """The one masked-LM path, every way in: labels (B, S) or static positions (B, P) with padding;
    logits at the predicted rows or everywhere; the last layer on those rows or on all. Each gives the
    loss, logits and every gradient of the full model's logits with the loss taken at the labelled
    positions (transformers' BertForMaskedLM's convention)."""
    torch.manual_seed(0)
    model = SWBertForMaskedLM(tiny(attention_type=attention_type)).eval()  # eval: no dropout
    model.last_layer_on_labels = last_layer_on_labels
    inputs = batch()
    where = (torch.tensor([0, 0, 1]), torch.tensor([1, 6, 3]))  # labelled (sequence, position)
    targets = torch.tensor([7, 50, 99])
    full = model(**inputs).logits  # (B, S, V)
    F.cross_entropy(full[where], targets).backward()
    expected = _grads(model)
    model.zero_grad()
    if form == "labels":
        labels = torch.full_like(inputs["input_ids"], -100)
        labels[where] = targets
        out = model(**inputs, labels=labels, masked_logits_only=masked_only)
        predicted = out.logits
    else:  # P = 2 per sequence, the second of sequence 1 padding
        positions, padded_targets = torch.tensor([[1, 6], [3, 0]]), torch.tensor([[7, 50], [99, -100]])
        out = model(
            **inputs, mlm_positions=positions, mlm_targets=padded_targets, masked_logits_only=masked_only
        )
        predicted = out.logits[:3] if masked_only else out.logits
    out.loss.backward()
    assert_close(out.loss, F.cross_entropy(full[where], targets))
    assert_close(predicted, full[where] if masked_only else full)
    got = _grads(model)
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_masked_lm_defaults_follow_transformers_in_eval_and_the_rows_in_training():
    """Without `masked_logits_only`: eval mode with labels returns every position's logits (pipelines,
    Trainer.evaluate); training, or static positions in any mode, the predicted rows only."""
    torch.manual_seed(0)
    model = SWBertForMaskedLM(tiny()).eval()
    inputs = batch()
    labels = torch.full_like(inputs["input_ids"], -100)
    labels[0, [0, 3, 7]] = 9
    assert model(**inputs, labels=labels).logits.shape == (2, 10, 101)
    positions, targets = torch.tensor([[1, 2], [3, 4]]), torch.tensor([[5, 6], [7, 8]])
    assert model(**inputs, mlm_positions=positions, mlm_targets=targets).logits.shape == (4, 101)
    assert model.train()(**inputs, labels=labels).logits.shape == (3, 101)


def test_sdpa_and_eager_kernels_agree():
    torch.manual_seed(0)
    a = SWBertForMaskedLM(tiny()).eval()
    b = with_eager_kernels(SWBertForMaskedLM(tiny()).eval())
    b.load_state_dict(a.state_dict())
    inputs = batch()
    valid = inputs["attention_mask"].bool()
    assert_close(a(**inputs).logits[valid], b(**inputs).logits[valid], rtol=1e-5, atol=1e-5)


def perturb_(model: torch.nn.Module) -> None:
    """Move every parameter off its initial value, so a weight that is not saved (and is re-initialised
    on load: dq, dk, dv to ones, U to the identity) shows up as a different output."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)


def test_symmetric_and_pairwise_layers_equal_their_formulas_by_hand():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 64)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 5:] = False
    for variant in ("symmetric", "pairwise"):
        config = tiny(attention_type=variant, attention_probs_dropout_prob=0.0)
        attn = build_attention(config).eval()
        perturb_(attn)  # U away from the identity it starts at
        H, Dh = config.num_attention_heads, config.head_dim
        (Wq, Wv), (bq, bv) = (unpack_heads(t, 2, Dh) for t in (attn.in_proj.weight, attn.in_proj.bias))
        Q = x @ Wq.T + bq
        V = x @ Wv.T + bv
        heads = []
        for h in range(H):
            sl = slice(h * Dh, (h + 1) * Dh)
            U = attn.pair[h] if variant == "pairwise" else torch.eye(Dh)  # scores Q U Q^T; symmetric: K = Q
            scores = Q[..., sl] @ U @ Q[..., sl].transpose(-1, -2) / math.sqrt(Dh)
            scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
            heads.append(scores.softmax(-1) @ V[..., sl])
        expected = torch.cat(heads, dim=-1) @ attn.out_proj.weight.T + attn.out_proj.bias
        assert_close(attn(x, mask[:, None, None, :]), expected, rtol=1e-5, atol=1e-5)
        assert not hasattr(attn, "k_proj") and attn.in_proj.weight.shape == (2 * 64, 64)  # Wq, Wv: no Wk


def test_packed_rows_are_ordered_by_heads():
    """(H, parts, Dh) rows: contiguous chunks are whole heads of every part, so splitting the fused
    matrix by rows over k ranks gives each rank the same heads of Wq, Wk and Wv."""
    H, Dh, d = 4, 3, 5
    parts = [torch.randn(H * Dh, d) for _ in range(3)]
    fused = pack_heads(parts, Dh)
    assert fused.shape == (3 * H * Dh, d)
    assert torch.equal(fused[:Dh], parts[0][:Dh]) and torch.equal(fused[Dh : 2 * Dh], parts[1][:Dh])
    assert torch.equal(fused[3 * Dh : 4 * Dh], parts[0][Dh : 2 * Dh])  # head 1 of Wq after head 0's Wv
    for k in (1, 2, 4):
        for rank, chunk in enumerate(fused.chunk(k)):
            assert torch.equal(chunk, pack_heads([p.chunk(k)[rank] for p in parts], Dh))
    assert all(torch.equal(a, b) for a, b in zip(unpack_heads(fused, 3, Dh), parts))
    biases = [torch.randn(H * Dh) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(unpack_heads(pack_heads(biases, Dh), 2, Dh), biases))


def _separate_qkv(attn, x):
    """Q, K, V as the variants computed them before the fusion: one nn.Linear per projection."""
    out = {name: attn.split_heads(linear(x)) for name, linear in attn.separate.items()}  # (B, H, S, Dh)
    q, v = out["q_proj"], out["v_proj"]
    k = out.get("k_proj", q)  # symmetric: K = Q
    if hasattr(attn, "pair"):
        k = q @ attn.pair.transpose(-1, -2)  # pairwise: K = Q U^T
    return q, k, v


def _with_separate_projections(model: SWBertForMaskedLM) -> SWBertForMaskedLM:
    """The model with every fused projection replaced by separate nn.Linear copies of its parts."""
    for layer in model.bert.encoder.layers:
        attn = layer.attn
        names = type(attn).packed["in_proj"]
        weights = unpack_heads(attn.in_proj.weight.detach(), len(names), attn.head_dim)
        biases = unpack_heads(attn.in_proj.bias.detach(), len(names), attn.head_dim)
        attn.separate = torch.nn.ModuleDict()
        for name, w, b in zip(names, weights, biases):
            linear = torch.nn.Linear(w.shape[1], w.shape[0])
            with torch.no_grad():
                linear.weight.copy_(w)
                linear.bias.copy_(b)
            attn.separate[name] = linear
        del attn.in_proj
        attn.qkv = lambda x, attn=attn: _separate_qkv(attn, x)
    return model


@pytest.mark.parametrize("variant", ["standard", "symmetric", "pairwise"])
def test_fused_projection_equals_separate_projections(variant):
    """One (parts*d x d) GEMM gives the outputs and gradients of the separate projections."""
    torch.manual_seed(0)
    config = tiny(attention_type=variant, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    fused = SWBertForMaskedLM(config).train()
    perturb_(fused)  # biases and U away from their initial values
    separate = _with_separate_projections(SWBertForMaskedLM(config).train())
    separate.load_state_dict(fused.state_dict(), strict=False)
    with torch.no_grad():
        for layer, ref in zip(fused.bert.encoder.layers, separate.bert.encoder.layers):
            names = type(layer.attn).packed["in_proj"]
            for kind in ("weight", "bias"):
                parts = unpack_heads(getattr(layer.attn.in_proj, kind), len(names), config.head_dim)
                for name, t in zip(names, parts):
                    getattr(ref.attn.separate[name], kind).copy_(t)
    inputs = batch()  # with padding
    labels = inputs["input_ids"].clone()
    labels[inputs["attention_mask"] == 0] = -100
    got, expected = fused(**inputs, labels=labels), separate(**inputs, labels=labels)
    got.loss.backward()
    expected.loss.backward()
    assert_close(got.loss, expected.loss)
    assert_close(got.logits, expected.logits)
    ref_grads = dict(separate.named_parameters())
    for name, p in fused.named_parameters():
        if ".in_proj." in name:
            prefix, kind = name.rsplit(".in_proj.", 1)
            names = type(fused.bert.encoder.layers[0].attn).packed["in_proj"]
            parts = [ref_grads[f"{prefix}.separate.{n}.{kind}"].grad for n in names]
            assert_close(p.grad, pack_heads(parts, config.head_dim), msg=name)
        else:
            assert_close(p.grad, ref_grads[name].grad, msg=name)


@pytest.mark.parametrize("variant", ["standard", "symmetric", "pairwise"])
def test_separate_projections_are_the_folder_form_and_state_dicts_hold_the_fused_one(variant, tmp_path):
    """Hugging Face folders store the separate projections (q_proj, k_proj, v_proj: BERT's query, key
    and value) and load back; a state dict holds the fused one only: the separate ones are named as
    unexpected (an older swbert's checkpoint is rewritten by `swbert.upgrade`, not read), and
    `fused_projections` packs them back exactly."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = SWBertForMaskedLM(tiny(attention_type=variant)).eval()
    perturb_(model)
    separate = separate_projections(model)
    assert "bert.encoder.layers.1.attn.q_proj.weight" in separate
    assert not any(".in_proj." in k for k in separate)
    missing, unexpected = SWBertForMaskedLM(tiny(attention_type=variant)).load_state_dict(
        separate, strict=False
    )
    assert "bert.encoder.layers.0.attn.in_proj.weight" in missing
    assert "bert.encoder.layers.0.attn.q_proj.weight" in unexpected
    fused = fused_projections(dict(separate), model.config)
    assert fused.keys() == model.state_dict().keys()
    assert all(torch.equal(fused[k], v) for k, v in model.state_dict().items())
    # the folder's tensors are the separate ones
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert not any(".in_proj." in k for k in saved)
    assert all(torch.equal(saved[k], separate[k]) for k in saved)
    inputs = batch()
    assert torch.equal(
        SWBertForMaskedLM.from_pretrained(tmp_path).eval()(**inputs).logits, model(**inputs).logits
    )


@pytest.mark.parametrize("variant", PAPER_VARIANTS)
def test_every_variant_trains_and_round_trips(variant, tmp_path):
    torch.manual_seed(0)
    model = SWBertForMaskedLM(tiny(attention_type=variant))
    attn = model.bert.encoder.layers[0].attn
    if variant == "shared":  # the diagonals start at ones (our initialisation)
        assert all(torch.equal(p, torch.ones(64)) for p in (attn.dq, attn.dk, attn.dv))
    if variant == "pairwise":
        assert torch.equal(attn.pair, torch.eye(16).expand(4, 16, 16))
    inputs = batch()
    labels = inputs["input_ids"].clone()
    labels[inputs["attention_mask"] == 0] = -100
    out = model(**inputs, labels=labels)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), [
        n for n, g in grads.items() if g is None
    ]
    perturb_(model)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    model.eval()
    for loaded in (
        SWBertForMaskedLM.from_pretrained(tmp_path),
        AutoModelForMaskedLM.from_pretrained(tmp_path),
    ):
        assert type(loaded) is SWBertForMaskedLM and loaded.config.attention_type == variant
        assert loaded.mlm_head.decoder.weight is loaded.bert.embeddings.word_embeddings.weight
        assert torch.equal(loaded.eval()(**inputs).logits, model(**inputs).logits)
    assert type(AutoModel.from_pretrained(tmp_path)) is SWBertModel


@pytest.mark.parametrize("variant", ["standard", "shared"])
def test_classification_and_qa_heads_round_trip_through_the_auto_classes(variant, tmp_path):
    torch.manual_seed(0)
    inputs = batch()
    for cls, auto in (
        (SWBertForSequenceClassification, AutoModelForSequenceClassification),
        (SWBertForQuestionAnswering, AutoModelForQuestionAnswering),
    ):
        model = cls(tiny(attention_type=variant, num_labels=3))
        perturb_(model)
        model.save_pretrained(tmp_path / cls.__name__)
        loaded = auto.from_pretrained(tmp_path / cls.__name__).eval()
        assert type(loaded) is cls and loaded.config.attention_type == variant
        expected, got = model.eval()(**inputs), loaded(**inputs)
        for key in ("logits", "start_logits", "end_logits"):
            if key in expected:
                assert torch.equal(got[key], expected[key]), key


def test_variants_differ_in_attention_parameters_only():
    counts = {}
    for variant in PAPER_VARIANTS:
        model = SWBertModel(tiny(attention_type=variant), add_pooling_layer=False)
        counts[variant] = {
            n: p.numel() for n, p in model.named_parameters() if ".attn." in n and "out_proj" not in n
        }
    d, h = 64, 4
    assert sum(counts["standard"].values()) == 2 * (3 * d * d + 3 * d)
    assert sum(counts["shared"].values()) == 2 * (d * d + 4 * d)
    assert sum(counts["symmetric"].values()) == 2 * (2 * d * d + 2 * d)
    assert sum(counts["pairwise"].values()) == 2 * (2 * d * d + 2 * d + h * (d // h) ** 2)


def test_classification_regression_and_qa_heads():
    torch.manual_seed(0)
    inputs = batch()
    clf = SWBertForSequenceClassification(tiny(num_labels=3))
    out = clf(**inputs, labels=torch.tensor([0, 2]))
    assert out.logits.shape == (2, 3) and clf.config.problem_type == "single_label_classification"
    assert_close(out.loss, F.cross_entropy(out.logits, torch.tensor([0, 2])))
    reg = SWBertForSequenceClassification(tiny(num_labels=1))
    out = reg(**inputs, labels=torch.tensor([0.5, 4.0]))
    assert reg.config.problem_type == "regression"
    assert_close(out.loss, F.mse_loss(out.logits.squeeze(-1), torch.tensor([0.5, 4.0])))
    qa = SWBertForQuestionAnswering(tiny())
    out = qa(**inputs, start_positions=torch.tensor([1, 2]), end_positions=torch.tensor([3, 4]))
    assert out.start_logits.shape == (2, 10) and out.loss.ndim == 0
    out.loss.backward()


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match="attention_type='sharde' is not one of standard, shared"):
        SWBertConfig(attention_type="sharde")
    with pytest.raises(ValueError, match="size huge is not one of tiny.*nor LxW"):
        SWBertConfig.from_size("huge")
    # a misspelt override is an error, not an ignored attribute; transformers' own keys still pass
    with pytest.raises(
        ValueError, match="unknown SWBertConfig field 'attention'; did you mean 'attention_type'"
    ):
        SWBertConfig.from_size("tiny", attention="symmetric")
    with pytest.raises(
        ValueError, match="unknown SWBertConfig field 'hiden_size'; did you mean 'hidden_size'"
    ):
        SWBertConfig.from_size("tiny", hiden_size=32)
    config = SWBertConfig.from_size(
        "tiny", num_labels=3, tie_word_embeddings=False, problem_type="regression"
    )
    assert (config.num_labels, config.tie_word_embeddings, config.problem_type) == (3, False, "regression")
    with pytest.raises(
        ValueError,
        match="hidden_size=100 is not divisible by num_attention_heads=12; .* one of 1, 2, 4, 5, 10, 20, 25, 50, 100$",
    ):
        SWBertConfig(hidden_size=100)
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        SWBertModel(tiny())(input_ids=torch.zeros(1, 65, dtype=torch.long))
