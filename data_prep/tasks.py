"""Preprocessing shared by N tasks (one per node, e.g. a SLURM job array) writing one folder.

The chunk plan depends only on the inputs and `--shard-size`, so it is the same in every task and
in a run without tasks: task I writes shards I, I+N, I+2N, ... of it, and the shards are the files
a single run writes. `tasks.json` records N for the plan; a task started with another N is refused
before any work, since its shards would overlap or miss others'. Whichever task finds every shard
finished once its own are done verifies the shards it did not write (sha256 against their records)
and writes the manifest: no coordinator, and a killed task that is re-run finishes the folder.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from data_prep.outdir import TASKS_NAME, locks_off, task_lock_name, tasks_running
from data_prep.shard_writer import hash_and_size
from data_prep.sources import InputError
from swbert.data.manifest import SPLITS, write_json_atomic

log = logging.getLogger("data_prep.preprocess")
REJECTED_DIR = "rejected"  # shards whose files no longer match their records are moved here
NO_LOCK_VAR_TEXT = "SWBERT_DATA_LOCK=off"


def check_task_flags(num_tasks: int, task_index: int) -> None:
    """`--num-tasks` and `--task-index` on their own: an `InputError` naming the flag."""
    if num_tasks < 1:
        raise InputError(f"--num-tasks {num_tasks}: must be at least 1 (the processes sharing --output)")
    if not 0 <= task_index < num_tasks:
        raise InputError(
            f"--task-index {task_index} is outside 0..{num_tasks - 1} (--num-tasks {num_tasks}): "
            "give each task an index from 0 to N-1, e.g. SLURM_ARRAY_TASK_ID of --array=0-N-1"
        )


def owns(shard_index: int, num_tasks: int, task_index: int) -> bool:
    """Whether task `task_index` writes shard `shard_index` (round robin: shards are of one size)."""
    return shard_index % num_tasks == task_index


def claim_tasks(output_dir: Path, plan_id: str, num_tasks: int) -> None:
    """Record `num_tasks` for this plan, or refuse when the folder's tasks were started with another
    number. Called under the folder's lock."""
    path = output_dir / TASKS_NAME
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        record = {}
    if record.get("plan_id") == plan_id and record.get("num_tasks") != num_tasks:
        theirs = record.get("num_tasks")
        raise InputError(
            f"--num-tasks {num_tasks}: {output_dir} is being written by {theirs} task(s) ({path}); start "
            f"every task of this folder with --num-tasks {theirs}, or, once none is running, move "
            f"{path.name} aside to change the number of tasks"
        )
    if record != {"plan_id": plan_id, "num_tasks": num_tasks}:
        write_json_atomic(path, {"plan_id": plan_id, "num_tasks": num_tasks})


def plain_name(name: object) -> str:
    """`name` when it names a shard inside its folder; a `ValueError` for anything that could reach
    outside it (absolute, a path separator, `..`), since records and names decide which files are
    hashed and moved."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or ".." in name
        or any(sep in name for sep in ("/", "\\", os.sep))
    ):
        raise ValueError(
            f"{name!r} is not a shard name (a plain file name inside the output folder, like shard_00000): "
            "a record was edited or damaged; move the shard_*.json that holds it aside and re-run"
        )
    return name


def _shard_files(output_dir: Path, record: dict[str, Any]) -> list[tuple[Path, str, int]]:
    """(path, sha256, bytes) of each file of a shard, as its record states them."""
    files = []
    name = plain_name(record["name"])
    for split in SPLITS:
        for suffix in ("bin", "idx"):
            path = output_dir / f"{name}.{split}.{suffix}"
            files.append((path, record[split][f"{suffix}_sha256"], record[split][f"{suffix}_bytes"]))
    return files


def _matches(file: tuple[Path, str, int]) -> bool:
    path, sha, size = file
    try:
        return hash_and_size(path) == (sha, size)
    except OSError:
        return False


def verify_records(output_dir: Path, records: list[dict[str, Any]], threads: int) -> list[str]:
    """Names of the shards whose files differ from their records (sha256), hashed on `threads`
    threads (hashlib releases the GIL on large blocks, so they read and hash in parallel)."""
    files = [(record["name"], file) for record in records for file in _shard_files(output_dir, record)]
    if not files:
        return []
    with ThreadPoolExecutor(max(1, threads)) as pool:
        results = list(pool.map(_matches, [file for _, file in files]))
    return sorted({name for (name, _), ok in zip(files, results) if not ok})


def reject(output_dir: Path, name: str) -> Path:
    """Move a shard whose files do not match its record aside (never deleted), so it counts as
    unwritten and is written again."""
    plain_name(name)
    target = output_dir / REJECTED_DIR / time.strftime("%Y%m%d-%H%M%S")
    target.mkdir(parents=True, exist_ok=True)
    for path in output_dir.glob(f"{name}.*"):
        try:
            os.replace(path, target / path.name)
        except FileNotFoundError:
            pass  # another task moved it first
    log.warning("%s: its files differ from its record (sha256); moved to %s and written again", name, target)
    return target


def rejected_here(output_dir: Path, name: str, plan_id: str) -> bool:
    """Whether a finishing task of this plan moved shard `name` aside (`reject`): its repair is then
    the finishing task's to do, whichever task first wrote it (that task is done and will not)."""
    for path in (output_dir / REJECTED_DIR).glob(f"*/{plain_name(name)}.json"):
        try:
            if json.loads(path.read_text()).get("plan_id") == plan_id:
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


def describe_missing(output_dir: Path, missing: list[str], owners: list[int], total: int) -> str:
    """Why shards are missing, truthfully: the tasks that write them and whether each holds its lock
    now (is running) or not (not started yet, or killed: it must be started or re-run)."""
    busy = set(tasks_running(output_dir))
    tasks = sorted(set(owners))
    running = [i for i in tasks if task_lock_name(i) in busy]
    idle = [i for i in tasks if i not in running]
    head = f"{len(missing)} of {total} shards are missing ({missing[0]}, ...)"
    if locks_off():
        named = ", ".join(f"task {i} (--task-index {i})" for i in tasks)
        return f"{head}: {named} write(s) them ({NO_LOCK_VAR_TEXT}: whether they run cannot be told)"
    parts = []
    if running:
        named = " and ".join(f"task {i}" for i in running)
        parts.append(f"{named} {'is' if len(running) == 1 else 'are'} running and still writing")
    if idle:
        named = " and ".join(f"task {i} (--task-index {i})" for i in idle)
        one = len(idle) == 1
        parts.append(
            f"{named} {'is' if one else 'are'} not running: start {'it' if one else 'them'} (or re-run, "
            f"if killed) with the same command and {'that' if one else 'each its own'} --task-index"
        )
    return f"{head}: {'; '.join(parts)}. The task that finds every shard finished writes manifest.json"
