"""Faults a launcher may or may not handle for us: a rank that dies or hangs where no launcher tears
the job down (srun-style, one process per rank), and signals under the deepspeed launcher."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swbert.runtime.dist import Heartbeat
from swbert.training import checkpoint as ckpt
from swbert.training.runlock import RunLock
from tests.launch_utils import HANG_S, REPO, free_port, job_env, kill_group, read_metrics, wait_for

# The collective timeout a lost rank must never be waited for (SWBERT_DIST_TIMEOUT_MIN's default):
# a survivor still running at a third of it waits on it, however loaded the machine.
DEFAULT_COLLECTIVE_TIMEOUT_S = 30 * 60


def start_rank(rank: int, world: int, port: int, args: list[str], log: Path, **env: str) -> subprocess.Popen:
    """One rank as srun starts it: its own process, RANK/WORLD_SIZE/MASTER_ADDR in the environment."""
    ranks = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    return subprocess.Popen(
        [sys.executable, "launchers/pretrain.py", *args],
        cwd=REPO,
        env=job_env(**ranks, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env),
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "victim"),
    # CI: the store's holder killed; a hung rank is named by the heartbeat in the test below
    [
        pytest.param("killed", 1, marks=pytest.mark.long),
        pytest.param("hung", 1, marks=pytest.mark.long),
        ("killed", 0),
    ],
)
def test_a_lost_rank_without_a_launcher_is_named_by_the_others(fault, victim, data_dir, tmp_path):
    """srun-style ranks, no launcher to end the job: one rank killed (-9) or hung (SIGSTOP) mid-run.
    The other exits on its own with an error naming the lost rank, its host and pid (rank 0, which
    holds the rendezvous store, by the store going silent): at once for a dead peer, after
    SWBERT_DIST_TIMEOUT_MIN (here 15 s) for a hung one, never the default 30 minutes. What ended it
    is read from the backend's error the message quotes (a closed connection, or a timeout), not from
    a clock a loaded machine would stretch."""
    out = tmp_path / "run"
    args = [
        "--config", "tiny_cpu", "--data-dir", str(data_dir), "--output-dir", str(out), "--mlflow", "false",
        "--save-interval", "1000", "--export", "false", "--log-interval", "1", "--train-steps", "100000",
    ]  # fmt: skip
    port, survivor = free_port(), 1 - victim
    logs = [tmp_path / f"rank{r}.log" for r in (0, 1)]
    ranks = [start_rank(r, 2, port, args, logs[r], SWBERT_DIST_TIMEOUT_MIN="0.25") for r in (0, 1)]
    try:
        wait_for(lambda: logged_steps(out) >= 3, proc=ranks[0])
        os.kill(ranks[victim].pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        started = time.monotonic()
        ranks[survivor].wait(timeout=DEFAULT_COLLECTIVE_TIMEOUT_S / 3)
        took = time.monotonic() - started
    finally:
        for p in ranks:
            p.kill()
            p.wait(timeout=30)
    text = logs[survivor].read_text()
    assert ranks[survivor].returncode == 3, text[-3000:]
    if victim == 0:  # its loader worker died with it and never held the lock: a restart may start
        RunLock(out).acquire().release()
    if victim == 1:
        named = (
            f"error: lost rank 1 (on {socket.gethostname()} pid {ranks[1].pid}): its heartbeat stood still"
        )
    else:
        named = f"error: the rendezvous store at 127.0.0.1:{port}, held by rank 0, no longer answers"
    assert named in text and f"Rank {survivor} stops" in text and "--resume auto" in text, text[-3000:]
    assert "its collective failed with: " in text, text[-3000:]
    failed_with = text.split("its collective failed with: ")[-1].split(". Restart")[0]
    if fault == "killed":  # gloo sees the closed connection at once, never waiting for the timeout
        assert "Timed out" not in failed_with, text[-3000:]
    else:  # the collective timeout (15 s, not 30 minutes), then the heartbeat check
        assert "Timed out" in failed_with and 15 <= took, (took, text[-3000:])
        assert "SWBERT_DIST_TIMEOUT_MIN=0.25" in text


@pytest.mark.slow
def test_a_hung_neighbour_ends_the_job_before_the_collective_timeout(data_dir, tmp_path):
    """Under NCCL a collective with a dead peer waits the whole collective timeout and is then
    aborted without a word; the heartbeat watch does not wait for it. Here the collective timeout is
    30 minutes and SWBERT_LOST_RANK_MIN 0.2 (12 s): rank 0 names the stopped rank 1 and exits
    with status 3 long before, from its watch thread (its main thread is blocked in the collective):
    the watch's message, and a wait far shorter than the collective timeout, however loaded the
    machine (a watch whose reads come late starts its clocks again, so load lengthens the 12 s)."""
    out = tmp_path / "run"
    args = [
        "--config", "tiny_cpu", "--data-dir", str(data_dir), "--output-dir", str(out), "--mlflow", "false",
        "--save-interval", "1000", "--export", "false", "--log-interval", "1", "--train-steps", "100000",
    ]  # fmt: skip
    port = free_port()
    logs = [tmp_path / f"rank{r}.log" for r in (0, 1)]
    env = {"SWBERT_DIST_TIMEOUT_MIN": "30", "SWBERT_LOST_RANK_MIN": "0.2"}
    ranks = [start_rank(r, 2, port, args, logs[r], **env) for r in (0, 1)]
    try:
        wait_for(lambda: logged_steps(out) >= 3, proc=ranks[0])
        os.kill(ranks[1].pid, signal.SIGSTOP)
        started = time.monotonic()
        ranks[0].wait(timeout=DEFAULT_COLLECTIVE_TIMEOUT_S / 3)
        took = time.monotonic() - started
    finally:
        for p in ranks:
            p.kill()
            p.wait(timeout=30)
    text = logs[0].read_text()
    assert ranks[0].returncode == 3, text[-3000:]
    named = f"error: lost rank 1 (on {socket.gethostname()} pid {ranks[1].pid}): its heartbeat stood still for 12 s"
    assert named in text and "SWBERT_LOST_RANK_MIN=0.2" in text and "--resume auto" in text, text[-3000:]
    # the window runs from when rank 0 saw rank 1's last beat, written up to an interval before rank
    # 1 stopped (more on a loaded machine, whose beat thread runs late): allow two. The watch's own
    # message above says it, not the collective, ended the job, within the wait's third of its timeout.
    assert 12 - 2 * Heartbeat.MIN_INTERVAL <= took, took


def start_deepspeed(args: list[str], log: Path) -> subprocess.Popen:
    """`deepspeed --num_gpus 2 launchers/pretrain.py ARGS` (2 CPU ranks here) in its own process group."""
    cmd = [
        str(Path(sys.executable).parent / "deepspeed"),
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
    ]
    return subprocess.Popen(
        [*cmd, "launchers/pretrain.py", *args],
        cwd=REPO,
        env=job_env(),
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def saved_step(text: str) -> int:
    assert "pre-empted: checkpoint saved at step " in text, text[-3000:]
    return int(text.split("pre-empted: checkpoint saved at step ")[-1].split()[0])


@pytest.mark.slow
def test_signals_under_the_deepspeed_launcher_checkpoint_and_the_run_resumes(data_dir, tmp_path):
    """On one node the `deepspeed` runner forwards no signal: SIGTERM to it used to end the runner
    alone and leave launch.py and the workers training as orphans. The workers watch the runner,
    checkpoint at the current step and exit within launch.py's 30 s grace. Resumed, the job gets
    SIGUSR1 on its whole process group (as a signal through srun or scancel reaches every process):
    the runner and launch.py die of it at once, and the workers, which used to be killed with their
    launcher, checkpoint and exit too. Every step is logged once across the three runs' worth."""
    import psutil

    out, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    args = [
        "--config", "tiny_cpu", "--data-dir", str(data_dir), "--output-dir", str(out), "--mlflow", "false",
        "--save-interval", "1000", "--export", "false", "--log-interval", "1", "--train-steps", "100000",
    ]  # fmt: skip
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = start_deepspeed(args, first_log)
    try:
        wait_for(lambda: logged_steps(out) >= 2, proc=first)
        family = psutil.Process(first.pid).children(recursive=True)  # launch.py and the two workers
        os.kill(first.pid, signal.SIGTERM)
        _, alive = psutil.wait_procs(family, timeout=HANG_S)
        assert not alive, alive
    finally:
        kill_group(first)
    text = first_log.read_text()
    saved = saved_step(text)
    # a worker killed at the end of launch.py's grace would have left no checkpoint
    assert f"the deepspeed launcher (pid {first.pid}) exited: checkpointing and stopping" in text
    assert ckpt.newest_complete(root) == ckpt.tag_for(saved) and max(read_metrics(out)) == saved

    second = start_deepspeed([*args, "--resume", "auto"], second_log)
    try:
        wait_for(lambda: logged_steps(out) >= saved + 2, proc=second)
        family = [psutil.Process(second.pid), *psutil.Process(second.pid).children(recursive=True)]
        os.killpg(second.pid, signal.SIGUSR1)
        _, alive = psutil.wait_procs(family, timeout=HANG_S)
        assert not alive, alive
    finally:
        kill_group(second)
    text = second_log.read_text()
    assert f"resumed from {root / ckpt.tag_for(saved)} at step {saved}" in text, text[-3000:]
    again = saved_step(text)
    assert again > saved and ckpt.newest_complete(root) == ckpt.tag_for(again)
    assert sorted(read_metrics(out)) == list(range(1, again + 1))


def test_the_lost_rank_minutes_are_checked(monkeypatch):
    from swbert.runtime.dist import watch_for_lost_ranks

    for bad in ("soon", "-1"):
        monkeypatch.setenv("SWBERT_LOST_RANK_MIN", bad)
        with pytest.raises(ValueError, match=f"SWBERT_LOST_RANK_MIN='{bad}' is not a number of minutes"):
            watch_for_lost_ranks()
