"""The heartbeat against a real TCPStore that stalls (its process stopped) or restarts: a live rank
keeps beating and is never taken for lost, and a rank holds one store connection more than its
process group's, however many threads use it."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.launch_utils import HANG_S, REPO, free_port, job_env, kill_group, slowdown, start, wait_for

STORE_TIMEOUT_S = 2.0  # the heartbeat's store timeout in the ranks below (10 s in a job)
BEAT_S = 0.5  # the heartbeat's interval in the ranks below (2 s in a job)
AFTER_S = 3.0  # the neighbour watch's window: 6 beats
STALL_S = 5.0  # longer than the store timeout and the window

# A TCPStore server in a process of its own, as torchrun's agent or rank 0 holds it.
SERVER = """
import datetime, sys, time, torch
store = torch.distributed.TCPStore(
    "127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
)
print("up", flush=True)
time.sleep(3600)
"""

# One rank of three: the store client its process group would hold, then the heartbeat with its
# watch and a call of lost(), as pretraining uses them; it reports its connections to the store
# each second.
RANK = """
import datetime, importlib.util, sys, time
import psutil, torch

# dist.py needs torch alone: loaded from its file, a rank starts in the time torch takes to import,
# not the whole package's (transformers and the models)
spec = importlib.util.spec_from_file_location("dist", "swbert/runtime/dist.py")
dist = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dist)
Heartbeat = dist.Heartbeat

rank, port = int(sys.argv[1]), int(sys.argv[2])
beat_s, after_s, timeout_s = (float(x) for x in sys.argv[3:])
Heartbeat.MIN_INTERVAL = beat_s
Heartbeat.STORE_TIMEOUT = datetime.timedelta(seconds=timeout_s)


def connections():
    return sum(1 for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr.port == port)


group = torch.distributed.TCPStore("127.0.0.1", port, timeout=datetime.timedelta(seconds=60))
base = connections()
heartbeat = Heartbeat(rank, 3)
heartbeat.watch(after_s)
print("lost:", heartbeat.lost(), flush=True)
while True:
    print("connections", base, connections(), flush=True)
    time.sleep(1.0)
