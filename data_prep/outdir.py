"""The preprocessing output folder: one writer at a time, and never a mix of two runs' shards."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from data_prep.sources import InputError
from swbert.data.manifest import MANIFEST_NAME, SPLITS, TOKENIZER_SUBDIR, read_manifest

LOCK_NAME = ".preprocess.lock"
WAIT_SECONDS = 10.0
PLAN_NAME = "plan.json"
TASKS_NAME = "tasks.json"  # how many tasks share the folder's shards (`--num-tasks`)
NO_LOCK_VAR = "SWBERT_DATA_LOCK"  # "off": preprocess without locks (a file system that has none)
# what a file system without (working) locks answers: NFS without lockd, Lustre without -o flock
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


def locks_off() -> bool:
    """Whether the user turned the data locks off (`SWBERT_DATA_LOCK=off`)."""
    return os.environ.get(NO_LOCK_VAR, "").lower() == "off"


def no_locks(folder: str, err: OSError) -> InputError | None:
    """The one-line error for a file system without locks (`folder` as the user named it), or None
    when `err` is another failure."""
    if err.errno not in _NO_LOCKS:
        return None
    return InputError(
        f"{folder}: its file system does not support file locks ({os.strerror(err.errno)}), which keep "
        "two preprocessing runs from writing one folder at once; put it on a file system with locks (a "
        "local disk, NFS with lockd, Lustre mounted with -o flock), or set "
        f"{NO_LOCK_VAR}=off if you are sure nothing else writes it"
    )


class DiskFull(InputError):
    """The output folder's file system is full (or the user's quota is used up); the message says
    what was kept and how to resume."""

    def __init__(self, output_dir: Path, what: str, err: OSError) -> None:
        why = "" if err.errno == errno.ENOSPC else f" ({os.strerror(err.errno or errno.ENOSPC)})"
        kept = sum(1 for _ in output_dir.glob("shard_*.json"))
        super().__init__(
            f"{output_dir}: no space left on device{why} while writing {what}: {kept} finished shard(s) "
            "are kept, and the half-written files of the others are removed when the run resumes; free "
            "space there (or move the folder to a larger disk), then re-run the same command to resume"
        )


def is_disk_full(err: BaseException) -> bool:
    """Whether `err` says the disk is full or the quota used up (`shutil.copytree` gathers its
    failures into one `shutil.Error`, whose list names them in words)."""
    if isinstance(err, shutil.Error) and err.args and isinstance(err.args[0], list):
        words = {os.strerror(code) for code in _DISK_FULL}
        return any(any(word in str(entry) for word in words) for entry in err.args[0])
    return isinstance(err, OSError) and err.errno in _DISK_FULL


@contextmanager
def disk_full_named(output_dir: Path, what: str) -> Iterator[None]:
    """Turn a full disk while writing `what` into `output_dir` into `DiskFull`, one line that says
    what was kept and how to resume; other errors pass."""
    try:
        yield
    except OSError as err:
        if not is_disk_full(err):
            raise
        raise DiskFull(output_dir, what, err) from None


class OutputLock:
    """An exclusive `flock` on the output folder, released by the kernel even on `kill -9`.

    `name` picks the lock file: the folder's own (held while a run sets the folder up or writes the
    manifest) or one task's (held while that task writes its shards, so a task started twice, as
    after a requeue whose old run is still exiting, waits or stops). On a cluster the folder must be
    on a file system that shares `flock` between nodes (NFS; Lustre mounted with `-o flock`). With
    `SWBERT_DATA_LOCK=off` it locks nothing (`fd` stays None)."""

    def __init__(self, output_dir: Path, name: str = LOCK_NAME, wait: float = WAIT_SECONDS) -> None:
        self.path = output_dir / name
        self.wait = wait
        self.fd: int | None = None

    def __enter__(self) -> OutputLock:
        if locks_off():
            return self
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.wait  # the processes of a killed run may still be exiting
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                holder = os.pread(self.fd, 128, 0).decode(errors="replace").strip() or "unknown"
                os.close(self.fd)
                raise InputError(
                    f"another preprocess (pid {holder}) is writing {self.path.parent}; wait for it to "
                    "finish or stop it, then re-run this command to resume"
                ) from None
            except OSError as err:
                os.close(self.fd)
                if error := no_locks(f"--output {self.path.parent}", err):
                    raise error from None
                raise
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"{os.getpid()} on {socket.gethostname()}".encode(), 0)
        except OSError as err:  # the holder's name is a courtesy: a full disk is reported where it matters
            if not is_disk_full(err):
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the lock
            self.fd = None


def check_output_dir(output_dir: str | Path) -> None:
    """An `InputError` when `--output` names something that exists but is no folder (a file)."""
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise InputError(
            f"--output {path} is a file, not a folder: name a new (or this run's) folder for the shards"
        )
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise InputError(f"--output {path}: {parent} is a file, so no folder can be made inside it")


def _is_ours(path: Path) -> bool:
    name = path.name
    return (
        name in (MANIFEST_NAME, PLAN_NAME, TASKS_NAME, TOKENIZER_SUBDIR)
        or (name.startswith("shard_") and name.endswith((".json", ".bin", ".idx")))
        or name.startswith(
            (
                ".shard_",
                f".{TOKENIZER_SUBDIR}.tmp-",
                ".plan.json.tmp-",
                ".manifest.json.tmp-",
                ".tasks.json.tmp-",
            )
        )
    )


def remove_outputs(output_dir: Path) -> None:
    """Delete what preprocessing wrote in `output_dir` (only its own files, nothing else)."""
    for path in output_dir.iterdir():
        if _is_ours(path):
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def task_lock_name(task_index: int) -> str:
    """The lock file of task `task_index` (`--task-index`; a run without tasks is task 0)."""
    return f".preprocess.task-{task_index}.lock"


def tasks_running(output_dir: Path) -> list[str]:
    """The task locks of `output_dir` held now, by any process (on any node sharing `flock`); none
    with `SWBERT_DATA_LOCK=off`, where nobody can tell."""
    busy: list[str] = []
    if locks_off():
        return busy
    for path in sorted(output_dir.glob(".preprocess.task-*.lock")):
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            busy.append(path.name)
        except OSError as err:
            if error := no_locks(f"--output {output_dir}", err):
                raise error from None
            raise
        finally:
            os.close(fd)
    return busy


def remove_stale_temporaries(output_dir: Path, names: set[str]) -> None:
    """Remove the half-written files that a killed run left of the shards `names` (safe: we hold
    the lock of the task that writes them; other tasks' files are theirs)."""
    for path in output_dir.glob(".shard_*.tmp-*"):
        if path.name[1:].split(".", 1)[0] in names:
            path.unlink(missing_ok=True)


def _describe_difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = [key for key in ("inputs", "config", "dtype", "format") if old.get(key) != new.get(key)]
    if "config" in keys:
        changed = sorted(k for k in new["config"] if old.get("config", {}).get(k) != new["config"][k])
        keys[keys.index("config")] = f"settings ({', '.join(changed)})"
    return ", ".join(keys) or "settings"


def check_existing(
    output_dir: Path, plan: dict[str, Any], plan_id: str, tokenizer_dir: Path, overwrite: bool
) -> dict[str, Any] | None:
    """Decide what to do with what `output_dir` already holds.

    Returns the manifest when the same run already finished (nothing to do); None when the
    folder is empty or holds a resumable part of this same run. Raises `InputError` when it
    holds shards of another tokenizer, inputs or settings, unless `overwrite` (then deletes them).
    """
    old_plan: dict[str, Any] | None = None
    manifest_path, plan_path = output_dir / MANIFEST_NAME, output_dir / PLAN_NAME
    if manifest_path.is_file():
        try:
            old_plan = read_manifest(output_dir)
        except ValueError:
            old_plan = {}
    elif plan_path.is_file():
        try:
            old_plan = json.loads(plan_path.read_text())
        except ValueError:
            old_plan = {}
    elif any(output_dir.glob("shard_*")):
        old_plan = {}  # shards without a plan: not written by this version
    if old_plan is None or old_plan.get("plan_id") == plan_id:
        if old_plan is not None and manifest_path.is_file():
            if _sizes_ok(output_dir, old_plan):
                return old_plan
            manifest_path.unlink()  # damaged since: no longer complete until the rerun repairs it
        return None
    if overwrite:
        if busy := tasks_running(output_dir):
            raise InputError(
                f"--overwrite: {output_dir} is being written by a running preprocess ({', '.join(busy)} "
                "held); stop it first, or write to a new --output folder"
            )
        remove_outputs(output_dir)
        return None
    old_hash = old_plan.get("tokenizer", {}).get("hash")
    new_hash = plan["tokenizer"]["hash"]
    hint = "Write to a new --output folder, or pass --overwrite to delete them."
    if old_hash and old_hash != new_hash:
        raise InputError(
            f"{output_dir} holds shards made with another tokenizer ({old_hash[:12]}), not the one in "
            f"{tokenizer_dir} ({new_hash[:12]}). {hint}"
        )
    what = _describe_difference(old_plan, plan) if old_plan else "an unknown run"
    raise InputError(f"{output_dir} holds shards of another preprocessing run (differs in: {what}). {hint}")


def _files_match(output_dir: Path, name: str, record: dict[str, Any]) -> bool:
    """Every file of shard `name` is there, of the size its record (or manifest entry) gives."""
    for split in SPLITS:
        for suffix in ("bin", "idx"):
            path = output_dir / f"{name}.{split}.{suffix}"
            if not path.is_file() or path.stat().st_size != record[split][f"{suffix}_bytes"]:
                return False
    return True


def _sizes_ok(output_dir: Path, manifest: dict[str, Any]) -> bool:
    return all(_files_match(output_dir, shard["name"], shard) for shard in manifest.get("shards", []))


def finished_record(output_dir: Path, name: str, plan_id: str) -> dict[str, Any] | None:
    """The record of a shard finished by this plan, or None when it must be (re)written."""
    path = output_dir / f"{name}.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    if record.get("name") != name:  # the name decides which files are hashed, moved aside, listed
        raise InputError(
            f"{path}: names shard {record.get('name')!r}, not {name!r}: the record was edited or damaged "
            "(a record names its own shard, in its folder); move it aside (it is yours to inspect) and "
            "re-run the same command to write the shard again"
        )
    if record.get("plan_id") != plan_id or not _files_match(output_dir, name, record):
        return None
    return record
