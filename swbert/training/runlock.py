"""One job per run folder: an exclusive lock that names its holder.

Two jobs writing one output folder delete each other's saves and interleave `metrics.jsonl`. The
first job's rank 0 holds an advisory lock (`flock`) on `<output_dir>/.swbert.lock` for the job's
lifetime and writes its host, pid and SLURM job id into the file; a second job refuses at once and
names that holder. The kernel drops the lock when the holder dies, however it dies (kill -9, a
node that goes away on a file system with lock recovery such as NFSv4), so the next job takes the
folder over without a stale-lock cleanup step.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO

LOCK_NAME = ".swbert.lock"


class RunFolderBusy(RuntimeError):
    """Another job holds the run folder."""


class RunLock:
    def __init__(self, output_dir: Path) -> None:
        self.path = Path(output_dir) / LOCK_NAME
        self._file: IO[str] | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise RunFolderBusy(
                f"{self.path.parent} is in use by another job ({holder}); wait for it to end, stop it, "
                "or choose another --output-dir"
            ) from None
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
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