"""


def key(rank: int) -> str:
    return f"swbert/heartbeat/{rank}"


class Job:
    """A store server and three ranks: 0 and 1 real processes beating into it and watching their
    neighbours (each other and rank 2), rank 2 a counter this test writes when it likes."""

    def __init__(self, tmp_path: Path) -> None:
        self.port, self.ranks = free_port(), []
        self.server = self.start_server()
        self.logs = [tmp_path / f"rank{r}.log" for r in (0, 1)]
        env = job_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port))
        args = [str(self.port), str(BEAT_S), str(AFTER_S), str(STORE_TIMEOUT_S)]
        try:
            for r in (0, 1):
                self.ranks.append(
                    subprocess.Popen(
                        [sys.executable, "-c", RANK, str(r), *args],
                        cwd=REPO,
                        env=env,
                        stdout=open(self.logs[r], "w"),
                        stderr=subprocess.STDOUT,
                    )
                )
            for r in (0, 1):
                wait_for(lambda r=r: "connections" in self.log(r), proc=self.ranks[r])
            self.rank2, self.rank2_store = 0, self.client()
        except BaseException:
            self.close()
            raise

    def start_server(self) -> subprocess.Popen:
        server = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(self.port)], env=job_env(), stdout=subprocess.PIPE, text=True
        )
        if server.stdout.readline().strip() != "up":
            server.kill()
            server.wait(timeout=30)
            raise RuntimeError(f"the store server on port {self.port} did not start")
        return server

    def client(self) -> torch.distributed.TCPStore:
        return torch.distributed.TCPStore(
            "127.0.0.1", self.port, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S)
        )

    def beat_as_rank_2(self, seconds: float) -> None:
        """Rank 2's heartbeat for `seconds`, written by this process from its first moment."""
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            self.rank2 += 1
            self.rank2_store.set(key(2), f"{self.rank2} {socket.gethostname()} pid {os.getpid()}")
            time.sleep(BEAT_S)

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text()

    def connections(self, rank: int) -> tuple[int, int]:
        """(before the heartbeat, now): this rank's connections to the store, as it last reported."""
        line = [x for x in self.log(rank).splitlines() if x.startswith("connections")][-1]
        base, now = line.split()[1:]
        return int(base), int(now)

    def beats(self) -> dict[int, int | None]:
        """The heartbeat counters of ranks 0 and 1 in the store now (None: not there)."""
        store = self.client()
        return {r: int(store.get(key(r)).split()[0]) if store.check([key(r)]) else None for r in (0, 1)}

    def beating(self, since: dict[int, int | None]) -> bool:
        now = self.beats()
        return all(now[r] is not None and (since[r] is None or now[r] > since[r]) for r in (0, 1))

    def assert_alive(self) -> None:
        for r in (0, 1):  # a watch that takes a neighbour for lost ends its process (status 3)
            assert self.ranks[r].poll() is None, f"rank {r} exited {self.ranks[r].returncode}:\n{self.log(r)}"

    def close(self) -> None:
        for p in [*self.ranks, self.server]:
            p.kill()  # SIGKILL ends a stopped process too
            p.wait(timeout=30)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One job for both tests below: the store restart first (it leaves every rank running and
    beating through a new connection), then the stall, which ends with the ranks naming rank 2."""
    job = Job(tmp_path_factory.mktemp("heartbeat"))
    try:
        yield job
    finally:
        job.close()


@pytest.mark.slow
def test_a_rank_holds_one_store_connection_and_replaces_it_when_it_breaks(job):
    """Beat, watch and lost() share one client: one connection to the store besides the process
    group's (a client per thread made three). The store then restarts on its port, breaking every
    connection to it: each rank's beat opens a new one and goes on, the old one is let go, and
    no rank takes another for lost (rank 2, which never reports here, included)."""
    for r in (0, 1):
        base, now = job.connections(r)
        assert base == 1 and now == base + 1, (r, base, now)

    job.server.kill()
    job.server.wait(timeout=30)
    job.server = job.start_server()  # empty: the beats are there again only if the ranks reconnected
    wait_for(lambda: job.beating({0: None, 1: None}))
    time.sleep(AFTER_S + 2.0)
    job.assert_alive()
    after = job.beats()
    wait_for(lambda: job.beating(after))  # still beating: a dead beat never gets there
    for r in (0, 1):  # the process group's broken one, and the heartbeat's new one
        base, now = job.connections(r)
        assert now == base + 1, (r, base, now, job.log(r))
    assert "heartbeat reaches the store at" in job.log(0) + job.log(1)


@pytest.mark.slow
def test_a_store_that_stalls_longer_than_its_timeout_silences_no_rank(job):
    """The store's process is stopped for 5 s, longer than the store timeout (2 s) and the watch's
    window (3 s). The ranks' reads wait or fail meanwhile; afterwards each still beats, and rank 2,
    whose beat reaches the store again only 1 s after the store answers again (as a beat that
    waited behind its own rank's blocked read, or backed off), is taken for lost by neither rank:
    the time they could not read does not count. Rank 2 silent for good is named within the window."""
    job.rank2_store = job.client()  # the store restarted in the test above: a client of the new one
    before = job.beats()
    wait_for(lambda: job.beating(before))
    job.beat_as_rank_2(2.0)  # ranks 0 and 1 see it beat
    os.kill(job.server.pid, signal.SIGSTOP)
    time.sleep(STALL_S)
    os.kill(job.server.pid, signal.SIGCONT)
    time.sleep(1.0)
    job.beat_as_rank_2(AFTER_S + 2.0)  # the whole window again, and a few beats more
    job.assert_alive()
    after = job.beats()
    wait_for(lambda: job.beating(after))  # still beating: a dead beat never gets there

    # The watches are live: a neighbour that falls silent is named within the window. A loaded
    # machine lengthens it: a watch whose own reads come late starts its clocks again (above), so
    # the 15 s of slack past the window, ample on an idle machine, scale with the load.
    limit = AFTER_S + 15 * slowdown()
    for r in (0, 1):
        assert job.ranks[r].wait(timeout=limit) == 3, job.log(r)
        named = f"error: lost rank 2 (on {socket.gethostname()} pid {os.getpid()}): its heartbeat stood still"
        assert named in job.log(r), job.log(r)


@pytest.mark.slow
@pytest.mark.long
def test_a_job_outlives_a_store_stall_longer_than_its_timeout(data_dir, tmp_path):
    """A 2-rank pretraining job under torchrun, whose agent holds the store: the agent is stopped for
    12 s, longer than the heartbeat's store timeout (10 s) and the lost-rank window
    (SWBERT_LOST_RANK_MIN=0.1: 6 s), while the ranks train on. No rank is taken for lost in the
    window after: the job is then pre-empted (SIGUSR1: checkpoint and stop; each rank exits 75).
    Each rank holds two connections to the store: its process group's and its heartbeat's."""
    out = tmp_path / "run"
    args = [
        "--config", "tiny_cpu", "--data-dir", str(data_dir), "--output-dir", str(out), "--mlflow", "false",
        "--save-interval", "1000", "--export", "false", "--log-interval", "1", "--train-steps", "100000",
    ]  # fmt: skip
    log = tmp_path / "job.log"
    agent = start(2, args, env=job_env(SWBERT_LOST_RANK_MIN="0.1"), log=log)
    try:
        metrics = out / "metrics.jsonl"
        wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 3, proc=agent)
        ranks = psutil.Process(agent.pid).children()
        assert len(ranks) == 2, ranks
        for rank in ranks:
            port = int(rank.environ()["MASTER_PORT"])
            held = [c for c in rank.net_connections("tcp") if c.raddr and c.raddr.port == port]
            assert len(held) == 2, held

        os.kill(agent.pid, signal.SIGSTOP)
        time.sleep(12)
        os.kill(agent.pid, signal.SIGCONT)
        steps = len(metrics.read_text().splitlines())
        time.sleep(6 + 2 * 2.0)  # the window, and a beat or two more
        assert agent.poll() is None, log.read_text()[-3000:]
        assert len(metrics.read_text().splitlines()) > steps  # still training

        for rank in ranks:
            rank.send_signal(signal.SIGUSR1)
        # the ranks exit 75 (pre-empted), which torchrun reports as 1, as any non-zero status
        assert agent.wait(timeout=HANG_S) == 1, log.read_text()[-3000:]
    finally:
        kill_group(agent)
    text = log.read_text()
    assert "pre-empted: checkpoint saved at step" in text and "lost rank" not in text, text[-3000:]
