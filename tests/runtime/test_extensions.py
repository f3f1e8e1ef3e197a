"""JIT-built ops load under an flock: a build killed midway never hangs a later job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from swbert.runtime import extensions
from swbert.runtime.extensions import SIDE_FILE, StaleBuildLock, build_dir, load_op
from tests.launch_utils import REPO, job_env


class Builder:
    """Stands for a DeepSpeed OpBuilder: what `load_op` needs of one is its NAME and `load`."""

    NAME = "swbert_test_op"

    def __init__(self):
        self.loads = 0

    def load(self, verbose: bool = False):
        self.loads += 1
        return "op"


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return build_dir(Builder.NAME)  # torch makes the folder


@pytest.mark.slow
def test_a_lock_left_by_a_killed_swbert_build_is_removed(folder, monkeypatch):
    """A real process takes the flock, creates torch's lock as a build does, and is killed -9."""
    code = (
        "import sys, time\nfrom pathlib import Path\nfrom swbert.runtime.extensions import _holding\n"
        f"folder = Path({str(folder)!r})\n"
        f"with _holding(folder / {SIDE_FILE!r}):\n"
        "    (folder / 'lock').touch()\n    print('building', flush=True)\n    time.sleep(120)\n"
    )
    env = job_env(TORCH_EXTENSIONS_DIR=os.environ["TORCH_EXTENSIONS_DIR"])
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "building"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    builder = Builder()

    def waited(seconds: float) -> None:  # the wait for a lock left behind polls with sleeps
        raise AssertionError("load_op waited on the lock the killed build left, instead of removing it")

    monkeypatch.setattr(extensions.time, "sleep", waited)
    assert load_op(builder, "--optimizer test") == "op"
    assert builder.loads == 1
    assert not (folder / "lock").exists()


@pytest.mark.slow
def test_a_build_in_progress_elsewhere_is_waited_for(folder):
    """A lock no swbert process made (another program building now) is waited for, not removed."""
    (folder / "lock").touch()
    builder = Builder()
    timer = threading.Timer(1.5, (folder / "lock").unlink)
    timer.start()
    started = time.monotonic()
    assert load_op(builder, "--optimizer test") == "op"
    timer.join()
    assert time.monotonic() - started >= 1.4 and builder.loads == 1


def test_an_old_lock_no_swbert_process_made_is_named(folder, monkeypatch):
    lock = folder / "lock"
    lock.touch()
    old = time.time() - 2 * extensions.STALE_S
    os.utime(lock, (old, old))
    with pytest.raises(StaleBuildLock, match=rf"^--optimizer test: {lock} is the lock of an extension build"):
        load_op(Builder(), "--optimizer test")
    assert lock.exists()  # named, never removed behind a program that may still own it


def test_a_build_is_announced_and_a_built_op_is_not(folder, caplog):
    """Issue #47: a job started with torchrun directly rebuilt DeepSpeed's ops for minutes with no
    word; now a build says so (once: a folder holding the op's library loads it quietly)."""
    import logging

    with caplog.at_level(logging.INFO, logger="swbert.runtime.extensions"):
        load_op(Builder(), "--optimizer test")
        (folder / f"{Builder.NAME}.so").touch()  # what torch's build leaves
        load_op(Builder(), "--optimizer test")
    (line,) = [r.getMessage() for r in caplog.records if "building" in r.getMessage()]
    assert Builder.NAME in line and "--optimizer test" in line and str(folder) in line


def test_a_job_without_torch_extensions_dir_builds_in_the_makefiles_folder(tmp_path):
    """A `torchrun` or `deepspeed` started by hand (no TORCH_EXTENSIONS_DIR) uses the folder `make`
    gives its jobs, where `make setup` built the ops, instead of torch's shared default cache."""
    env = {k: v for k, v in job_env().items() if k != "TORCH_EXTENSIONS_DIR"}
    code = "import os\nfrom swbert._startup import import_deepspeed\nimport_deepspeed()\nprint(os.environ['TORCH_EXTENSIONS_DIR'])"
    got = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    make = subprocess.run(
        ["make", "-s", "--no-print-directory", "-f", "-", "show"],
        input="include Makefile\nshow:\n\t@echo $$TORCH_EXTENSIONS_DIR\n",
        cwd=REPO,
        env={**env, "VENV": os.path.dirname(os.path.dirname(sys.executable))},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()[-1]
    assert got == make
