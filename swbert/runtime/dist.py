"""Process-group start-up shared by torchrun, the deepspeed launcher, srun and plain python, and what
the ranks know about each other once it runs: a rank that dies or hangs is named by the others."""

from __future__ import annotations

import ctypes
import datetime
import logging
import math
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress

import torch

from swbert._startup import import_deepspeed
from swbert.logs import known_prints_dropped
from swbert.runtime.extensions import load_shm_comm

log = logging.getLogger(__name__)


def map_launcher_env() -> None:
    """Fill RANK/LOCAL_RANK/WORLD_SIZE from SLURM (one task per GPU) or for a single process."""
    if "RANK" in os.environ:
        return
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        if "MASTER_ADDR" not in os.environ:
            raise RuntimeError(
                "running under srun without MASTER_ADDR: export MASTER_ADDR (the first node of the "
                "allocation) and MASTER_PORT in the batch script (see launchers/slurm/)"
            )
        os.environ.setdefault("MASTER_PORT", "29500")
        return
    # a plain `python launchers/pretrain.py`: one process
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def die_with_launcher() -> None:
    """Linux: a worker whose launcher (torchrun, deepspeed's launch.py) dies gets SIGTERM, so it
    checkpoints at the end of its step and exits instead of training on as an orphan that holds
    GPUs and writes into the run folder. (SIGTERM, not SIGKILL: a launcher that dies of a signal it
    does not handle, such as deepspeed's launch.py of SIGUSR1, would otherwise lose the work since
    the last checkpoint. An orphan stuck in a collective still ends, at SWBERT_DIST_TIMEOUT_MIN.)"""
    signal_on_parent_death(signal.SIGTERM)


def _libc() -> ctypes.CDLL | None:
    """The C library on Linux (glibc), else None. Loaded at import, not in a forked child
    (`preexec_fn`), where loading a library could wait on a lock another thread held at the fork."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _libc()
_PR_SET_PDEATHSIG = 1


def signal_on_parent_death(sig: int, parent_pid: int | None = None) -> None:
    """Linux: the kernel sends this process `sig` when its parent dies, however it dies (kill -9
    included). With `parent_pid`, a process whose parent is already gone exits at once. Elsewhere
    it does nothing. Safe as a `subprocess.Popen` `preexec_fn`: it imports and loads nothing."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, sig)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def stop_with_deepspeed_runner() -> None:
    """Under `deepspeed` (its runner starts deepspeed.launcher.launch, which starts the workers), stop
    this worker like SIGTERM does when the runner exits.

    On one node the runner forwards no signal: SIGTERM or SIGUSR1 to the `deepspeed` process (a
    scheduler, `timeout`, a user) ends the runner alone, and launch.py and the workers trained on
    as orphans. A thread notices the runner is gone (launch.py is handed to another parent) and
    sends this process SIGTERM: it checkpoints at the end of its step and exits; launch.py follows."""
    import psutil

    try:
        launch = psutil.Process(os.getppid())
        if "deepspeed.launcher.launch" not in launch.cmdline():
            return
        runner = launch.parent()
        if runner is None or not any(
            os.path.basename(a) in ("deepspeed", "ds") for a in runner.cmdline()[:2]
        ):
            return
    except psutil.Error:
        return

    def watch() -> None:
        try:
            while launch.ppid() == runner.pid:
                time.sleep(1.0)
        except psutil.Error:  # launch.py itself is gone: the parent-death signal has done this already
            return
        log.warning("the deepspeed launcher (pid %d) exited: checkpointing and stopping", runner.pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="swbert-deepspeed-runner", daemon=True).start()


