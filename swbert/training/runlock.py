"""One job per run folder: an exclusive lock that names its holder.

Two jobs writing one output folder delete each other's saves and interleave `metrics.jsonl`. The
first job's rank 0 holds a POSIX record lock (`fcntl.lockf`) on `<output_dir>/.swbert.lock` for the
job's lifetime and writes its host, pid and SLURM job id into the file; a second job refuses at once
and names that holder. The kernel drops the lock when the holder dies, however it dies (kill -9, a
node that goes away on a file system with lock recovery such as NFSv4), so the next job takes the
folder over without a stale-lock cleanup step.

Why a record lock and not `flock`: a `flock` belongs to the open file, which every process forked
from rank 0 (its DataLoader workers) shares; a worker that outlived a killed rank 0 kept the folder
locked, and every restart was refused. A record lock belongs to the process that took it: forked
children never hold it, whatever file descriptors they inherit. Its one catch: POSIX drops a
process's record locks when that process closes ANY descriptor of the file, so nothing in the
holding process may open the lock file (to read the holder, say) while it holds it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO

LOCK_NAME = ".swbert.lock"
NO_LOCK_VAR = "SWBERT_RUN_LOCK"  # "off": run without the lock (a file system without locks)
# what a file system without (working) locks answers: NFS without lockd, Lustre without -o flock
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


class RunFolderBusy(RuntimeError):
    """Another job holds the run folder."""


class RunLock:
    def __init__(self, output_dir: Path) -> None:
        self.path = Path(output_dir) / LOCK_NAME
        self._file: IO[str] | None = None

    def acquire(self) -> RunLock:
        """Take the lock or raise RunFolderBusy naming its holder; a file system without locks is a
        ValueError naming the folder and the way out."""
        if os.environ.get(NO_LOCK_VAR, "").lower() == "off":
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")
        try:
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            if err.errno in (errno.EACCES, errno.EAGAIN):
                raise RunFolderBusy(
                    f"{self.path.parent} is in use by another job ({holder}); wait for it to end, stop "
                    "it, or choose another --output-dir"
                ) from None
            if err.errno in _NO_LOCKS:
                raise ValueError(
                    f"--output-dir {self.path.parent}: its file system does not support file locks "
                    f"({os.strerror(err.errno)}), which keep a second job out of the run folder; put "
                    f"the run on a file system with locks (a local disk, NFS with lockd, Lustre mounted "
                    f"with -o flock), or set {NO_LOCK_VAR}=off if you are sure no other job uses it"
                ) from None
            raise
        f.seek(0)
        f.truncate()
        f.write(
            json.dumps(
                {
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                    "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                }
            )
        )
        f.flush()
        self._file = f
        return self

    def release(self) -> None:
        if self._file is not None:
            fcntl.lockf(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
