"""A run's integrity on its side of the file system: the run lock and loader workers, resume
changes, config checks before any work, and clean stops with a meaningful status."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import subprocess
import sys

import psutil
import pytest

from swbert.training.runlock import RunFolderBusy, RunLock
from tests.launch_utils import REPO, job_env


def test_a_killed_rank_0_leaves_no_worker_and_no_lock(tmp_path):
    """kill -9 of rank 0 alone (the OOM killer's way) used to leave its forked loader workers alive,
    holding the run lock: every restart was refused. Now the workers die with the rank and never
    held the lock, so a restart is accepted at once."""
    out = tmp_path / "run"
    rank0 = subprocess.Popen(
        [sys.executable, "tests/scripts/lock_and_loader.py", str(out)],
        cwd=REPO,
        env=job_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        workers = [psutil.Process(int(p)) for p in rank0.stdout.readline().split()]
        assert len(workers) == 2
        with pytest.raises(RunFolderBusy, match="is in use by another job"):
            RunLock(out).acquire()
        os.kill(rank0.pid, signal.SIGKILL)
        rank0.wait(timeout=10)
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"loader workers outlived their rank: {alive}"
    finally:
        rank0.kill()
        for w in psutil.Process().children(recursive=True):
            if w.pid != rank0.pid:
                w.kill()
    lock = RunLock(out).acquire()  # the restart's rank 0
    lock.release()


def test_a_file_system_without_locks_is_one_line_naming_the_folder(tmp_path, monkeypatch):
    def no_locks(*_args):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    with pytest.raises(ValueError) as err:
        RunLock(tmp_path / "run").acquire()
    text = str(err.value)
    assert "\n" not in text and f"--output-dir {tmp_path / 'run'}" in text
    assert "does not support file locks" in text and "SWBERT_RUN_LOCK=off" in text
    monkeypatch.setenv("SWBERT_RUN_LOCK", "off")
    RunLock(tmp_path / "run").acquire().release()
