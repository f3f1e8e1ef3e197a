"""Check every shard of a preprocessed folder against its manifest.

    python -m data_prep.verify DATA_DIR

Checks sizes, sha256, that each `.idx` parses with megatron-core's reader and agrees with its
`.bin` and the manifest (documents, tokens, offsets), that token ids fit the vocabulary, and the
tokenizer copy. Prints one line per bad file and exits 1 if there is any, 0 otherwise.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from data_prep import cli
from swbert.cli import parse_or_exit
from swbert.data._megatron import indexed_dataset
from swbert.data.manifest import SPLITS, TOKENIZER_SUBDIR, read_manifest, shard_prefix
from swbert.data.tokenizer import SPM_MODEL_NAME, is_tokenizer_folder, tokenizer_hash

log = logging.getLogger("data_prep.verify")
USAGE = "usage: python -m data_prep.verify DATA_DIR\n\n" + (__doc__ or "").split("\n\n")[0]


@dataclass
class VerifyConfig:
    """The command line of `python -m data_prep.verify` (`swbert.cli`)."""

    data_dir: str = field(metadata={"positional": True})  # folder written by python -m data_prep.preprocess


def _scan_bin(path: Path, dtype: np.dtype) -> tuple[str, int]:
    """sha256 and largest token id of a `.bin`, in one bounded-memory pass."""
    digest, largest = hashlib.sha256(), -1
    block_bytes = (1 << 22) - (1 << 22) % dtype.itemsize
    with open(path, "rb") as stream:
        while block := stream.read(block_bytes):
            digest.update(block)
            usable = len(block) - len(block) % dtype.itemsize
            if usable:
                largest = max(largest, int(np.frombuffer(block[:usable], dtype=dtype).max()))
    return digest.hexdigest(), largest


def _check_index(idx_path: Path, record: dict[str, Any], dtype: np.dtype) -> list[str]:
    """Parse the index with megatron-core's reader and check it against the manifest's record."""
    try:
        index = indexed_dataset()._IndexReader(str(idx_path), multimodal=False)
    except Exception as err:  # the reader asserts on a bad header and fails on short files
        return [f"{idx_path}: not a readable megatron-core index ({type(err).__name__}: {err})"]
    problems = []
    lengths = index.sequence_lengths.astype(np.int64)
    docs = index.document_indices
    pointers = index.sequence_pointers
    expected_pointers = (
        np.concatenate(([0], np.cumsum(lengths)[:-1])) * dtype.itemsize if len(lengths) else lengths
    )
    if index.dtype != dtype.type:
        problems.append(
            f"{idx_path}: token type {np.dtype(index.dtype).name}, the manifest says {dtype.name}"
        )
    if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(lengths) or np.any(np.diff(docs) <= 0):
        problems.append(f"{idx_path}: document boundaries are inconsistent with its {len(lengths)} sequences")
    elif len(docs) - 1 != record["documents"]:
        problems.append(f"{idx_path}: {len(docs) - 1} documents, the manifest says {record['documents']}")
    if int(lengths.sum()) != record["tokens"]:
        problems.append(f"{idx_path}: {int(lengths.sum())} tokens, the manifest says {record['tokens']}")
    if not np.array_equal(pointers, expected_pointers):
        problems.append(f"{idx_path}: sequence offsets do not follow the sequence lengths")
    indexed = int(lengths.sum()) * dtype.itemsize
    if indexed != record["bin_bytes"]:
        problems.append(
            f"{idx_path}: indexes {indexed} bytes of tokens, the manifest's .bin has {record['bin_bytes']}"
        )
    del index
    return problems


def verify_dir(data_dir: str | Path) -> tuple[list[str], dict[str, int]]:
    """All problems found (one line each, naming the file) and what was checked."""
    data_dir = Path(data_dir)
    try:
        manifest = read_manifest(data_dir)
    except ValueError as err:
        return [str(err)], {}
    problems: list[str] = []
    dtype = np.dtype(manifest["dtype"])
    vocab_size = int(manifest["tokenizer"]["vocab_size"])
    tok_dir = data_dir / TOKENIZER_SUBDIR
    # swbert's own tokenizer is named by its spm.model; a Hugging Face one by its folder
    named = tok_dir / SPM_MODEL_NAME if "special_ids" not in manifest["tokenizer"] else tok_dir
    if not is_tokenizer_folder(tok_dir):
        problems.append(f"{named}: missing (the copy of the tokenizer the shards were made with)")
    elif tokenizer_hash(tok_dir) != manifest["tokenizer"]["hash"]:
        problems.append(f"{named}: not the tokenizer the manifest names (sha256 differs)")
    checked = {"shards": 0, "files": 0, "documents": 0, "tokens": 0}
    for shard in manifest["shards"]:
        checked["shards"] += 1
        for split in SPLITS:
            record = shard[split]
            prefix = shard_prefix(data_dir, shard["name"], split)
            bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
            ok = True
            for path, suffix in ((bin_path, "bin"), (idx_path, "idx")):
                checked["files"] += 1
                if not path.is_file():
                    problems.append(f"{path}: missing")
                    ok = False
                elif path.stat().st_size != record[f"{suffix}_bytes"]:
                    size = path.stat().st_size
                    problems.append(
                        f"{path}: {size} bytes, the manifest says {record[f'{suffix}_bytes']} (truncated?)"
                    )
                    ok = False
            if bin_path.is_file():
                sha, largest = _scan_bin(bin_path, dtype)
                if sha != record["bin_sha256"]:
                    problems.append(f"{bin_path}: sha256 differs from the manifest (corrupted)")
                    ok = False
                if largest >= vocab_size:
                    problems.append(
                        f"{bin_path}: token id {largest} is outside the vocabulary ({vocab_size})"
                    )
            if idx_path.is_file():
                if hashlib.sha256(idx_path.read_bytes()).hexdigest() != record["idx_sha256"]:
                    problems.append(f"{idx_path}: sha256 differs from the manifest (corrupted)")
                    ok = False
                problems += _check_index(idx_path, record, dtype)
            if ok:
                checked["documents"] += record["documents"]
                checked["tokens"] += record["tokens"]
    return problems, checked


def main(argv: list[str] | None = None) -> int:
    args = parse_or_exit(VerifyConfig, argv, USAGE)
    problems, checked = verify_dir(args.data_dir)
    for problem in problems:
        print(f"BAD {problem}")
    if problems:
        print(
            f"{len(problems)} problem(s) in {args.data_dir}. Delete the files named above and re-run the "
            "same preprocess command: it rewrites only the shards whose files are missing."
        )
        return 1
    print(
        f"OK {args.data_dir}: {checked['shards']} shards, {checked['files']} files, "
        f"{checked['documents']:,} documents, {checked['tokens']:,} tokens match the manifest"
    )
    return 0


console_main = cli.command(main)  # the `swbert-verify` command


if __name__ == "__main__":
    console_main()
