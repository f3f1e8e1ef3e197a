"""Train a SentencePiece tokenizer with BERT's special tokens at fixed ids.

    python -m data_prep.train_tokenizer --input PATH [PATH ...] --output DIR --vocab-size N

Reads every input once, keeps a uniform random sample of at most `--max-sentences` lines
(reservoir sampling: memory is bounded by the sample, not the corpus), trains on the sample,
and writes DIR/spm.model plus the Hugging Face files `AutoTokenizer.from_pretrained(DIR)` loads.
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from data_prep import cli
from data_prep.documents import DocumentReader, split_text
from data_prep.hf_tokenizer import build_fast_tokenizer, save_hf_folder
from data_prep.sources import InputError, ReadOptions, Source, plan_chunks, refuse_non_utf8, resolve_inputs
from data_prep.uncased import LOWERCASE_DESCRIPTION, write_rules
from swbert.cli import parse_or_exit
from swbert.data.tokenizer import (
    PAD_ID,
    SPECIAL_TOKENS,
    SPM_MODEL_NAME,
    TOKENIZER_INFO_NAME,
    UNK_ID,
    tokenizer_hash,
)

log = logging.getLogger("data_prep.train_tokenizer")
BYTE_FALLBACK_MIN_VOCAB = 1000
SENTENCE_CHARS = 2000  # longer lines are cut at whitespace: SentencePiece drops over-long sentences
OUTPUT_FILES = (
    SPM_MODEL_NAME,
    TOKENIZER_INFO_NAME,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
USAGE = (
    "usage: python -m data_prep.train_tokenizer --input PATH [PATH ...] --output DIR --vocab-size N "
    "[--key value ...]\n\n" + (__doc__ or "").split("\n\n")[0]
)


@dataclass(kw_only=True)
class TokenizerConfig(cli.InputOptions):
    """The command line of `python -m data_prep.train_tokenizer` (`swbert.cli`)."""

    output: str  # tokenizer folder to write
    # pieces in the vocabulary, the 5 specials (and 256 byte pieces, with byte fallback) included
    vocab_size: int
    # SentencePiece algorithm; the HF tokenizer matches BPE id for id, unigram up to ties between
    # equal-score segmentations
    model_type: Literal["bpe", "unigram"] = "bpe"
    max_sentences: int = 1_000_000  # lines sampled uniformly from the inputs to train on
    character_coverage: float = 0.9995  # share of characters covered by pieces; the rest fall back to bytes
    # encode characters outside the vocabulary as UTF-8 byte pieces instead of [UNK]; auto: yes from
    # --vocab-size 1000
    byte_fallback: Literal["auto", "yes", "no"] = "auto"
    seed: int = 0  # seed of the sampling
    # SentencePiece training threads; a unigram model depends on it, so fix it for reproducibility
    # (default: CPUs, at most 16)
    threads: int | None = None
    overwrite: bool = False  # replace an existing tokenizer in --output
    # lower-case and strip accents as BERT-uncased does (NFD, combining marks dropped), inside the
    # tokenizer itself: preprocessing and fine-tuning see the same text (off: cased, as before)
    lowercase: bool = False


def iter_sentences(sources: list[Source], options: ReadOptions, stats: Counter) -> Iterator[str]:
    """Every non-empty line of every document, in input order."""
    whole = plan_chunks(sources, 1 << 62, options)  # one chunk per input: no cutting needed here
    for chunk in whole:
        for piece in DocumentReader(sources[chunk.source], chunk, options, stats):
            for line in piece.text.split("\n"):
                if line.strip():
                    yield from split_text(line.strip(), SENTENCE_CHARS)


def sample_sentences(sentences: Iterator[str], max_sentences: int, seed: int) -> tuple[list[str], int]:
    """A uniform sample of at most `max_sentences` (reservoir sampling, deterministic given `seed`)."""
    rng = random.Random(seed)
    sample: list[str] = []
    seen = 0
    for seen, sentence in enumerate(sentences, start=1):
        if len(sample) < max_sentences:
            sample.append(sentence)
        else:
            j = rng.randrange(seen)
            if j < max_sentences:
                sample[j] = sentence
    return sample, seen


def train_tokenizer(
    inputs: list[str],
    output_dir: str | Path,
    *,
    vocab_size: int,
    model_type: Literal["bpe", "unigram"] = "bpe",
    max_sentences: int = 1_000_000,
    character_coverage: float = 0.9995,
    byte_fallback: bool | None = None,
    seed: int = 0,
    options: ReadOptions | None = None,
    hf_config: str | None = None,
    hf_split: str = "train",
    threads: int | None = None,
    overwrite: bool = False,
    check_encoding: bool = True,
    lowercase: bool = False,
) -> dict[str, Any]:
    """Train and save the tokenizer folder; returns what `swbert_tokenizer.json` records.

    `byte_fallback=None` turns byte fallback on from `BYTE_FALLBACK_MIN_VOCAB` pieces: below,
    256 byte pieces would crowd out the vocabulary of the tiny tokenizers tests and toy runs use.
    `lowercase` puts BERT-uncased normalization in the model's own rules (data_prep.uncased)."""
    started = time.perf_counter()
    options = options or ReadOptions()
    output_dir = Path(output_dir)
    byte_fallback = _check_request(output_dir, vocab_size, byte_fallback, overwrite)
    sources, _ = resolve_inputs(
        inputs,
        text_field=options.text_field,
        txt_documents=options.txt_documents,
        hf_config=hf_config,
        hf_split=hf_split,
    )
    if check_encoding:  # an explicit --invalid-utf8 reads any file
        refuse_non_utf8(sources)
    sample, seen, stats = _sample(sources, options, max_sentences, seed)
    settings = {
        "vocab_size": vocab_size, "model_type": model_type, "character_coverage": character_coverage,
        "byte_fallback": byte_fallback, "lowercase": lowercase, "seed": seed,
        "threads": threads or min(os.cpu_count() or 1, 16),
    }  # fmt: skip
    tmp = output_dir.with_name(f".{output_dir.name}.tmp-{os.getpid()}")
    identical, checked = _train_into(tmp, sample, **settings)
    info = {
        "hash": tokenizer_hash(tmp),
        **settings,
        "normalization": LOWERCASE_DESCRIPTION if lowercase else "nmt_nfkc (SentencePiece's default, cased)",
        "sentences_seen": seen,
        "sentences_sampled": len(sample),
        "max_sentences": max_sentences,
        "inputs": [source.describe() for source in sources],
        "read_options": {"txt_documents": options.txt_documents, "text_field": options.text_field},
        "hf_parity": {"checked": checked, "identical": identical},
        "input_counts": dict(sorted(stats.items())),
    }
    (tmp / TOKENIZER_INFO_NAME).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    _install(tmp, output_dir)
    _report(output_dir, info, time.perf_counter() - started)
    return info


