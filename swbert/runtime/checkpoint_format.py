"""The on-disk layout of a checkpoint folder, in one place: training, conversion and export read
and write checkpoints through these names and functions.

    <run>/checkpoints/
        step_00001000/            a save: DeepSpeed's files, swbert_meta.json, then complete.json
        step_00002000.partial/    a save being written (renamed into place when complete)
        latest                    the tag of the newest complete save (DeepSpeed's pointer)
        latest_universal          the tag of a universal copy (`swbert.parallel.convert universal`)
        incomplete/, damaged/     saves set aside: cut off, or files not matching their hashes

A save is complete when its marker lists files that are all there with their sizes. The marker's
hashes are checked before anything reads the files (`mismatched`: on resume, through
swbert.training.checkpoint.verify; by the export and the conversions, `require_intact`). A marker
that names another hash algorithm or none, leaves a file without its hash, or does not parse makes
the checkpoint damaged, as a file that does not match does; only a marker of the pre-hash format
(exactly "step" and "files") is read unchecked, with a warning.

Only today's format is read. A checkpoint an older swbert wrote (`outdated` names what in it is old)
is refused in one line naming `python -m swbert.upgrade`, which rewrites it once (swbert.upgrade).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import zipfile
from collections.abc import Collection
from pathlib import Path
from typing import Any

import xxhash

from swbert.fsutil import fsync_path

log = logging.getLogger(__name__)

LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"  # written by `python -m swbert.parallel.convert universal`
COMPLETE = "complete.json"  # the completeness marker, written last
META = "swbert_meta.json"
INCOMPLETE_DIR = "incomplete"  # where cut-off saves are moved
DAMAGED_DIR = "damaged"  # where checkpoints whose files do not match their hashes are moved
PARTIAL = ".partial"  # the suffix of a step folder being written
HASH = "xxh3_128"  # the marker's file hash: fast (GB/s per core), not a security measure
PRE_HASH_KEYS = {"step", "files"}  # a marker saved before hashes were recorded: exactly these keys
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


def _marker(tag_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the marker, None); (None, what is wrong) for one that does not parse; (None, None) for none."""
    try:
        marker = json.loads((tag_dir / COMPLETE).read_bytes())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as err:
        return (
            None,
            f"does not parse ({type(err).__name__}: the marker is written atomically, so damaged on disk)",
        )
    if not isinstance(marker, dict):
        return None, "does not parse (not a JSON object: damaged on disk)"
    return marker, None


def _is_pre_hash(marker: dict[str, Any]) -> bool:
    return set(marker) == PRE_HASH_KEYS


def _marker_problem(marker: dict[str, Any]) -> str | None:
    """What makes a parsed marker unusable for verification (None: usable, or of the pre-hash form)."""
    if _is_pre_hash(marker):
        return None
    files, hashes, algorithm = marker.get("files"), marker.get("hashes"), marker.get("hash")
    if algorithm != HASH:
        named = f"names the hash {algorithm!r}" if algorithm is not None else "names no hash"
        return f"{named}, not {HASH!r}, the one this swbert writes and checks"
    if not isinstance(files, dict):
        return "lists no files"
    if not isinstance(hashes, dict) or not all(isinstance(v, str) for v in hashes.values()):
        return "records no hash per file"
    missing = sorted(set(files) - set(hashes))
    if missing:
        return f"lists files without their hash ({_named(missing)})"
    return None


def marker_unreadable(tag_dir: Path) -> bool:
    """Whether `tag_dir` holds a marker that does not parse: damage (it is written atomically), not
    a save cut off."""
    return _marker(tag_dir)[1] is not None


def marker_hashes(tag_dir: Path) -> dict[str, str]:
    """The file hashes a checkpoint's marker records ({} for none, one of the pre-hash format, or a
    marker `mismatched` reports as damaged)."""
    marker, problem = _marker(tag_dir)
    if marker is None or problem or _is_pre_hash(marker) or _marker_problem(marker):
        return {}
    return dict(marker["hashes"])


