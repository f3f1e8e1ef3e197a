"""Tokenizer training: specials at fixed ids, and the HF folder encodes as SentencePiece does."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from pydoc_data.topics import topics

import pytest
import sentencepiece as spm

from data_prep.sources import InputError
from data_prep.train_tokenizer import BYTE_FALLBACK_MIN_VOCAB, TokenizerConfig, train_tokenizer
from swbert.cli import field_descriptions
from swbert.data import SPECIAL_TOKENS, load_tokenizer, tokenizer_hash


def fuzz_lines(seed: int = 0, count: int = 400) -> list[str]:
    """Whitespace runs, tabs, newlines, accents, CJK, emoji, control characters, repeated symbols."""
    rng = random.Random(seed)
    fixed = ["", " ", "  two  spaces  ", "\ttab\nnewline\r\n", "naïve café Ünïcödé", "日本語のテキスト", "😀 ☃",
             "ﬁ ① ＡＢＣ", "\x00\x01 control", "zero\u200bwidth", "==================", "3.14159 1,000,000"]  # fmt: skip
    alphabet = list("abcdefghij =-._*#éü日😀\t") + ["th", "an", "==", "--", "  "]
    return fixed + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "topics.jsonl"
    with open(path, "w", encoding="utf-8") as stream:
        for name in sorted(topics)[:30]:
            stream.write(json.dumps({"text": topics[name]}) + "\n")
    return path


@pytest.mark.parametrize(
    ("model_type", "vocab_size", "byte_fallback"),
    [("bpe", 1200, True), ("bpe", 300, False), ("unigram", 1000, True)],
)
def test_hf_folder_encodes_like_sentencepiece(
    corpus: Path, tmp_path: Path, model_type: str, vocab_size: int, byte_fallback: bool
) -> None:
    info = train_tokenizer([str(corpus)], tmp_path, vocab_size=vocab_size, model_type=model_type, threads=1)
    assert info["byte_fallback"] is byte_fallback  # on by default from 1000 pieces
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "spm.model"))
    hf = load_tokenizer(tmp_path)
    assert info["hash"] == tokenizer_hash(tmp_path) and sp.get_piece_size() == len(hf) == vocab_size
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert sp.id_to_piece(token_id) == token and hf.convert_tokens_to_ids(token) == token_id
    assert [hf.pad_token_id, hf.unk_token_id, hf.cls_token_id, hf.sep_token_id, hf.mask_token_id] == [
        0,
        1,
        2,
        3,
        4,
    ]

    natural = [line for text in topics.values() for line in text.split("\n") if line.strip()][::5]
    lines = natural + fuzz_lines()
    mismatches = 0
    for line in lines:
        ours, theirs = sp.encode(line), hf(line, add_special_tokens=False)["input_ids"]
        if ours != theirs:
            mismatches += 1
            # Unigram only: another segmentation of the same text with exactly the same score.
            assert model_type == "unigram", line
            assert sp.decode(ours) == sp.decode(theirs), line
            score = sum(sp.get_score(i) for i in ours) - sum(sp.get_score(i) for i in theirs)
            assert abs(score) < 1e-3, line
    assert mismatches <= 0.02 * len(lines)
    pair = hf("first text", "second")
    assert pair["input_ids"][0] == 2 and pair["input_ids"].count(3) == 2 and pair["input_ids"][-1] == 3
    assert set(pair["token_type_ids"]) == {0, 1}
    if byte_fallback:
        assert sp.unk_id() not in sp.encode("rare: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢")  # bytes, not [UNK]
        text = "Hello, naïve world!"
        assert hf.decode(hf(text)["input_ids"], skip_special_tokens=True) == text


def test_special_strings_in_text_never_become_special_ids(corpus: Path, tmp_path: Path) -> None:
    train_tokenizer([str(corpus)], tmp_path, vocab_size=1200, threads=1)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "spm.model"))
    ids = sp.encode("a [MASK] and a [SEP] in raw text")  # what preprocessing stores
    assert not set(ids) & {0, 1, 2, 3, 4}
    hf_ids = load_tokenizer(tmp_path)("x [MASK] y", add_special_tokens=False)["input_ids"]
    assert 4 in hf_ids  # while the HF tokenizer maps a typed [MASK] to the mask id, for fill-mask


def test_training_refuses_to_replace_a_tokenizer_and_bad_vocab(corpus: Path, tmp_path: Path) -> None:
    train_tokenizer([str(corpus)], tmp_path, vocab_size=700, threads=1)
    with pytest.raises(InputError, match="--overwrite"):
        train_tokenizer([str(corpus)], tmp_path, vocab_size=700, threads=1)
    with pytest.raises(InputError, match="vocab-size"):
        train_tokenizer([str(corpus)], tmp_path / "huge", vocab_size=200_000, threads=1)


def test_sampling_is_bounded_and_deterministic(corpus: Path, tmp_path: Path) -> None:
    first = train_tokenizer(
        [str(corpus)], tmp_path / "a", vocab_size=700, max_sentences=300, seed=1, threads=1
    )
    again = train_tokenizer(
        [str(corpus)], tmp_path / "b", vocab_size=700, max_sentences=300, seed=1, threads=1
    )
    assert first["sentences_sampled"] == 300 < first["sentences_seen"]
    assert first["hash"] == again["hash"]


def test_help_documents_every_flag() -> None:
    described = field_descriptions(TokenizerConfig)
    for f in dataclasses.fields(TokenizerConfig):
        assert f.name in described, f.name
    assert f"--vocab-size {BYTE_FALLBACK_MIN_VOCAB}" in described["byte_fallback"]


def test_lowercase_tokenizer_is_uncased_everywhere(corpus: Path, tmp_path: Path) -> None:
    """--lowercase: BERT-uncased's lower-casing and accent stripping live in spm.model itself, so the
    shard writer's SentencePiece, the HF folder (what fine-tuning and exports load) and the identity
    agree; the manifest of shards built with it says so. The default stays cased."""
    from data_prep.preprocess import preprocess
    from data_prep.train_tokenizer import main

    args = ["--input", str(corpus), "--vocab-size", "300", "--threads", "1"]
    assert main([*args, "--output", str(tmp_path / "uncased"), "--lowercase"]) == 0
    cased = train_tokenizer([str(corpus)], tmp_path / "cased", vocab_size=300, threads=1)
    info = json.loads((tmp_path / "uncased" / "swbert_tokenizer.json").read_text())
    assert info["lowercase"] is True and cased["lowercase"] is False
    assert info["hash"] == tokenizer_hash(tmp_path / "uncased") != cased["hash"]
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "uncased" / "spm.model"))
    hf = load_tokenizer(tmp_path / "uncased")
    for text in ("Héllo World", "He\u0301llo\tWORLD", "ＨＥＬＬＯ World"):  # composed, combining, full-width
        assert sp.encode(text) == sp.encode("hello world") == hf(text, add_special_tokens=False)["input_ids"]
    assert 4 in hf("x [MASK] y", add_special_tokens=False)["input_ids"]  # a typed [MASK] stays special
    cased_sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "cased" / "spm.model"))
    assert cased_sp.encode("Héllo World") != cased_sp.encode("hello world")
    lines = [line for line in fuzz_lines() if line.strip()]
    assert [hf(x, add_special_tokens=False)["input_ids"] for x in lines] == sp.encode(lines)
    out = tmp_path / "shards"
    preprocess([str(corpus)], tmp_path / "uncased", out, workers=1)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"] == {**manifest["tokenizer"], "lowercase": True, "hash": info["hash"]}