def init_distributed(timeout_minutes: float | None = None) -> tuple[int, int, int]:
    """Start DeepSpeed's process group (NCCL on GPU, gloo on CPU). Returns (rank, local_rank, world).

    The collective timeout (default 30 min) can be set per job with SWBERT_DIST_TIMEOUT_MIN (fractions
    allowed): a rank that hangs fails the others after that long (`bound_every_group` extends it to
    the groups DeepSpeed and megatron-core create later). With more than one rank, a heartbeat
    starts, so that a failed collective can name the rank that died or hangs (`lost_ranks_named`).
    """
    deepspeed = import_deepspeed()  # when the process's first: without MLflow (swbert._startup)
    if timeout_minutes is None:
        raw = os.environ.get("SWBERT_DIST_TIMEOUT_MIN", "30")
        try:
            timeout_minutes = float(raw)
        except ValueError:
            timeout_minutes = -1.0
        if not timeout_minutes > 0:
            raise ValueError(
                f"SWBERT_DIST_TIMEOUT_MIN={raw!r} is not a positive number of minutes (e.g. 30, or 0.5)"
            )
    global _timeout
    _timeout = datetime.timedelta(minutes=timeout_minutes)
    launched = "RANK" in os.environ
    map_launcher_env()
    if launched:
        die_with_launcher()
        stop_with_deepspeed_runner()
    on_gpu = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if on_gpu:
        torch.cuda.set_device(local_rank)
    else:
        load_shm_comm()
    with known_prints_dropped():  # on CPU, a line per rank that the op it just loaded was built
        deepspeed.init_distributed(
            dist_backend="nccl" if on_gpu else "gloo",
            timeout=_timeout,
            auto_mpi_discovery=False,
        )
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if not on_gpu and world > 1:
        unlink_shm_buffer(rank)
    global _heartbeat
    if world > 1 and _heartbeat is None:
        try:
            _heartbeat = Heartbeat(rank, world)
        except Exception as err:  # a diagnosis aid only: training does not depend on it
            log.warning("no heartbeat (%s): a lost rank will not be named", err)
    return rank, local_rank, world


_timeout: datetime.timedelta | None = None


SHM_BUFFER = "/dev/shm/deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"


def unlink_shm_buffer(rank: int) -> None:
    """Unlink this rank's shared-memory buffer of DeepSpeed's CPU collectives, once mapped by all.

    Each rank creates one (67 MB, named after the rendezvous address and port) and maps every other
    rank's; DeepSpeed never unlinks them, so every CPU job left its buffers in /dev/shm, memory lost
    until reboot. After a barrier every rank has mapped every buffer (DeepSpeed's start waits for
    its peers' names), so the names can go: the mappings live until the processes exit."""
    torch.distributed.barrier()
    path = SHM_BUFFER.format(
        uid=os.getuid(),
        addr=os.environ.get("MASTER_ADDR", ""),
        port=os.environ.get("MASTER_PORT", ""),
        rank=rank,
    )
    with suppress(FileNotFoundError):
        os.unlink(path)


def bound_every_group() -> None:
    """Give every process group that exists now the job's collective timeout (init_distributed's).

    DeepSpeed creates its data-parallel group, and megatron-core its tensor-parallel groups, with
    their own default (30 minutes): without this, SWBERT_DIST_TIMEOUT_MIN bounded only the world
    group's collectives, not the gradient all-reduce a rank usually waits in. Call it once the
    engine (and every group) exists."""
    from torch.distributed import distributed_c10d as c10d

    if _timeout is None or not torch.distributed.is_initialized():
        return
    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(_timeout, group)


class LostRanks(RuntimeError):
    """A collective failed because other ranks died or hang; the message names them."""