def mismatched(
    tag_dir: Path, rank: int = 0, world: int = 1, only: Collection[str] | None = None
) -> list[str]:
    """What in `tag_dir` fails verification (this rank's share of the files: the ranks split the
    reading): the names of files whose bytes no longer match the hash the marker records (a file
    that cannot be read counts too), or "NAME: what is wrong" for the marker itself (missing, not
    parsable, another or no hash algorithm, a file without its hash) and for a file it does not list
    (rank 0). `only`: check just these files (and the marker), e.g. the meta file before reading it.
    A marker of the pre-hash format is read unchecked, with a warning (rank 0, all files)."""
    marker, problem = _marker(tag_dir)
    if marker is None:
        return [f"{COMPLETE}: {problem or 'missing (the save did not finish)'}"]
    problem = _marker_problem(marker)
    if problem:
        return [f"{COMPLETE}: {problem}"]
    if _is_pre_hash(marker):
        if only is None and rank == 0:
            log.warning(
                "%s was saved before hashes were recorded (its %s has none): read unchecked",
                tag_dir,
                COMPLETE,
            )
        return []
    hashes: dict[str, str] = marker["hashes"]
    bad = []
    if only is None and rank == 0:  # DeepSpeed and zero_to_fp32 find shards by pattern: every file counts
        bad += [f"{name}: not listed in {COMPLETE}" for name in _unlisted(tag_dir, hashes)]
    names = sorted(hashes, key=lambda n: (-_size(tag_dir / n), n)) if only is None else sorted(only)
    for name in names[rank::world]:
        if name not in hashes:
            if (tag_dir / name).exists():
                bad.append(f"{name}: not listed in {COMPLETE}")
            continue
        try:
            if file_hash(tag_dir / name) != hashes[name]:
                bad.append(name)
        except OSError:
            bad.append(name)
    return bad


def _unlisted(tag_dir: Path, listed: Collection[str]) -> list[str]:
    names = (str(p.relative_to(tag_dir)) for p in tag_dir.rglob("*") if p.is_file())
    return sorted(n for n in names if n != COMPLETE and n not in listed)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _named(names: list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def damage(bad: list[str]) -> str:
    """`mismatched`'s findings in words, for a one-line message."""
    files = [b for b in bad if ": " not in b]
    others = [b for b in bad if ": " in b]
    parts = others[:3] + ([f"{len(others) - 3} more"] if len(others) > 3 else [])
    if files:
        verb = "does" if len(files) == 1 else "do"
        parts.insert(0, f"{_named(files)} {verb} not match the hashes its {COMPLETE} records")
    return "; ".join(parts)


class DamagedCheckpoint(ValueError):
    """A checkpoint that is incomplete or fails verification (`mismatched`); one line naming what."""


def require_intact(tag_dir: Path, instead: str) -> None:
    """DamagedCheckpoint, in one line naming what fails and `instead` (what to do), unless every file
    of `tag_dir` matches its marker (single process: the export and the conversions). A folder with
    neither marker nor meta file was not saved by swbert (a DeepSpeed checkpoint from elsewhere): it
    has no hashes to check, and is read as it is, with a warning."""
    if not (tag_dir / COMPLETE).exists() and not (tag_dir / META).exists():
        log.warning("%s was not saved by swbert (no %s): it has no hashes to check", tag_dir, COMPLETE)
        return
    if not marker_unreadable(tag_dir) and not is_complete(tag_dir):
        raise DamagedCheckpoint(
            f"{tag_dir} is incomplete (no {COMPLETE}: its save or conversion did not finish, or a file it "
            f"lists is missing or has another size); {instead}"
        )
    bad = mismatched(tag_dir)
    if bad:
        raise DamagedCheckpoint(f"{tag_dir} is damaged ({damage(bad)}; damaged on disk?); {instead}")


def atomic_write(path: Path, text: str) -> None:
    """Write `path` through a temporary file renamed into place, flushed with its folder."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def write_marker(tag_dir: Path, step: int, hashes: dict[str, str] | None = None) -> None:
    """Write the marker, last: every file of the folder with its size and hash (`hashes`: those
    computed already, e.g. by the ranks that wrote them; the rest are hashed here)."""
    paths = [
        p for p in sorted(tag_dir.rglob("*")) if p.is_file() and p.relative_to(tag_dir) != Path(COMPLETE)
    ]
    files = {str(p.relative_to(tag_dir)): p.stat().st_size for p in paths}
    known = dict(hashes or {})
    known.update({name: file_hash(tag_dir / name) for name in files if name not in known})
    marker = {"step": step, "files": files, "hash": HASH, "hashes": {k: known[k] for k in files}}
    atomic_write(tag_dir / COMPLETE, json.dumps(marker, indent=1))


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
    is a save cut off (of any version): set aside by the trainer, not upgraded. Nor is a folder
    whose marker or meta file fails its check (`mismatched`): it is damaged, and said so there."""
    if (tag_dir / COMPLETE).exists() and mismatched(tag_dir, only=[META]):
        return []
    meta = read_meta(tag_dir)
    if meta is None:
        return []
    found = []
    if "checkpoint_format" not in meta and not (tag_dir / COMPLETE).is_file():
        found.append("checkpoint format 1, without a completeness marker")
    elif is_universal(tag_dir) and not is_complete(tag_dir):  # converted before conversions wrote one
        found.append("a converted (universal) checkpoint without a completeness marker of its own")
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
