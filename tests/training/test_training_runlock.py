"""Unit tests of the run-folder lock (swbert.training.runlock): one job per folder, the holder
named, the lock released with its process and never held by a forked child."""

from __future__ import annotations

import json
import os

import pytest

from swbert.training.runlock import LOCK_NAME, NO_LOCK_VAR, RunFolderBusy, RunLock


def other_process_locks(folder) -> str:
    """What `RunLock(folder).acquire()` gives in another process (a record lock is per process):
    "acquired", or the refusal's text. Forked: the child only touches the file and a pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            RunLock(folder).acquire()
            said = "acquired"
        except RunFolderBusy as err:
            said = str(err)
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        return f.read()


def test_a_second_job_is_refused_naming_the_holder_and_gets_the_folder_once_released(tmp_path):
    # (the holder must not open the lock file itself: closing any descriptor of it drops a record lock)
    lock = RunLock(tmp_path / "run").acquire()
    said = other_process_locks(tmp_path / "run")
    assert "is in use by another job" in said
    holder = json.loads(said[said.index("{") : said.rindex("}") + 1])
    assert holder["pid"] == os.getpid() and {"host", "since", "slurm_job_id"} <= set(holder)
    assert "--output-dir" in said
    lock.release()
    assert other_process_locks(tmp_path / "run") == "acquired"


def test_release_is_idempotent_and_the_lock_can_be_taken_again(tmp_path):
    lock = RunLock(tmp_path).acquire()
    lock.release()
    lock.release()
    RunLock(tmp_path).acquire().release()


def test_the_lock_can_be_turned_off_for_file_systems_without_locks(tmp_path, monkeypatch):
    monkeypatch.setenv(NO_LOCK_VAR, "off")
    RunLock(tmp_path).acquire()
    assert not (tmp_path / LOCK_NAME).exists()


def test_the_lock_is_not_left_to_a_forked_child(tmp_path):
    """A DataLoader worker forked from rank 0 that outlives it must not keep the folder locked
    (as an flock, shared with the open file, would)."""
    lock = RunLock(tmp_path).acquire()
    hold, go = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: holds the inherited descriptor open until told to go
        os.read(hold, 1)
        os._exit(0)
    try:
        lock.release()
        assert other_process_locks(tmp_path) == "acquired"
    finally:
        os.write(go, b"x")
        os.waitpid(pid, 0)


@pytest.fixture(autouse=True)
def _lock_on(monkeypatch):
    monkeypatch.delenv(NO_LOCK_VAR, raising=False)