class Heartbeat:
    """Every rank bumps a counter in the rendezvous store (`MASTER_ADDR:MASTER_PORT`, held by rank 0
    or by torchrun) from a daemon thread. After a collective fails, the ranks whose counter stands
    still are the lost ones: a dead process, or a hung one (a stopped process's threads stop too,
    while a healthy rank blocked in the same collective keeps beating). Works for gloo and NCCL
    alike, and costs one small store write per rank every few seconds.

    A store that stalls or drops the connection never silences a live rank: the beat retries (a
    fresh connection, waiting longer after each failure) for as long as the process lives, and the
    neighbour watch times a neighbour only while this rank itself reads the store on schedule.

    One store client of its own serves the beat, the watch and `lost` alike, one connection more
    than the process group's (measured under torchrun: a rank holds 1 connection to the store for
    its process group, 2 with the heartbeat; a client per thread made 4, so 12,288 more on the
    store's host at 4,096 ranks). torch's TCPStore client sends one request at a time under a lock
    of its own and releases the GIL while it waits, so the threads share it as it is. The process
    group's own store (`_get_default_store()`, a PrefixStore over the client the process group
    opened) would cost no connection, but that connection cannot be replaced when it breaks (the
    process group holds it): the beat would fall silent for good while training went on, and the
    neighbours would end a healthy job."""

    # Bounds connecting and waiting for a key; a request to a store whose process is stopped waits
    # until it answers again (torch 2.13), so the watch also treats a late read as no read.
    STORE_TIMEOUT = datetime.timedelta(seconds=10)
    MIN_INTERVAL = 2.0  # seconds between beats; longer beyond 400 ranks (~200 writes a second)
    MAX_BACKOFF = 4  # after failed writes the beat waits up to this many intervals before the next

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.interval = max(self.MIN_INTERVAL, world / 200)  # at most ~200 writes a second at any size
        self.host, self.port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.address = f"{self.host}:{self.port}"
        self.me = f"{socket.gethostname()} pid {os.getpid()}"
        self._store = self._connect()  # replaced by the beating thread alone, when it breaks
        self._store.set(self._key(rank), f"0 {self.me}")
        self._watch_stopped = threading.Event()
        threading.Thread(target=self._beat, name="swbert-heartbeat", daemon=True).start()

    @staticmethod
    def _key(rank: int) -> str:
        return f"swbert/heartbeat/{rank}"

    def _connect(self) -> torch.distributed.TCPStore:
        return torch.distributed.TCPStore(self.host, self.port, timeout=self.STORE_TIMEOUT)

    def _pause(self, failures: int) -> float:
        """Seconds before the next beat: an interval, or after failed writes twice as long each time
        up to MAX_BACKOFF intervals, jittered so that thousands of ranks do not reconnect at once."""
        if not failures:
            return self.interval
        return min(2 ** (failures - 1), self.MAX_BACKOFF) * self.interval * random.uniform(0.5, 1.0)

    def _beat(self) -> None:
        count, failures = 0, 0
        while True:  # for as long as the process lives: a rank's silence is the one sign of its loss
            time.sleep(self._pause(failures))
            count += 1
            try:
                if failures:  # a write waits for no answer, so it fails only when its connection broke
                    self._store = self._connect()
                self._store.set(self._key(self.rank), f"{count} {self.me}")
            except Exception as err:
                failures += 1
                if failures == 1:
                    log.warning(
                        "rank %d's heartbeat could not write to the store at %s (%s); retrying",
                        self.rank,
                        self.address,
                        _first_line(err),
                    )
                continue
            if failures:
                log.warning(
                    "rank %d's heartbeat reaches the store at %s again, after %d failed tries",
                    self.rank,
                    self.address,
                    failures,
                )
            failures = 0

    def _read(self, ranks: Iterable[int]) -> dict[int, str | None]:
        """Each rank's last beat ("COUNT HOST pid PID"), or None for a rank that never reported."""
        store, ranks = self._store, sorted(ranks)
        keys = [self._key(r) for r in ranks]
        if store.check(keys):  # every one has reported (the usual case): one read for them all
            return {r: value.decode() for r, value in zip(ranks, store.multi_get(keys))}
        return {r: store.get(k).decode() if store.check([k]) else None for r, k in zip(ranks, keys)}

    def lost(self) -> str | None:
        """Who is lost, in words: the ranks whose heartbeat stood still for a few intervals, or the
        store itself; None when every other rank is alive."""
        window = 2.5 * self.interval
        others = set(range(self.world)) - {self.rank}
        try:
            first = self._read(others)
            deadline = time.monotonic() + window
            still = set(others)
            while still and time.monotonic() < deadline:
                time.sleep(0.5)
                now = self._read(still)
                still = {r for r in still if now[r] is None or now[r] == first[r]}
        except Exception as err:
            holder = "torchrun on the first node" if os.environ.get("TORCHELASTIC_RUN_ID") else "rank 0"
            return (
                f"the rendezvous store at {self.address}, held by {holder}, no longer answers "
                f"({type(err).__name__}): {holder} is lost (its process died, its node went down, or it hangs)"
            )
        if not still:
            return None
        named = ", ".join(
            f"rank {r} (on {first[r].split(' ', 1)[1]})" if first[r] else f"rank {r} (never reported)"
            for r in sorted(still)
        )
        return (
            f"lost {named}: its heartbeat stood still for {window:.0f} s (the process died, its node "
            "went down, or it hangs)"
        )

    def watch(self, after_s: float) -> None:
        """End this process (exit status 3) once a neighbour's heartbeat (ranks r - 1 and r + 1, so
        every rank is watched twice and the store reads stay constant per rank at any size) stood
        still for `after_s` seconds, naming it: under NCCL a collective with a dead peer waits for the
        whole collective timeout and is then aborted by NCCL's watchdog without a word, and the
        main thread, blocked in it, cannot act. Only silence this rank saw counts: a read that fails
        or comes late (a stalled or overloaded store) restarts every neighbour's clock."""
        neighbours = sorted({(self.rank - 1) % self.world, (self.rank + 1) % self.world} - {self.rank})
        threading.Thread(
            target=self._watch, args=(neighbours, after_s), name="swbert-lost-rank-watch", daemon=True
        ).start()

    def _watch(self, neighbours: list[int], after_s: float) -> None:
        seen: dict[int, tuple[str, float]] = {}  # rank -> (its value, since when it has stood there)
        last_read = -math.inf  # when the last read that went well ended
        while not self._watch_stopped.wait(self.interval):
            try:
                values = self._read(neighbours)
            except Exception:  # a store that does not answer tells nothing about the neighbours
                last_read = -math.inf
                continue
            now = time.monotonic()
            if now - last_read > 2 * self.interval:
                # this rank could not read the store for a while (it stalled, it was overloaded, or
                # the connection broke and the beat is replacing it): what a neighbour did meanwhile
                # is unknown, and a live neighbour's beat waited too (behind its own watch's read on
                # their shared client), so its counter may stand where it stood before; every clock
                # starts again now, and a neighbour is named only after a whole window seen silent
                seen.clear()
            last_read, stale = now, []
            for r, value in values.items():
                if value is None:  # never reported (no heartbeat of its own): not silence
                    seen.pop(r, None)
                elif seen.get(r, ("",))[0] != value:
                    seen[r] = (value, now)
                elif now - seen[r][1] >= after_s:
                    stale.append(f"rank {r} (on {value.split(' ', 1)[1]})")
            if stale and not self._watch_stopped.is_set():
                message = (
                    f"error: lost {', '.join(stale)}: its heartbeat stood still for {after_s:.0f} s (the "
                    f"process died, its node went down, or it hangs). Rank {self.rank} stops the job "
                    f"({LOST_RANK_VAR}={after_s / 60:g}) instead of waiting in a collective "
                    "for SWBERT_DIST_TIMEOUT_MIN. Restart the job with --resume auto to continue from "
                    "the newest complete checkpoint\n"
                )
                os.write(2, message.encode())
                os._exit(3)

    def stop_watch(self) -> None:
        """End the watch (the beat goes on while the process lives, so a rank that dies after this,
        e.g. during the final export, is still named by `lost`)."""
        self._watch_stopped.set()


