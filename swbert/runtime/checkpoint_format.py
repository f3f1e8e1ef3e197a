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

Only today's format is read. A checkpoint an older swbert wrote (`outdated` names what in it is old)
is refused in one line naming `python -m swbert.upgrade`, which rewrites it once (swbert.upgrade).
"""

from __future__ import annotations

import json
import mmap
import os
import re
import zipfile
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
CHECKPOINT_FORMAT = 2  # 2: completeness markers (1, with none, is rewritten by swbert.upgrade)
UPGRADE = "python -m swbert.upgrade"  # rewrites a checkpoint an older swbert wrote, once
# a NumPy type a pickle names (module, newline, name), e.g. numpy._core.multiarray\n_reconstruct
NUMPY_GLOBAL = re.compile(rb"numpy[\w.]*\n[A-Za-z_]")
TAG_RE = re.compile(r"^step_(\d{8})$")
PARTIAL_RE = re.compile(r"^step_(\d{8})\.partial$")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(tag_dir: Path) -> bool:
    """Whether a checkpoint folder holds a finished save: its marker lists files that are all there
    with their sizes."""
    try:
        files = json.loads((tag_dir / COMPLETE).read_text())["files"]
        return all(
            (tag_dir / name).is_file() and (tag_dir / name).stat().st_size == size
            for name, size in files.items()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
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


class OutdatedCheckpoint(ValueError):
    """A checkpoint in a form an older swbert wrote; `python -m swbert.upgrade` rewrites it once."""


def read_meta(tag_dir: Path) -> dict | None:
    """A checkpoint's meta file, or None when it has none (or not a JSON object)."""
    try:
        meta = json.loads((tag_dir / META).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def pickle_bytes(path: Path) -> bytes:
    """The pickle of a file `torch.save` wrote (zip format), read as bytes: nothing is unpickled."""
    try:
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith("/data.pkl")), None)
            return archive.read(name) if name else b""
    except (OSError, zipfile.BadZipFile):
        return b""


def separate_projections(tag_dir: Path, meta: dict | None) -> list[str]:
    """The separate attention projections (q_proj, k_proj, v_proj) a checkpoint saved before they
    were fused into one matrix holds, by name; [] for today's (or an unregistered variant's)."""
    from swbert.models.attention import ATTENTION_CLASSES

    attention = ((meta or {}).get("model") or {}).get("attention_type")
    cls = ATTENTION_CLASSES.get(attention) if isinstance(attention, str) else None
    parts = [p for separate in (cls.packed.values() if cls else ()) for p in separate]
    if not parts:
        return []
    if is_universal(tag_dir):
        names = " ".join(p.name for p in (tag_dir / "zero").iterdir()).encode()
    else:
        names = b"".join(pickle_bytes(f) for f in sorted(tag_dir.glob("*model_states.pt"))[:1])
    return [p for p in parts if f".attn.{p}.".encode() in names]


def outdated(tag_dir: Path) -> list[str]:
    """What in a checkpoint folder is in a form an older swbert wrote ([]: today's format). Reads
    the meta file and the pickles' bytes only (nothing is unpickled). A folder without a meta file
    is a save cut off (of any version): set aside by the trainer, not upgraded."""
    meta = read_meta(tag_dir)
    if meta is None:
        return []
    found = []
    if "checkpoint_format" not in meta and not (tag_dir / COMPLETE).is_file():
        found.append("checkpoint format 1, without a completeness marker")
    tokenizer = meta.get("tokenizer_dir")
    if isinstance(tokenizer, str) and Path(tokenizer).is_absolute():
        found.append(f"the tokenizer named by an absolute path, {tokenizer}")
    if any(NUMPY_GLOBAL.search(pickle_bytes(f)) for f in sorted(tag_dir.glob("rng_rank*.pt"))):
        found.append("RNG files holding NumPy arrays")
    separate = separate_projections(tag_dir, meta)
    if separate:
        found.append(f"the attention projections before their fusion ({', '.join(separate)})")
    return found


def upgrade_command(tag_dir: Path) -> str:
    """The command that rewrites `tag_dir`'s checkpoints folder (every step folder in it)."""
    return f"{UPGRADE} {tag_dir.parent}"


def require_current(tag_dir: Path, what: str = "") -> None:
    """OutdatedCheckpoint, in one line naming the upgrade command, unless `tag_dir` is today's form."""
    found = outdated(tag_dir)
    if found:
        raise OutdatedCheckpoint(
            f"{what}{tag_dir} was saved by an older swbert ({'; '.join(found)}), which this version no "
            f"longer reads: rewrite it once with {upgrade_command(tag_dir)}, then run this again"
        )


def require_current_folder(ckpt_root: Path, what: str = "") -> None:
    """`require_current` for every step folder under `ckpt_root`: a save of format 1 has no marker,
    so without this a run would take it for one cut off, set it aside and start afresh."""
    for tag in checkpoint_tags(ckpt_root):
        require_current(ckpt_root / tag, what)
