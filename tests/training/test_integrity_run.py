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
from tests.launch_utils import HANG_S, REPO, job_env, slowdown, wait_for


@pytest.mark.slow
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
    workers: list[psutil.Process] = []
    try:
        workers = [psutil.Process(int(p)) for p in rank0.stdout.readline().split()]
        assert len(workers) == 2
        with pytest.raises(RunFolderBusy, match="is in use by another job"):
            RunLock(out).acquire()
        os.kill(rank0.pid, signal.SIGKILL)
        rank0.wait(timeout=10)
        # they die with it (the kernel ends them), while orphans outlived it for good: 10 s is ample
        # on an idle machine, more under load
        _, alive = psutil.wait_procs(workers, timeout=10 * slowdown())
        assert not alive, f"loader workers outlived their rank: {alive}"
    finally:
        rank0.kill()
        for w in workers:  # orphans (before the fix) are no children of this process
            try:
                w.kill()
            except psutil.NoSuchProcess:
                pass
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
    from tests.e2e.test_pretrain import refused, tiny_args

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
    from tests.e2e.test_pretrain import refused, tiny_args

    recipe = tmp_path / name
    recipe.write_bytes(text if isinstance(text, bytes) else text.encode())
    args = tiny_args(tmp_path, tmp_path / "run")
    err = refused([*args, "--config", str(recipe)], capsys)  # the last --config wins
    assert f"error: recipe {recipe}{message}" in err and err.count("\n") == 1, err


def test_eval_batches_0_logs_no_validation():
    """It used to log val_loss 0.0 and perplexity 1.0 (a loss over no tokens) at every evaluation."""
    from swbert.training.config import TrainConfig
    from swbert.training.trainer import Trainer

    assert Trainer(TrainConfig(eval_batches=0)).evaluate() == {}  # before any data is read


def test_optimizer_settings_given_on_resume_are_applied_to_the_restored_state():
    """A checkpoint restores the saved betas, eps, weight decay and peak LR; they used to win
    silently over the resumed run's --lr, --weight-decay and --adam-* flags."""
    import torch

    from swbert.runtime.optim import apply_hyperparameters, build_optimizer, build_scheduler

    def build(lr: float, wd: float, betas: tuple[float, float], eps: float):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        opt = build_optimizer(model, lr=lr, weight_decay=wd, betas=betas, eps=eps)
        return model, opt, build_scheduler(opt, total=10, warmup=5)

    model, opt, sched = build(2e-3, 0.01, (0.9, 0.98), 1e-6)
    for _ in range(3):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        sched.step()
    model, new_opt, new_sched = build(1e-3, 0.1, (0.8, 0.95), 1e-8)
    new_opt.load_state_dict(opt.state_dict())  # what a resume restores
    new_sched.load_state_dict(sched.state_dict())
    changes = apply_hyperparameters(new_opt, new_sched, 1e-3, 0.1, (0.8, 0.95), 1e-8)
    assert changes == [
        "betas: (0.9, 0.98) -> (0.8, 0.95)",
        "eps: 1e-06 -> 1e-08",
        "weight_decay: 0.01 -> 0.1",
        "lr: 0.002 -> 0.001",
    ]
    decay, no_decay = new_opt.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert decay["betas"] == no_decay["betas"] == (0.8, 0.95) and decay["eps"] == 1e-8
    assert new_sched.get_last_lr() == pytest.approx([1e-3 * 4 / 5] * 2)  # after 3 of 5 warm-up steps
    new_sched.step()
    assert decay["lr"] == pytest.approx(1e-3)


