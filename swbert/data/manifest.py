"""Layout of a preprocessed data folder and its `manifest.json`.

`data_prep.preprocess` writes the folder; the training side only reads it. Layout::

    DIR/manifest.json                 written last: its presence means the run finished
    DIR/tokenizer/                    copy of the tokenizer folder the shards were made with
    DIR/shard_00000.json              per-shard record, written after the shard's files
    DIR/shard_00000.train.{bin,idx}   megatron-core indexed dataset, one per split
    DIR/shard_00000.valid.{bin,idx}
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

FORMAT = "swbert-shards/1"
MANIFEST_NAME = "manifest.json"
TOKENIZER_SUBDIR = "tokenizer"
SPLITS: tuple[str, ...] = ("train", "valid")
Split = Literal["train", "valid"]

PREPROCESS_HINT = (
    "python -m data_prep.preprocess --input PATH [PATH ...] --tokenizer TOKENIZER_DIR --output {dir}"
)


def shard_name(index: int) -> str:
    """Name of shard `index`; zero-padded so a directory listing sorts in shard order."""
    return f"shard_{index:05d}"


def shard_prefix(data_dir: str | Path, name: str, split: str) -> Path:
    """Path prefix of one split of a shard (append `.bin` / `.idx`)."""
    return Path(data_dir) / f"{name}.{split}"


def file_sha256(path: str | Path, chunk_bytes: int = 1 << 22) -> str:
    """sha256 of a file, read in bounded chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while block := stream.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def write_json_atomic(path: str | Path, payload: Any) -> None:
    """Write JSON so a reader sees either the old file or the complete new one, never a torn one.

    The data is fsync'ed before the rename: a node crash must not leave a record pointing at
    shard bytes that never reached the disk.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as stream:
        json.dump(payload, stream, indent=1, sort_keys=True)
        stream.write("\n")
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(tmp, path)


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
    """Load `DIR/manifest.json`, raising a `ValueError` that says what to run when it is absent."""
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST_NAME
    if not path.is_file():
        if not data_dir.is_dir():
            why = "the folder does not exist"
        elif any(data_dir.glob("shard_*.json")):
            why = "preprocessing has not finished (re-run the same command to resume it)"
        else:
            why = "it is not a preprocessed data folder"
        raise ValueError(f"{path} is missing: {why}. Create it with: {PREPROCESS_HINT.format(dir=data_dir)}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is unreadable ({err}); re-run preprocessing into a new folder") from err
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} has format {manifest.get('format')!r}, this swbert reads {FORMAT!r}")
    return manifest
