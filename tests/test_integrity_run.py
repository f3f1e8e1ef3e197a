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


BAD_FLAGS = [
    (["--eval-batches", "-1"], "eval_batches=-1 must be 0 or more"),
    (["--train-tokens", "-100"], "train_tokens=-100 must be positive"),
    (["--num-threads", "-1"], "num_threads=-1 must be positive"),
    (["--grad-clip", "-1"], "grad_clip=-1.0 must be 0 or more (0 disables clipping)"),
    (["--warmup-steps", "-5"], "warmup_steps=-5 must be 0 or more"),
    (["--weight-decay", "-0.1"], "weight_decay=-0.1 must be 0 or more"),
    (["--lr", "1e-3", "--min-lr", "1e-2"], "min_lr=0.01 must be between 0 and lr=0.001"),
    (["--adam-beta2", "1.5"], "adam_beta2=1.5 must be in [0, 1)"),
    (["--seq-len", "100000"], "seq_len=100000 with micro_batch_size=4 needs at least"),
]


def test_every_bad_value_is_one_line_and_exit_2_before_any_process_group(tmp_path, capsys):
    """Each used to be accepted (and trained wrong, or nothing) or to end in a deep traceback."""
    from tests.test_pretrain import refused, tiny_args

    for extra, message in BAD_FLAGS:
        err = refused(tiny_args(tmp_path, tmp_path / "run", *extra), capsys)
        assert message in err and err.count("\n") == 1, (extra, err)


RECIPES = [
    (
        "wrong_type.yaml",
        "size: tiny\nlr: [1, 2]\n",
        ", line 2, key 'lr': lr=[1, 2] is a list, expected a number",
    ),
    ("syntax.yaml", "size: tiny\nlr: 1\n  x: [\n", ", line 3: not valid YAML"),
    (
        "negative.yaml",
        "size: tiny\n\nwarmup_steps: -5\n",
        ", line 3, key 'warmup_steps': warmup_steps=-5 must be",
    ),
    ("syntax.toml", 'size = "tiny"\nlr = \n', ": not valid TOML (Invalid value (at line 2"),
    ("binary.yaml", bytes(range(256)) * 4, " is not a text file"),
]


@pytest.mark.parametrize(("name", "text", "message"), RECIPES, ids=[r[0] for r in RECIPES])
def test_a_bad_recipe_names_its_file_line_and_key(name, text, message, tmp_path, capsys):
    from tests.test_pretrain import refused, tiny_args

    recipe = tmp_path / name
    recipe.write_bytes(text if isinstance(text, bytes) else text.encode())
    args = tiny_args(tmp_path, tmp_path / "run")
    err = refused([*args, "--config", str(recipe)], capsys)  # the last --config wins
    assert f"error: recipe {recipe}{message}" in err and err.count("\n") == 1, err


def test_eval_batches_0_logs_no_validation():
    """It used to log val_loss 0.0 and perplexity 1.0 (a loss over no tokens) at every evaluation."""
    from types import SimpleNamespace

    from swbert.training.config import TrainConfig
    from swbert.training.trainer import Trainer

    trainer = Trainer(TrainConfig(eval_batches=0))
    trainer.data = SimpleNamespace(has_valid=True)
    assert trainer.evaluate() == {}
