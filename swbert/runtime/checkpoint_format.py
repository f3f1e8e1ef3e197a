"""The on-disk layout of a checkpoint folder, in one place: training, conversion and export read
and write checkpoints through these names and functions.

    <run>/checkpoints/
        step_00001000/            a save: DeepSpeed's files, swbert_meta.json, then complete.json
        step_00002000.partial/    a save being written (renamed into place when complete)
        latest                    the tag of the newest complete save (DeepSpeed's pointer)
        latest_universal          the tag of a universal copy (`swbert.parallel.convert universal`)
        incomplete/, damaged/     saves set aside: cut off, or files not matching their hashes

A save is complete when its marker lists files that are all there with their sizes; the marker's
hashes are checked on resume (swbert.training.checkpoint.verify).
"""

from __future__ import annotations

import json
import mmap
import os
import re
from pathlib import Path

import xxhash

LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"  # written by `python -m swbert.parallel.convert universal`
COMPLETE = "complete.json"  # the completeness marker, written last
META = "swbert_meta.json"
INCOMPLETE_DIR = "incomplete"  # where cut-off saves are moved
DAMAGED_DIR = "damaged"  # where checkpoints whose files do not match their hashes are moved
PARTIAL = ".partial"  # the suffix of a step folder being written
HASH = "xxh3_128"  # the marker's file hash: fast (GB/s per core), not a security measure
CHECKPOINT_FORMAT = 2  # 2: completeness markers; 1 (no key in the meta): `latest` written after the meta
TAG_RE = re.compile(r"^step_(\d{8})$")
PARTIAL_RE = re.compile(r"^step_(\d{8})\.partial$")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(tag_dir: Path) -> bool:
    """Whether a checkpoint folder holds a finished save: its marker lists files that are all there
    with their sizes (or, saved before markers existed, its meta file was written)."""
    marker = tag_dir / COMPLETE
    if marker.is_file():
        try:
            files = json.loads(marker.read_text())["files"]
            return all(
                (tag_dir / name).is_file() and (tag_dir / name).stat().st_size == size
                for name, size in files.items()
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
    meta = tag_dir / META
    if not meta.is_file():
        return False
    try:  # format 1 wrote the meta after every rank's shards; format 2 writes the marker after it
        return "checkpoint_format" not in json.loads(meta.read_text())
    except (OSError, ValueError):
        return False


def checkpoint_tags(ckpt_root: Path) -> list[str]:
    """step_* folders directly under `ckpt_root`, oldest first."""
    if not ckpt_root.is_dir():
        return []
    return sorted(p.name for p in ckpt_root.iterdir() if p.is_dir() and TAG_RE.match(p.name))


def newest_complete(ckpt_root: Path) -> str | None:
    return next((t for t in reversed(checkpoint_tags(ckpt_root)) if is_complete(ckpt_root / t)), None)


def read_latest(ckpt_root: Path, name: str = LATEST, step_tags: bool = True) -> str | None:
    """The tag a pointer file names, if it is a folder directly inside `ckpt_root`: a step_* one
    (swbert's saves), or with `step_tags=False` any name (a DeepSpeed checkpoint saved elsewhere)."""
    pointer = Path(ckpt_root) / name
    try:
        tag = pointer.read_text().strip() if pointer.is_file() else ""
    except (OSError, UnicodeDecodeError):
        return None
    named = TAG_RE.match(tag) if step_tags else tag not in ("", ".", "..") and "/" not in tag
    return tag if named and (Path(ckpt_root) / tag).is_dir() else None


def file_hash(path: Path) -> str:
    """xxh3-128 of a file's bytes, read through a memory map (no copy into Python buffers)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_128().hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return xxhash.xxh3_128(mapped).hexdigest()


def marker_hashes(tag_dir: Path) -> dict[str, str]:
    """The file hashes a checkpoint's marker records ({} for one saved before hashes)."""
    try:
        marker = json.loads((tag_dir / COMPLETE).read_text())
    except (OSError, ValueError):
        return {}
    hashes = marker.get("hashes") if isinstance(marker, dict) and marker.get("hash") == HASH else None
    return hashes if isinstance(hashes, dict) else {}


def is_universal(tag_dir: Path) -> bool:
    """Whether `tag_dir` is a universal checkpoint (one folder per parameter): it loads at any
    tensor- and data-parallel size, with DeepSpeed's `checkpoint.load_universal`."""
    return (tag_dir / "zero").is_dir()
