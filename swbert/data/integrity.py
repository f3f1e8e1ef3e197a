"""Shards checked against their manifest's sha256 before a run trains on them.

`open_corpus` checks sizes only (cheap, every open). A flipped byte that keeps token ids inside the
vocabulary passes that check and the reader's id check, and trains silently on other text; only the
content hash catches it. Hashing every shard at every start costs a pass over the data, so each
verified file is remembered by its identity (resolved path, size, mtime_ns, ctime_ns, inode) together
with the hash it matched: a restart re-hashes only files that were replaced or touched since. The
ctime is what catches an edit in place whose mtime was put back (`touch -r`, `os.utime`, a restore
tool): only the kernel sets it, to the time of the last change of the file's data or metadata. The work
is split over the job's ranks by file size, and the results are combined with a gather the caller
provides (this module imports nothing distributed), so every rank reaches the same verdict.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swbert.data.manifest import SPLITS, file_sha256, shard_prefix, write_json_atomic

log = logging.getLogger(__name__)

CACHE_NAME = ".shard_hashes.json"
CACHE_FORMAT = "swbert-shard-hashes/1"
Gather = Callable[[Any], list[Any]]
"""`gather(obj)` -> every rank's `obj`, in rank order (all_gather_object); one rank: `[obj]`."""


class ShardCorrupt(ValueError):
    """A shard file's content is not what the manifest's sha256 says."""


@dataclass(frozen=True)
class ShardFile:
    """One `.bin`/`.idx` a run reads, with what the manifest says it holds."""

    path: str  # resolved: the cache key, the same from any working directory
    sha256: str
    size: int


@dataclass(frozen=True)
class VerifyResult:
    """What one verification did (for the start-up log and the tests)."""

    files: int  # files the run reads
    hashed: int  # of them, hashed now (the others matched the cache)
    hashed_bytes: int  # bytes hashed by all ranks together
    hashed_here: int  # files hashed by this rank
    seconds: float  # wall time on this rank, gathers included


def manifest_files(data_dir: str | Path, manifest: dict[str, Any]) -> list[ShardFile]:
    """The files of every non-empty split of every shard (what `open_corpus` maps), in manifest order."""
    files = []
    for shard in manifest["shards"]:
        for split in SPLITS:
            record = shard[split]
            if record["documents"] == 0:
                continue
            prefix = shard_prefix(data_dir, shard["name"], split)
            for suffix in ("bin", "idx"):
                path = str(Path(f"{prefix}.{suffix}").resolve())
                files.append(ShardFile(path, record[f"{suffix}_sha256"], record[f"{suffix}_bytes"]))
    return files


def file_identity(path: str) -> list[int]:
    """(size, mtime_ns, inode, ctime_ns): what changes when a file is rewritten, replaced or edited in
    place. The mtime can be set back by anyone who may write the file; the ctime cannot (any write,
    `utime` included, moves it on), so an edit hidden behind a restored mtime is hashed again. A
    cache written before the ctime was part of the key matches no file: the first start re-hashes."""
    stat = os.stat(path)
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns]


def read_cache(path: Path) -> dict[str, dict[str, Any]]:
    """The remembered verdicts; an unreadable or foreign cache is treated as empty (re-hash)."""
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(payload, dict) or payload.get("format") != CACHE_FORMAT:
        return {}
    files = payload.get("files")
    return files if isinstance(files, dict) else {}


def to_hash(files: list[ShardFile], cache: dict[str, dict[str, Any]]) -> list[ShardFile]:
    """Files whose identity or expected hash differs from the cache's record: they need hashing."""
    todo = []
    for file in files:
        entry = cache.get(file.path)
        try:
            current = file_identity(file.path)
        except OSError:
            current = None
        if not entry or entry.get("identity") != current or entry.get("sha256") != file.sha256:
            todo.append(file)
    return todo


def assign(files: list[ShardFile], rank: int, world: int) -> list[ShardFile]:
    """This rank's share: largest file first to the least-loaded rank (the same split on every rank)."""
    loads = [0] * world
    mine = []
    for file in sorted(files, key=lambda f: (-f.size, f.path)):
        target = min(range(world), key=lambda r: (loads[r], r))
        loads[target] += max(file.size, 1)
        if target == rank:
            mine.append(file)
    return mine


def hash_files(files: list[ShardFile]) -> dict[str, tuple[str, list[int] | None]]:
    """path -> (sha256, identity before reading): a file changed while hashed gets re-hashed next time."""
    out: dict[str, tuple[str, list[int] | None]] = {}
    for file in files:
        try:
            identity = file_identity(file.path)
            out[file.path] = (file_sha256(file.path), identity)
        except OSError as err:
            out[file.path] = (f"unreadable: {err.strerror or err}", None)
    return out


def write_cache(path: Path, cache: dict[str, dict[str, Any]]) -> None:
    """Replace the cache atomically; a folder we may not write only costs a re-hash next start."""
    try:
        write_json_atomic(path, {"format": CACHE_FORMAT, "files": cache})
    except OSError as err:
        log.warning(
            "could not remember verified shard hashes in %s (%s): the next start re-hashes", path, err
        )


def _refuse(bad: list[ShardFile], results: dict[str, tuple[str, Any]], data_dir: Path) -> ShardCorrupt:
    first = bad[0]
    got = results[first.path][0]
    why = got if got.startswith("unreadable") else "its sha256 differs from the manifest's"
    more = f" (and {len(bad) - 1} more file(s))" if len(bad) > 1 else ""
    return ShardCorrupt(
        f"{first.path}: {why}: the shard is corrupt{more}. Check the folder with: "
        f"python -m data_prep.verify {data_dir}"
    )


def verify_shards(
    data_dir: str | Path,
    manifest: dict[str, Any],
    cache_path: Path,
    rank: int = 0,
    world: int = 1,
    gather: Gather | None = None,
) -> VerifyResult:
    """Check every shard file a run reads against the manifest's sha256, split over `world` ranks.

    Rank 0 reads the cache and decides what needs hashing (one view for all, even if another job
    rewrites the cache meanwhile); each rank hashes its share; the gathered results are checked on
    every rank, which all raise the same `ShardCorrupt` naming the first bad file; rank 0 remembers
    the good ones in `cache_path`.
    """
    started = time.perf_counter()
    gather = gather or (lambda obj: [obj])
    data_dir = Path(data_dir)
    files = manifest_files(data_dir, manifest)
    cache = read_cache(cache_path) if rank == 0 else {}
    todo: list[ShardFile] = gather(to_hash(files, cache) if rank == 0 else None)[0]
    mine = assign(todo, rank, world)
    results: dict[str, tuple[str, list[int] | None]] = {}
    for part in gather(hash_files(mine)):
        results.update(part)
    bad = [file for file in todo if results[file.path][0] != file.sha256]
    if rank == 0 and len(bad) < len(todo):
        known = {file.path for file in files}
        cache = {path: entry for path, entry in cache.items() if path in known or Path(path).exists()}
        for file in todo:
            if file not in bad:
                cache[file.path] = {"sha256": file.sha256, "identity": results[file.path][1]}
        write_cache(cache_path, cache)
    if bad:
        raise _refuse(bad, results, data_dir)
    hashed_bytes = sum(file.size for file in todo)
    return VerifyResult(len(files), len(todo), hashed_bytes, len(mine), time.perf_counter() - started)
