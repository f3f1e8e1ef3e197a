"""Tokenize one chunk into one shard: the work of a preprocessing worker process."""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.documents import DocumentReader, Piece
from data_prep.sources import Chunk, ReadOptions, Source
from swbert.data._megatron import indexed_dataset
from swbert.data.manifest import SPLITS, shard_prefix, write_json_atomic
from swbert.data.tokenizer import SPM_MODEL_NAME, hf_encoder, is_swbert_tokenizer
from swbert.fsutil import fsync_path

BATCH_CHARS = 1 << 20  # text tokenized per SentencePiece call: the worker's memory bound


@dataclass(frozen=True)
class ShardJob:
    """Everything a worker needs to write shard `index`; picklable, so it can cross processes."""

    index: int
    name: str
    chunk: Chunk
    source: Source
    options: ReadOptions
    tokenizer: str  # the tokenizer folder (the copy beside the shards)
    dtype: str
    valid_fraction: float
    plan_id: str
    output_dir: str


def in_valid_split(text: str, valid_fraction: float) -> bool:
    """Hold a document out by a hash of its (first piece of) text: stable across runs and tokenizers."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < valid_fraction * 2.0**64


def hash_and_size(path: Path) -> tuple[str, int]:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while block := stream.read(1 << 22):
            digest.update(block)
    return digest.hexdigest(), path.stat().st_size


class _SplitWriter:
    """One split of the shard, written through megatron-core's `IndexedDatasetBuilder`."""

    def __init__(self, prefix: Path, dtype: type[np.number]) -> None:
        self.prefix = prefix
        self.tmp_prefix = prefix.with_name(f".{prefix.name}.tmp-{os.getpid()}")
        self.builder = indexed_dataset().IndexedDatasetBuilder(f"{self.tmp_prefix}.bin", dtype=dtype)
        self.documents = 0
        self.tokens = 0
        self.doc_tokens = 0  # tokens of the document being written

    def add(self, ids: list[int], first: bool, last: bool) -> None:
        if first and last:  # the common case: a whole document in one call
            if ids:
                self.builder.add_document(ids, [len(ids)])
                self.documents += 1
                self.tokens += len(ids)
            return
        if ids:
            self.builder.add_item(_AsNumpy(np.asarray(ids)))
            self.doc_tokens += len(ids)
        if last:
            if self.doc_tokens:
                self.builder.end_document()
                self.documents += 1
                self.tokens += self.doc_tokens
            self.doc_tokens = 0

    def finish(self) -> dict[str, Any]:
        """Write the index, move both files to their final names, return their record."""
        self.builder.finalize(f"{self.tmp_prefix}.idx")
        record: dict[str, Any] = {"documents": self.documents, "tokens": self.tokens}
        for suffix in ("bin", "idx"):
            tmp, final = Path(f"{self.tmp_prefix}.{suffix}"), Path(f"{self.prefix}.{suffix}")
            fsync_path(tmp)
            record[f"{suffix}_sha256"], record[f"{suffix}_bytes"] = hash_and_size(tmp)
            os.replace(tmp, final)
        return record


class _AsNumpy:
    """`IndexedDatasetBuilder.add_item` expects a torch tensor but only calls `.numpy()` on it."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def numpy(self) -> np.ndarray:
        return self.array


def encoder(tokenizer_dir: str) -> Callable[[list[str]], list[list[int]]]:
    """Texts to token ids, without special tokens: SentencePiece for swbert's own tokenizers, else
    the Hugging Face folder's `tokenizers` pipeline, with special-token text (a literal "[SEP]")
    encoded as text, never as the special id packing and masking give their own meaning."""
    if is_swbert_tokenizer(tokenizer_dir):
        import sentencepiece as spm

        return spm.SentencePieceProcessor(
            model_file=str(Path(tokenizer_dir) / SPM_MODEL_NAME), num_threads=1
        ).encode
    tokenizer = hf_encoder(tokenizer_dir)
    tokenizer.encode_special_tokens = True

    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]

    return encode


def write_shard(job: ShardJob, report: Any = None, parent_pid: int | None = None) -> dict[str, Any]:
    """Tokenize `job.chunk` into `{name}.train` and `{name}.valid`, then write `{name}.json`.

    The `.json` record is written last, atomically: it is what marks the shard finished, so a
    worker killed at any point leaves a shard that the next run redoes. `report(docs, tokens,
    progress)` is called after every batch.
    """
    stats: Counter = Counter()
    reader = DocumentReader(job.source, job.chunk, job.options, stats)
    encode = encoder(job.tokenizer)
    out_dir = Path(job.output_dir)
    writers = {
        split: _SplitWriter(shard_prefix(out_dir, job.name, split), np.dtype(job.dtype).type)
        for split in SPLITS
    }
    split_of_doc = "train"
    batch: list[Piece] = []
    chars = 0
    reported = [0, 0, 0]

    def flush() -> None:
        nonlocal split_of_doc
        for piece, ids in zip(batch, encode([p.text for p in batch])):
            if piece.first:
                split_of_doc = "valid" if in_valid_split(piece.text, job.valid_fraction) else "train"
            if piece.first and piece.last and not ids:  # e.g. only characters the normalizer drops
                stats["empty_documents"] += 1
            writers[split_of_doc].add(ids, piece.first, piece.last)
        batch.clear()
        if parent_pid is not None and os.getppid() != parent_pid:
            raise SystemExit("preprocess main process is gone; stopping this worker")
        if report is not None:
            docs = sum(w.documents for w in writers.values())
            tokens = sum(w.tokens for w in writers.values())
            report(docs - reported[0], tokens - reported[1], reader.progress - reported[2])
            reported[:] = [docs, tokens, reader.progress]

    for piece in reader:
        batch.append(piece)
        chars += len(piece.text)
        if chars >= BATCH_CHARS:
            flush()
            chars = 0
    flush()
    if report is not None:
        report(0, 0, job.chunk.weight - reported[2])
    record: dict[str, Any] = {
        "name": job.name,
        "plan_id": job.plan_id,
        "chunk": {"input": job.chunk.source, "start": job.chunk.start, "end": job.chunk.end},
        "counts": dict(sorted(stats.items())),
    }
    for split, writer in writers.items():
        record[split] = writer.finish()
    write_json_atomic(out_dir / f"{job.name}.json", record)
    return record