def _sample(
    sources: list[Any], options: ReadOptions, max_sentences: int, seed: int
) -> tuple[list[str], int, Counter]:
    """Up to `max_sentences` lines drawn from the inputs, the lines seen, and the input counts."""
    started = time.perf_counter()
    stats: Counter = Counter()
    sample, seen = sample_sentences(iter_sentences(sources, options, stats), max_sentences, seed)
    if not sample:
        raise InputError(f"the inputs hold no text to train on ({dict(stats) or 'all empty'})")
    log.info(
        "sampled %s of %s lines in %.1f s", f"{len(sample):,}", f"{seen:,}", time.perf_counter() - started
    )
    return sample, seen, stats


def _check_request(output_dir: Path, vocab_size: int, byte_fallback: bool | None, overwrite: bool) -> bool:
    """Whether to use byte fallback; an InputError for a tokenizer folder in the way or a vocabulary
    too small for 256 byte pieces."""
    if (output_dir / SPM_MODEL_NAME).exists() and not overwrite:
        raise InputError(
            f"{output_dir / SPM_MODEL_NAME} exists; shards may have been made with it. "
            "Choose another --output, or pass --overwrite to replace it."
        )
    if byte_fallback is None:
        byte_fallback = vocab_size >= BYTE_FALLBACK_MIN_VOCAB
    if byte_fallback and vocab_size < 300:
        raise InputError(
            f"--vocab-size {vocab_size} leaves no room for 256 byte pieces; pass --byte-fallback no"
        )
    return byte_fallback


