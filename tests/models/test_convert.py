"""Parity with transformers' BERT: the `standard` variant is the same model."""

import pytest
import torch
import transformers
from torch.testing import assert_close

from swbert import SWBertForMaskedLM, SWBertForQuestionAnswering, SWBertForSequenceClassification
from swbert.convert import from_hf_bert, main, to_hf_bert

HF_SMALL = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    attn_implementation="eager",
)


def padded_batch(vocab: int = 97) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # padding in the batch
    mask[2, 5:] = 0
    ids[mask == 0] = 0
    types = torch.zeros_like(ids)
    types[:, 6:] = 1
    return ids, mask, types


def perturb(model: torch.nn.Module) -> None:
    """Random values everywhere (biases and LayerNorms too), so no zero-init hides a mapping bug."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)


def test_masked_lm_parity_with_transformers():
    torch.manual_seed(0)
    hf = transformers.BertForMaskedLM(transformers.BertConfig(**HF_SMALL)).eval()
    perturb(hf)
    ours = from_hf_bert(hf).eval()
    assert isinstance(ours, SWBertForMaskedLM) and ours.config.attention_type == "standard"
    ids, mask, types = padded_batch()
    labels = torch.full_like(ids, -100)
    labels[0, [1, 4]] = ids[0, [1, 4]]
    labels[1, 2] = ids[1, 2]
    ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
    got_logits = ours(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    got = ours(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
    valid = mask.bool()
    assert_close(got_logits[valid], ref.logits[valid], rtol=1e-5, atol=1e-5)
    assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-5)
    # the round trip gives back identical weights
    back = to_hf_bert(ours)
    ref_state, back_state = hf.state_dict(), back.state_dict()
    assert ref_state.keys() == back_state.keys()
    for key in ref_state:
        assert torch.equal(ref_state[key], back_state[key]), key


def test_sequence_classification_parity_and_round_trip():
    torch.manual_seed(0)
    hf = transformers.BertForSequenceClassification(transformers.BertConfig(**HF_SMALL, num_labels=3)).eval()
    perturb(hf)
    ours = from_hf_bert(hf).eval()
    assert isinstance(ours, SWBertForSequenceClassification)
    ids, mask, types = padded_batch()
    labels = torch.tensor([0, 2, 1])
    ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
    got = ours(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
    assert_close(got.logits, ref.logits, rtol=1e-5, atol=1e-5)
    assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-5)
    back = to_hf_bert(ours)
    for key, value in hf.state_dict().items():
        assert torch.equal(value, back.state_dict()[key]), key


def test_question_answering_parity_and_round_trip():
    torch.manual_seed(0)
    hf = transformers.BertForQuestionAnswering(transformers.BertConfig(**HF_SMALL)).eval()
    perturb(hf)
    ours = from_hf_bert(hf).eval()
    assert isinstance(ours, SWBertForQuestionAnswering)
    ids, mask, types = padded_batch()
    # an end position past the sequence (answer cut off) is ignored by both
    spans = dict(start_positions=torch.tensor([1, 2, 0]), end_positions=torch.tensor([3, 6, 20]))
    ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, **spans)
    got = ours(input_ids=ids, attention_mask=mask, token_type_ids=types, **spans)
    valid = mask.bool()
    assert_close(got.start_logits[valid], ref.start_logits[valid], rtol=1e-5, atol=1e-5)
    assert_close(got.end_logits[valid], ref.end_logits[valid], rtol=1e-5, atol=1e-5)
    # ours leaves the padding out of the span softmax (transformers keeps it): the same loss on
    # transformers' logits with the padding masked
    S, lowest = ids.shape[1], torch.finfo(ref.start_logits.dtype).min
    ref_loss = (
        sum(
            torch.nn.functional.cross_entropy(
                logits.masked_fill(~valid, lowest), pos.clamp(0, S), ignore_index=S
            )
            for logits, pos in (
                (ref.start_logits, spans["start_positions"]),
                (ref.end_logits, spans["end_positions"]),
            )
        )
        / 2
    )
    assert_close(got.loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert not torch.isclose(got.loss, ref.loss)  # the batch is padded: the two conventions differ
    back = to_hf_bert(ours)
    for key, value in hf.state_dict().items():
        assert torch.equal(value, back.state_dict()[key]), key


def test_vocab_mismatch_and_unsupported_variant_are_clear_errors():
    hf = transformers.BertForMaskedLM(transformers.BertConfig(**HF_SMALL))
    with pytest.raises(ValueError, match="vocab_size mismatch.*97"):
        from_hf_bert(hf, vocab_size=120)
    shared = SWBertForMaskedLM(from_hf_bert(hf).config.__class__.from_size("tiny", attention_type="shared"))
    with pytest.raises(ValueError, match="attention_type='shared'.*only 'standard'"):
        to_hf_bert(shared)


def test_cli_converts_folders_both_ways(tmp_path):
    hf = transformers.BertForMaskedLM(transformers.BertConfig(**HF_SMALL)).eval()
    hf.save_pretrained(tmp_path / "hf")
    main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "sw")])
    main(["to-hf", str(tmp_path / "sw"), str(tmp_path / "hf2")])
    back = transformers.BertForMaskedLM.from_pretrained(tmp_path / "hf2").eval()
    ids, mask, _ = padded_batch()
    assert_close(
        back(input_ids=ids, attention_mask=mask).logits, hf(input_ids=ids, attention_mask=mask).logits
    )


def test_cli_copies_the_tokenizer_files_and_nothing_else(tmp_path):
    """The converted folder gets the tokenizer (it loads and encodes the same) and none of the other
    files beside it: a training record with corpus paths, notes."""
    hf = transformers.BertForMaskedLM(transformers.BertConfig(**HF_SMALL))
    hf.save_pretrained(tmp_path / "hf")
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    (tmp_path / "vocab.txt").write_text("\n".join(specials + [f"w{i}" for i in range(90)]) + "\n")
    transformers.BertTokenizer(str(tmp_path / "vocab.txt")).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "swbert_tokenizer.json").write_text('{"inputs": ["/data/corpus"]}')
    (tmp_path / "hf" / "notes_on_tokens.txt").write_text("private")
    main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "sw")])
    names = {p.name for p in (tmp_path / "sw").iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "README.md"} <= names  # README: how to load it
    assert not names & {"swbert_tokenizer.json", "notes_on_tokens.txt"}, names
    before = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")("w3 w7 w11")["input_ids"]
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "sw")("w3 w7 w11")["input_ids"] == before


def test_cli_refuses_a_foreign_tokenizer_and_an_unconvertible_variant(tmp_path, capsys):
    hf = transformers.BertForMaskedLM(transformers.BertConfig(**HF_SMALL))
    hf.save_pretrained(tmp_path / "hf")
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    (tmp_path / "vocab.txt").write_text("\n".join(specials + [f"w{i}" for i in range(115)]) + "\n")
    transformers.BertTokenizer(str(tmp_path / "vocab.txt")).save_pretrained(tmp_path / "hf")  # 120 > 97
    with pytest.raises(SystemExit) as exit_info:
        main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "sw")])
    assert exit_info.value.code == 2
    assert "tokenizer has 120 tokens" in capsys.readouterr().err
    assert not (tmp_path / "sw").exists()  # nothing half-written

    SWBertForMaskedLM(
        from_hf_bert(hf).config.__class__.from_size("tiny", attention_type="shared")
    ).save_pretrained(tmp_path / "shared")
    with pytest.raises(SystemExit):
        main(["to-hf", str(tmp_path / "shared"), str(tmp_path / "hf2")])
    assert "only 'standard'" in capsys.readouterr().err
