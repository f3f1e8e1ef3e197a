"""Memory-mapped documents of one split of a preprocessed data folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from swbert.data._megatron import read_index
from swbert.data.manifest import (
    PREPROCESS_HINT,
    SPLITS,
    TOKENIZER_SUBDIR,
    Split,
    read_manifest,
    shard_prefix,
    special_ids,
)
from swbert.data.tokenizer import is_tokenizer_folder, tokenizer_hash


class Corpus:
    """The documents of one split, in manifest order (shard by shard), each a run of token ids.

    Only the per-document index (length, shard, offset: 20 bytes a document) lives in memory;
    token ids are read from the memory-mapped `.bin` files on demand. Pickles cheaply for
    DataLoader workers: the shard files are reopened in each process. The `.idx` files are parsed
    once, here (`read_index`); reading maps each `.bin` (a flat array of token ids) with numpy
    alone. Neither imports megatron-core, which writes and verifies the shards offline.
    """

    def __init__(self, data_dir: Path, split: Split, manifest: dict[str, Any]) -> None:
        self.data_dir = data_dir
        self.split = split
        self.manifest = manifest
        self.tokenizer_hash: str = manifest["tokenizer"]["hash"]
        self.vocab_size: int = int(manifest["tokenizer"]["vocab_size"])
        self.special_ids = special_ids(manifest)  # [CLS], [SEP], [MASK], [PAD], [UNK] of its tokenizer
        tok_dir = data_dir / TOKENIZER_SUBDIR
        self.tokenizer_dir: Path | None = tok_dir if is_tokenizer_folder(tok_dir) else None
        # Empty shards have no data to map (numpy refuses to mmap an empty file).
        self.prefixes = [
            str(shard_prefix(data_dir, shard["name"], split))
            for shard in manifest["shards"]
            if shard[split]["documents"] > 0
        ]
        self._tokens: list[np.ndarray | None] = [None] * len(self.prefixes)  # mapped on first read
        self._shard_dtypes: list[np.dtype] = []
        self._shard_sizes: list[int] = []  # tokens in each shard's .bin
        lengths, shard_ids, offsets = [], [], []
        records = [shard[split] for shard in manifest["shards"] if shard[split]["documents"] > 0]
        for i, (prefix, record) in enumerate(zip(self.prefixes, records)):
            doc_lengths, doc_offsets, dtype, size = _read_index(prefix, record, data_dir)
            lengths.append(doc_lengths)
            offsets.append(doc_offsets)
            shard_ids.append(np.full(len(doc_lengths), i, dtype=np.int32))
            self._shard_dtypes.append(dtype)
            self._shard_sizes.append(size)
        self.doc_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self._doc_shard = np.concatenate(shard_ids) if shard_ids else np.zeros(0, np.int32)
        self._doc_offset = np.concatenate(offsets) if offsets else np.zeros(0, np.int64)
        self.num_tokens = int(self.doc_lengths.sum())

    def tokens(self, shard: int) -> np.ndarray:
        """Every token id of shard `shard` (its index in `prefixes`): a read-only memory-mapped array."""
        array = self._tokens[shard]
        if array is None:
            # A `.bin` is the shard's token ids back to back; a shard listed here is not empty.
            shape = (self._shard_sizes[shard],)
            array = np.memmap(
                f"{self.prefixes[shard]}.bin", dtype=self._shard_dtypes[shard], mode="r", shape=shape
            )
            self._tokens[shard] = array
        return array

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tokens"] = [None] * len(self.prefixes)  # each process maps the files itself
        return state

    def __len__(self) -> int:
        return len(self.doc_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.doc_lengths)

    def read(self, doc: int, start: int = 0, length: int | None = None) -> np.ndarray:
        """Token ids `[start, start + length)` of document `doc` (a read-only view of the mmap)."""
        if length is None:
            length = int(self.doc_lengths[doc]) - start
        offset = int(self._doc_offset[doc]) + start
        tokens = self.tokens(int(self._doc_shard[doc]))[offset : offset + length]
        self._check_ids(tokens, np.full(len(tokens), doc))
        return tokens

    def gather(self, docs: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """The token id at offset `starts[i]` of document `docs[i]`, for every i at once: (N,) int64.

        One fancy-indexing read per shard touched, no Python loop over tokens.
        """
        where = self._doc_offset[docs] + starts  # (N,) offsets in each document's shard
        shards = self._doc_shard[docs]
        out = np.empty(len(docs), dtype=np.int64)
        for shard in np.unique(shards).tolist():  # usually one or two per batch
            sel = shards == shard
            out[sel] = self.tokens(shard)[where[sel]]
        self._check_ids(out, docs)
        return out

    def _check_ids(self, tokens: np.ndarray, docs: np.ndarray) -> None:
        """A ValueError naming the shard when `tokens` (read from documents `docs`) hold an id outside the vocabulary."""
        if len(tokens) and int(tokens.max()) >= self.vocab_size:  # a flipped bit, a shard from elsewhere
            bad = int(np.argmax(tokens))
            doc = int(docs[bad])
            raise ValueError(
                f"{self.prefixes[int(self._doc_shard[doc])]}.bin holds token id {int(tokens[bad])} at document "
                f"{doc}, outside the vocabulary of {self.vocab_size}: the shard is corrupt. Check the folder "
                f"with: python -m data_prep.verify {self.data_dir}"
            )

    def document(self, doc: int) -> np.ndarray:
        """All token ids of document `doc`."""
        return self.read(doc)


def _read_index(
    prefix: str, record: dict[str, Any], data_dir: Path
) -> tuple[np.ndarray, np.ndarray, np.dtype, int]:
    """(document lengths, document offsets, token dtype, tokens) of one shard's `.idx`.

    A damaged index of the right size parses into nonsense or fails its checks; either way the
    error names the file here."""
    idx = f"{prefix}.idx"
    try:
        seq_lengths, doc_index, dtype = read_index(idx)
        seq_lengths = seq_lengths.astype(np.int64)
        # A long document is stored as several sequences; they are contiguous in `.bin`,
        # so a document is the token span from its first sequence to its last.
        ends = np.concatenate(([0], np.cumsum(seq_lengths)))
        doc_lengths = ends[doc_index[1:]] - ends[doc_index[:-1]]
        doc_offsets = ends[doc_index[:-1]]
    except Exception as err:  # a bad header or short file (read_index), or nonsense counts (numpy)
        raise ValueError(
            f"{idx} is not a readable index ({type(err).__name__}: {err}): the shard is corrupt. "
            f"Check the folder with: python -m data_prep.verify {data_dir}"
        ) from err
    tokens = int(ends[-1])
    if len(doc_lengths) != record["documents"] or tokens * dtype.itemsize != record["bin_bytes"]:
        raise ValueError(
            f"{idx} indexes {len(doc_lengths)} documents and {tokens} tokens, but the manifest says "
            f"{record['documents']} documents in {record['bin_bytes']} bytes: the shard is corrupt. "
            f"Check the folder with: python -m data_prep.verify {data_dir}"
        )
    return doc_lengths, doc_offsets, dtype, tokens


def open_corpus(
    data_dir: str | Path,
    split: Split = "train",
    expected_tokenizer_hash: str | None = None,
) -> Corpus:
    """Open one split of a folder written by `data_prep.preprocess`.

    Checks cheaply (file sizes, not hashes: `python -m data_prep.verify` does those) so that a
    job never trains on a half-written or truncated shard, and refuses shards made with another
    tokenizer than `expected_tokenizer_hash` (e.g. the one a checkpoint was trained with).
    """
    data_dir = Path(data_dir)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    manifest = read_manifest(data_dir)
    verify_hint = f"check the folder with: python -m data_prep.verify {data_dir}"
    for shard in manifest["shards"]:
        record = shard[split]
        if record["documents"] == 0:
            continue
        prefix = shard_prefix(data_dir, shard["name"], split)
        for suffix in ("bin", "idx"):
            path = Path(f"{prefix}.{suffix}")
            expected = record[f"{suffix}_bytes"]
            actual = path.stat().st_size if path.is_file() else None
            if actual != expected:
                found = "is missing" if actual is None else f"has {actual} bytes"
                raise ValueError(
                    f"{path} {found}, the manifest says {expected} bytes: the shard is damaged. "
                    f"{verify_hint}, and rebuild it with {PREPROCESS_HINT.format(dir=data_dir)}"
                )
    recorded = manifest["tokenizer"]["hash"]
    if expected_tokenizer_hash is not None and recorded != expected_tokenizer_hash:
        raise ValueError(
            f"{data_dir} holds shards tokenized with tokenizer {recorded[:12]}, but this run expects "
            f"tokenizer {expected_tokenizer_hash[:12]} (e.g. the one its checkpoint was trained with). "
            f"Preprocess the corpus with that tokenizer: {PREPROCESS_HINT.format(dir='NEW_DIR')}"
        )
    tok_dir = data_dir / TOKENIZER_SUBDIR
    if is_tokenizer_folder(tok_dir) and tokenizer_hash(tok_dir) != recorded:
        raise ValueError(
            f"{tok_dir} is not the tokenizer {data_dir / 'manifest.json'} names ({recorded[:12]}): "
            f"it was replaced after preprocessing. {verify_hint}"
        )
    return Corpus(data_dir, split, manifest)


def check_tokenizer_matches(
    tokenizer_dir: str | Path, data_dirs: list[str | Path], flag: str = "--tokenizer"
) -> None:
    """A one-line ValueError naming `flag` when a data folder's shards were made with another
    tokenizer than `tokenizer_dir` (folders without a manifest yet are left to their own checks)."""
    expected = tokenizer_hash(tokenizer_dir)
    for data_dir in data_dirs:
        try:
            recorded = read_manifest(data_dir)["tokenizer"]["hash"]
        except ValueError:
            continue  # missing or damaged: the data's own checks say so, with what to run
        if recorded != expected:
            raise ValueError(
                f"{flag} {tokenizer_dir} is not the tokenizer the shards of {data_dir} were made with "
                f"({recorded[:12]}, not {expected[:12]}): drop {flag}, or preprocess the corpus with it: "
                f"{PREPROCESS_HINT.format(dir='NEW_DIR').replace('TOKENIZER_DIR', str(tokenizer_dir))}"
            )