def _first_line(err: BaseException) -> str:
    """An exception in one line: torch's store errors carry the C++ stack after the message."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


LOST_RANK_VAR = "SWBERT_LOST_RANK_MIN"
DEFAULT_LOST_RANK_MIN = 5.0
_heartbeat: Heartbeat | None = None


def watch_for_lost_ranks() -> None:
    """Pretraining's ranks stop the job when a neighbour's heartbeat stands still for
    SWBERT_LOST_RANK_MIN minutes (default 5; 0: never; ours), on any backend; `stop_watching` ends
    it once the loop is over, before ranks leave at their own pace."""
    raw = os.environ.get(LOST_RANK_VAR, "")
    try:
        minutes = float(raw) if raw else DEFAULT_LOST_RANK_MIN
    except ValueError:
        minutes = -1.0
    if not minutes >= 0:
        raise ValueError(f"{LOST_RANK_VAR}={raw!r} is not a number of minutes >= 0 (e.g. 5; 0: never)")
    if _heartbeat is not None and minutes > 0:
        _heartbeat.watch(minutes * 60)


def stop_watching() -> None:
    """End the watch once the training loop is over: from there on ranks may part at their own
    pace (rank 0 exports while the others wait), and none is taken for lost."""
    if _heartbeat is not None:
        _heartbeat.stop_watch()


def is_collective_failure(err: BaseException) -> bool:
    """Whether `err` is a failed collective (a peer gone, a timeout) rather than a bug or bad input."""
    if isinstance(err, torch.distributed.DistError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        mark in text
        for mark in ("gloo/transport", "NCCL", "Connection reset", "Connection closed", "Timed out")
    )


@contextmanager
def lost_ranks_named() -> Iterator[None]:
    """Turn a collective that failed because a rank died or hangs into LostRanks, naming that rank,
    on every surviving rank (the backend's own message names an address at best)."""
    try:
        yield
    except Exception as err:
        if _heartbeat is None or not is_collective_failure(err):
            raise
        lost = _heartbeat.lost()
        if lost is None:  # everyone is alive: not a lost rank, the backend's error stands
            raise
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        timeout = os.environ.get("SWBERT_DIST_TIMEOUT_MIN", "30")
        raise LostRanks(
            f"{lost}. Rank {_heartbeat.rank} stops: its collective failed with: {first_line}. Restart "
            "the job with --resume auto to continue from the newest complete checkpoint (a hung rank is "
            f"waited for SWBERT_DIST_TIMEOUT_MIN={timeout} minutes before it counts as lost)"
        ) from err
