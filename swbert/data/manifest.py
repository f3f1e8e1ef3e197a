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

from swbert.data.tokenizer import SpecialIds

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
    shard bytes that never reached the disk. A failed write (a full disk) removes its own temporary.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as stream:
            json.dump(payload, stream, indent=1, sort_keys=True)
            stream.write("\n")
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # our own half-written copy (a full disk, say); the old file stands
        raise


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
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ValueError(f"{path} has format {found!r}, this swbert reads {FORMAT!r}")
    problem = _manifest_problem(manifest)
    if problem:
        raise ValueError(
            f"{path}: {problem}: the manifest is damaged. Check the folder with: "
            f"python -m data_prep.verify {data_dir}, or preprocess again into a new folder"
        )
    return manifest


def special_ids(manifest: dict[str, Any]) -> SpecialIds:
    """The special ids the shards were made with: the tokenizer record's `special_ids` (a Hugging
    Face tokenizer's own), else swbert's fixed ids (its own tokenizers; manifests written before
    other tokenizers were supported have no record)."""
    record = manifest["tokenizer"].get("special_ids")
    return SpecialIds(**record) if record is not None else SpecialIds()


def _special_ids_problem(tokenizer: dict[str, Any]) -> str | None:
    """What is wrong with a tokenizer record's `special_ids` (absent is fine), or None."""
    record = tokenizer.get("special_ids")
    if record is None:
        return None
    roles = set(SpecialIds.__dataclass_fields__)
    if not isinstance(record, dict) or set(record) != roles:
        return f"its tokenizer's special_ids {record!r} do not name exactly {', '.join(sorted(roles))}"
    for role, value in record.items():
        if (value is not None or role != "unk") and not (
            _is_count(value) and value < tokenizer["vocab_size"]
        ):
            return f"its tokenizer's special_ids give {role} {value!r}, not an id of its vocabulary"
    return None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_sha(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64


def _manifest_problem(manifest: dict[str, Any]) -> str | None:
    """What is missing or mistyped in a manifest (naming the shard whose record it is), or None."""
    tokenizer = manifest.get("tokenizer")
    if (
        not isinstance(tokenizer, dict)
        or not _is_sha(tokenizer.get("hash"))
        or not _is_count(tokenizer.get("vocab_size"))
    ):
        return "its tokenizer record (hash, vocab_size) is missing or malformed"
    if problem := _special_ids_problem(tokenizer):
        return problem
    if manifest.get("dtype") not in ("uint16", "int32"):
        return f"dtype {manifest.get('dtype')!r} is not uint16 or int32"
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        return "it lists no shards"
    for i, shard in enumerate(shards):
        name = shard.get("name") if isinstance(shard, dict) else None
        if not isinstance(name, str) or name != shard_name(i):
            return f"shard #{i} is named {name!r}, not {shard_name(i)!r}"
        for split in SPLITS:
            record = shard.get(split)
            if not isinstance(record, dict):
                return f"the record of {name} has no {split!r} split"
            for key in ("documents", "tokens", "bin_bytes", "idx_bytes"):
                if not _is_count(record.get(key)):
                    return f"{name}.{split}: {key} is {record.get(key)!r}, not a count"
            for key in ("bin_sha256", "idx_sha256"):
                if not _is_sha(record.get(key)):
                    return f"{name}.{split}: {key} is {record.get(key)!r}, not a sha256"
    return None