def _train_into(tmp: Path, sample: list[str], seed: int, **spm: Any) -> tuple[int, int]:
    """Train the model (`_train_spm`'s settings `spm`) into the fresh folder `tmp` with its Hugging
    Face files; (lines the HF tokenizer encodes as SentencePiece does, lines checked)."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        model = _train_spm(sample, tmp, **spm)
    except InputError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / SPM_MODEL_NAME).write_bytes(model)
    save_hf_folder(tmp / SPM_MODEL_NAME, tmp)
    return _parity(tmp / SPM_MODEL_NAME, sample, seed)


def _report(output_dir: Path, info: dict[str, Any], seconds: float) -> None:
    identical, checked = info["hf_parity"]["identical"], info["hf_parity"]["checked"]
    log.info(
        "wrote %s (%s, %d pieces, hash %s) in %.1f s; the HF tokenizer agrees on %d of %d sampled lines",
        output_dir, info["model_type"], info["vocab_size"], info["hash"][:12], seconds, identical, checked,
    )  # fmt: skip
    if identical < checked and info["model_type"] == "bpe":
        log.warning(
            "the HF tokenizer differs from SentencePiece on %d lines: please report this", checked - identical
        )


def _train_spm(
    sample: list[str],
    tmp: Path,
    vocab_size: int,
    model_type: str,
    character_coverage: float,
    byte_fallback: bool,
    threads: int,
    lowercase: bool,
) -> bytes:
    """The trained SentencePiece model; with `lowercase`, BERT-uncased normalization compiled into it
    (its rule table is written to `tmp` for training only)."""
    import sentencepiece as spm

    rules: dict[str, str] = {}
    if lowercase:
        write_rules(tmp / "uncased_rules.tsv")
        rules["normalization_rule_tsv"] = str(tmp / "uncased_rules.tsv")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sample),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            byte_fallback=byte_fallback,  # rare characters become byte pieces instead of [UNK]
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=-1,
            eos_id=-1,
            pad_piece=SPECIAL_TOKENS[PAD_ID],
            unk_piece=SPECIAL_TOKENS[UNK_ID],
            # Control symbols take the next ids (2, 3, 4) and are never produced from raw text.
            control_symbols=list(SPECIAL_TOKENS[2:]),
            max_sentence_length=4 * SENTENCE_CHARS + 16,
            num_threads=threads,
            minloglevel=2,
            **rules,
        )
    except RuntimeError as err:
        raise InputError(f"SentencePiece could not train (--vocab-size {vocab_size}?): {err}") from err
    finally:
        (tmp / "uncased_rules.tsv").unlink(missing_ok=True)
    return model.getvalue()


def _parity(spm_model: Path, sample: list[str], seed: int, count: int = 1000) -> tuple[int, int]:
    """How many sampled lines the HF tokenizer encodes exactly as SentencePiece does."""
    import sentencepiece as spm

    lines = random.Random(seed).sample(sample, min(count, len(sample)))
    reference = spm.SentencePieceProcessor(model_file=str(spm_model)).encode(lines)
    fast = build_fast_tokenizer(spm_model).encode_batch(lines, add_special_tokens=False)
    return sum(a == b.ids for a, b in zip(reference, fast)), len(lines)


def _install(tmp: Path, output_dir: Path) -> None:
    """Move the finished files into `output_dir`, replacing only this tool's own files."""
    output_dir.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_FILES:
        (output_dir / name).unlink(missing_ok=True)
    # spm.model goes last: its presence means the folder is complete.
    for path in sorted(tmp.iterdir(), key=lambda p: p.name == SPM_MODEL_NAME):
        os.replace(path, output_dir / path.name)
    tmp.rmdir()


def main(argv: list[str] | None = None) -> int:
    args = parse_or_exit(TokenizerConfig, argv, USAGE)
    train_tokenizer(
        args.input,
        args.output,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        max_sentences=args.max_sentences,
        character_coverage=args.character_coverage,
        byte_fallback={"auto": None, "yes": True, "no": False}[args.byte_fallback],
        seed=args.seed,
        threads=args.threads,
        **args.reading(),
        overwrite=args.overwrite,
        lowercase=args.lowercase,
    )
    return 0


console_main = cli.command(main)  # the `swbert-train-tokenizer` command


if __name__ == "__main__":
    console_main()
