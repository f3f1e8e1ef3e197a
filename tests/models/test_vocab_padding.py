"""A vocabulary padded to a multiple of 128 (config.pad_vocab_multiple, pretraining's default) is the
same model as the unpadded one: same weights from a seed, same loss, logits and gradients, padded
ids never predicted, and exports trimmed back to the tokenizer's size."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForMaskedLM

from swbert.models import SWBertConfig, SWBertForMaskedLM, SWBertForSequenceClassification
from swbert.models.flops import masked_lm_params
from swbert.params import count_instantiated
from swbert.training.checkpoint import mark_complete

VOCAB = 100  # padded to 128


def config(pad: int = 128, **overrides: object) -> SWBertConfig:
    return SWBertConfig.from_size(
        "tiny", vocab_size=VOCAB, max_position_embeddings=64, pad_vocab_multiple=pad, **overrides
    )


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, 7:] = 0
    labels = torch.where(torch.rand(ids.shape, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def pair(variant: str = "shared") -> tuple[SWBertForMaskedLM, SWBertForMaskedLM]:
    """Unpadded and padded models built from the same seed."""
    models = []
    for pad in (1, 128):
        torch.manual_seed(0)
        models.append(SWBertForMaskedLM(config(pad, attention_type=variant)))
    return models[0], models[1]


def test_padded_rows_and_what_a_seed_draws():
    plain, padded = pair()
    emb = padded.bert.embeddings.word_embeddings
    assert emb.weight.shape == (128, 64) and padded.config.padded_vocab_size == 128
    assert padded.mlm_head.decoder.weight is emb.weight  # still tied
    assert padded.mlm_head.decoder.bias.shape == (128,)
    assert torch.count_nonzero(emb.weight[VOCAB:]) == 0  # padding: zeros, never looked up
    # the seed draws the same real weights: padding changes nothing a run starts from
    for name, t in plain.state_dict().items():
        assert torch.equal(padded.state_dict()[name][: t.shape[0]], t), name
    assert count_instantiated(padded.config) == masked_lm_params(padded.config)
    assert masked_lm_params(padded.config) - masked_lm_params(plain.config) == 28 * (64 + 1)


@pytest.mark.parametrize("variant", ["shared", "standard"])
def test_loss_logits_and_gradients_equal_the_unpadded_model(variant):
    plain, padded = pair(variant)
    inputs = batch()
    for train in (True, False):
        for m in (plain, padded):
            m.train(train)
            m.zero_grad()
        torch.manual_seed(1)  # the same dropout masks
        expected = plain(**inputs)
        torch.manual_seed(1)
        got = padded(**inputs)
        assert got.logits.shape == expected.logits.shape  # (N, 100) in training, (B, S, 100) in eval
        assert got.logits.shape[-1] == VOCAB
        assert_close(got.loss, expected.loss)
        assert_close(got.logits, expected.logits)
        got.loss.backward()
        expected.loss.backward()
        grads = dict(padded.named_parameters())
        for name, p in plain.named_parameters():
            g = grads[name].grad
            assert_close(g[: p.shape[0]], p.grad, msg=name)
            assert torch.count_nonzero(g[p.shape[0] :]) == 0, name  # padded rows: no gradient
    without_labels = {k: v for k, v in inputs.items() if k != "labels"}
    assert padded.eval()(**without_labels).logits.shape == (3, 12, VOCAB)


def test_padded_ids_are_never_predicted():
    """Whatever the padded rows hold, their logits are not among the outputs nor in the loss."""
    _, padded = pair()
    padded.eval()
    inputs = batch()
    before = padded(**inputs)
    with torch.no_grad():
        padded.mlm_head.decoder.bias[VOCAB:] = 1e4  # would win every argmax if they were logits
    after = padded(**inputs)
    assert_close(after.loss, before.loss)
    assert_close(after.logits, before.logits)
    assert int(after.logits.argmax(-1).max()) < VOCAB


def test_trim_keeps_the_function_and_exports_load_at_the_tokenizers_size(tmp_path):
    """The export trims the tables back to vocab_size: a plain folder of a vocab_size model."""
    from swbert.training.export import export

    plain, padded = pair()
    with torch.no_grad():
        for p in padded.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # the padded rows too: trimming drops them
    tag_dir = tmp_path / "step_00000004"
    tag_dir.mkdir()
    torch.save({"module": padded.state_dict()}, tag_dir / "mp_rank_00_model_states.pt")
    mark_complete(tag_dir, 4, {"model_config": padded.config.to_dict()})  # today's format
    out = export(tag_dir, tmp_path / "export")
    saved = json.loads((out / "config.json").read_text())
    assert saved["vocab_size"] == VOCAB and saved["pad_vocab_multiple"] == 1
    loaded = AutoModelForMaskedLM.from_pretrained(out).eval()
    assert loaded.bert.embeddings.word_embeddings.weight.shape == (VOCAB, 64)
    assert loaded.mlm_head.decoder.weight is loaded.bert.embeddings.word_embeddings.weight
    inputs = batch()
    assert_close(loaded(**inputs).logits, padded.eval()(**inputs).logits)
    assert_close(loaded(**inputs).loss, padded(**inputs).loss)
    # in place, on a head without a decoder too
    torch.manual_seed(0)
    classifier = SWBertForSequenceClassification(config(num_labels=2)).eval()
    expected = classifier(input_ids=inputs["input_ids"]).logits
    classifier.trim_vocab_padding()
    assert classifier.bert.embeddings.word_embeddings.num_embeddings == VOCAB
    assert_close(classifier(input_ids=inputs["input_ids"]).logits, expected)


def test_pretraining_pads_to_128_by_default():
    from swbert.training.build import build_model_config
    from swbert.training.config import TrainConfig, build_config

    assert TrainConfig().pad_vocab_multiple == 128
    built = build_model_config(
        build_config("tiny_cpu", []), SimpleNamespace(vocab_size=96, special_ids=SimpleNamespace(pad=0))
    )
    assert (built.vocab_size, built.padded_vocab_size) == (96, 128)  # the config keeps the tokenizer's
    off = build_model_config(
        build_config("tiny_cpu", ["--pad-vocab-multiple", "1"]),
        SimpleNamespace(vocab_size=96, special_ids=SimpleNamespace(pad=0)),
    )
    assert off.padded_vocab_size == 96
    with pytest.raises(ValueError, match="pad_vocab_multiple=0 must be positive"):
        build_config("tiny_cpu", ["--pad-vocab-multiple", "0"])


def test_a_padded_standard_model_converts_to_bert_at_the_tokenizers_size():
    from swbert.convert import to_hf_bert

    _, padded = pair("standard")
    bert = to_hf_bert(padded.eval()).eval()
    assert bert.config.vocab_size == VOCAB and bert.bert.embeddings.word_embeddings.num_embeddings == VOCAB
    assert padded.config.pad_vocab_multiple == 128  # converted from a copy: the model keeps its rows
    inputs = batch()
    assert_close(bert(**inputs).logits, padded(**inputs).logits, rtol=1e-5, atol=1e-5)