@pytest.mark.slow
def test_a_stop_signal_amid_a_long_call_is_acknowledged_at_once():
    """Python runs a handler only when the main thread's current call returns: a SIGTERM amid a
    long step used to go unanswered for as long as the step lasted. "At once" is read from the
    process, not a clock: the acknowledgement comes while the long call (its `sleep 4` child) runs."""
    proc = subprocess.Popen(
        [sys.executable, "tests/scripts/busy_when_signalled.py"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "busy\n"
        wait_for(lambda: psutil.Process(proc.pid).children(), proc=proc)  # the long call has begun
        proc.send_signal(signal.SIGTERM)
        line = proc.stderr.readline()
        in_call = psutil.Process(proc.pid).children(recursive=True)  # the long call, still running
        assert line.startswith("SIGTERM received: checkpointing at the end of this step"), line
        assert "exit status 75" in line and in_call, "acknowledged only once the long call returned"
        assert proc.poll() is None  # still in the long call: the handler has not run yet
        assert proc.wait(timeout=HANG_S) == 0
        assert proc.stdout.read() == "handled\nreturned\n"  # the handler ran once the call returned
    finally:
        proc.kill()


@pytest.mark.slow
def test_a_full_disk_between_saves_stops_every_rank_with_one_message(data_dir, tmp_path):
    """Rank 0 cannot append to metrics.jsonl after the step-2 checkpoint. It used to die alone with
    a raw traceback, the other rank reported rank 0 as lost, and a torn last line was left that
    the report refused. Now every rank stops before the next update with one message naming the file,
    the free space and where --resume auto continues; metrics.jsonl stays whole."""
    from tests.launch_utils import launch, read_metrics

    out = tmp_path / "run"
    args = [
        "--config", "tiny_cpu", "--data-dir", str(data_dir), "--output-dir", str(out), "--mlflow", "false",
        "--train-steps", "6", "--save-interval", "2", "--export", "false", "--log-interval", "1",
    ]  # fmt: skip
    full = launch(
        2,
        args,
        env=job_env(SWBERT_DIST_TIMEOUT_MIN="1"),
        script="tests/scripts/pretrain_full_disk_after_save.py",
        torchrun=True,  # stderr a pipe: a forked rank's log file would meet its own file size limit
    )
    assert full.returncode != 0
    error = (
        f"error: stopping after step 3 on every rank: {out / 'metrics.jsonl'} could not be written (OSError: "
    )
    assert full.stderr.count(error) == 2, full.stderr[-5000:]  # from each rank
    line = next(x for x in full.stderr.splitlines() if x.startswith(error))
    assert "MiB free there); it is kept whole" in line and "it continues from step_00000002" in line
    assert "lost rank" not in full.stderr and "Traceback" not in full.stderr.split(error)[0]
    assert (out / "metrics.jsonl").read_text().endswith("\n") and sorted(read_metrics(out)) == [1, 2]


def test_a_torn_metrics_line_is_set_aside_on_resume_and_readers_skip_it(tmp_path):
    """A run cut off amid a write left a torn last line; `launchers/report.py` refused the file and
    a resumed run appended after it (a line of two half records)."""
    from swbert.finetune.figures import read_loss_curve
    from swbert.training.metrics import MetricsLogger

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 4.0}\n{"step": 2, "loss": 3.5}\n{"step": 3, "lo')
    assert read_loss_curve(tmp_path) == ([1, 2], [4.0, 3.5])
    logger = MetricsLogger(tmp_path, "run", {}, use_mlflow=False)
    logger.log(3, {"loss": 3.0})
    logger.close()
    assert (
        path.read_text() == '{"step": 1, "loss": 4.0}\n{"step": 2, "loss": 3.5}\n{"step": 3, "loss": 3.0}\n'
    )
    assert (tmp_path / "metrics.jsonl.torn").read_text() == '{"step": 3, "lo\n'  # kept, never deleted
    path.write_text('{"step": 1, "loss": 4.0}\nnot json\n{"step": 2, "loss": 3.5}\n')
    with pytest.raises(ValueError, match="line 2: not JSON"):  # only a torn last line is forgiven
        read_loss_curve(tmp_path)


def test_a_write_the_disk_cuts_off_leaves_metrics_whole(tmp_path):
    """The kernel cuts a write at the file size limit as a full disk does: the record is taken
    back whole and the error names the file and the free space (in a forked child: the limit is
    per process)."""
    import resource

    from swbert.training.metrics import MetricsLogger, MetricsWriteError

    path = tmp_path / "metrics.jsonl"
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 when all held
        code = 1
        try:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            logger = MetricsLogger(tmp_path, "run", {}, use_mlflow=False)
            logger.log(1, {"loss": 4.0})
            size = path.stat().st_size
            resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, resource.RLIM_INFINITY))
            try:
                logger.log(2, {"loss": 3.5, "note": "x" * 100})
            except MetricsWriteError as err:
                whole = path.stat().st_size == size and "MiB free there); it is kept whole" in str(err)
                code = 0 if whole and str(path) in str(err) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert path.read_text() == '{"step": 1, "loss": 4.0}\n'


def test_a_preempted_run_exits_75_distinct_from_finished_and_failed(tmp_path, capsys):
    """A pre-empted run (checkpointed on SIGTERM/SIGUSR1) used to exit 0 like a finished one, so a
    scheduler could not tell it needs requeueing. (The trainer's side of the stop is run for real
    in tests/e2e/test_checkpoint_safety.py; here the launcher's mapping of its status.)"""
    from unittest import mock

    from swbert.launchers.pretrain import main

    from swbert.runtime.exits import PREEMPTED_EXIT
    from tests.e2e.test_pretrain import tiny_args

    assert PREEMPTED_EXIT == 75
    with (
        mock.patch.dict(os.environ),
        mock.patch("swbert.training.trainer.run", return_value={"status": "KILLED"}),
    ):
        with pytest.raises(SystemExit) as stopped:
            main(tiny_args(tmp_path, tmp_path / "run"))
    assert stopped.value.code == 75
