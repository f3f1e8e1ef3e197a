"""DeepSpeed's JIT-built C++/CUDA ops, loaded so that a killed build never hangs a later job.

torch's extension builder guards each build folder with a bare lock file (`FileBaton`): whoever
creates it builds, everyone else polls until it is gone. A process killed while holding it (a
`kill -9`, a cancelled job, the OOM killer, in the first seconds of a run) leaves the file behind and
every later job on that cache waits on it forever, silently. DeepSpeed loads such ops at start-up:
the shared-memory collectives on CPU ranks, FusedAdam and CPU Adam when chosen.

`load_op` takes an `flock` on a side file of the build folder first. The kernel drops an flock
with its process, so holding it means no swbert process is inside a build there now; the side
file records who held it last and when. A torch lock then found is either

- left by a swbert process that died holding it (it appeared after the last holder took the
  flock, and that holder is gone): removed, with a warning naming it; or
- another program's build in progress, or a leftover of one: waited for up to `STALE_S`, then a
  one-line error naming the file and the fix.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from swbert._startup import import_deepspeed

log = logging.getLogger(__name__)

STALE_S = 600.0  # a FusedAdam build takes 1-2 minutes; a foreign lock older than this was left behind
SIDE_FILE = "swbert-build.flock"


class StaleBuildLock(RuntimeError):
    """A lock of torch's extension builder that no swbert process can account for."""


def build_dir(name: str) -> Path:
    """The folder torch builds extension `name` in (TORCH_EXTENSIONS_DIR or its default cache)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def load_op(builder: Any, flag: str) -> Any:
    """`builder.load()` (a DeepSpeed OpBuilder) under the build folder's flock, stale locks cleared.

    DeepSpeed keeps loaded ops per process, so its own later `load()` of the same op returns this
    one without touching the build folder again. `flag` names what asked for the op in errors."""
    folder = build_dir(builder.NAME)
    folder.mkdir(parents=True, exist_ok=True)
    with _holding(folder / SIDE_FILE) as previous:
        _clear_stale_lock(folder / "lock", previous, flag)
        if not (folder / f"{builder.NAME}.so").is_file():  # torch's builder writes <name>.so there
            log.info(
                "building DeepSpeed's %s op for %s in %s (once for this environment)",
                builder.NAME,
                flag,
                folder,
            )
        return builder.load(verbose=False)


@contextmanager
def _holding(side: Path):
    """flock `side` for the block; yields the (pid, time) the previous holder recorded, if any."""
    with open(side, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        previous = _parse(handle.read())
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()} {time.time():.3f}\n")
        handle.flush()
        try:
            yield previous
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _parse(text: str) -> tuple[int, float] | None:
    try:
        pid, since = text.split()
        return int(pid), float(since)
    except ValueError:
        return None


def _clear_stale_lock(lock: Path, previous: tuple[int, float] | None, flag: str) -> None:
    """Remove `lock` when a dead swbert holder left it; wait out, then name, any other."""
    deadline = time.monotonic() + STALE_S
    while True:
        try:
            created = lock.stat().st_mtime
        except FileNotFoundError:
            return
        if previous is not None and created >= previous[1] - 1.0 and not _alive(previous[0]):
            lock.unlink(missing_ok=True)
            log.warning("removed %s, left by a build killed midway (pid %d)", lock, previous[0])
            return
        if time.time() - created > STALE_S or time.monotonic() > deadline:
            raise StaleBuildLock(
                f"{flag}: {lock} is the lock of an extension build that was killed midway, and every "
                "job would wait on it forever; delete it once no build is running"
            )
        time.sleep(1.0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid != os.getpid()


def load_shm_comm() -> None:
    """Build or load DeepSpeed's shared-memory CPU collectives before its process group does.

    DeepSpeed's CPU backend JIT-loads this op in every rank at start-up (`swbert.runtime.dist.
    init_distributed` calls this first); loaded here, through `load_op`, a rank killed during that
    load cannot leave a lock that hangs every later job (DeepSpeed's own load then returns the op
    this process already has)."""
    import_deepspeed()
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        load_op(builder, "DeepSpeed's CPU collectives (deepspeed_shm_comm)")


def prebuild() -> str:
    """Build now the ops every job on this machine loads at start-up, so that no job (or test) pays
    for the build: DeepSpeed's shared-memory collectives on a CPU machine; nothing on a GPU, whose
    ops (FusedAdam, CPU Adam) are built when a run chooses them. Returns what it did, in words."""
    import torch

    if torch.cuda.is_available():
        return "nothing to build ahead on a GPU machine (DeepSpeed builds a chosen op on first use)"
    started = time.monotonic()
    load_shm_comm()
    return f"DeepSpeed's CPU collectives are built ({time.monotonic() - started:.0f} s), in {build_dir('deepspeed_shm_comm')}"


if __name__ == "__main__":  # `make setup`: python -m swbert.runtime.extensions
    print(prebuild())
