"""A rank's masked micro-batches, built in DataLoader worker processes.

Any micro-batch is a function of its stream position (`swbert.data.stream.MaskedStream`), so
`batch_loader` runs `torch.utils.data.DataLoader` workers in which worker `w` of `W` builds
micro-batches `w, w + W, w + 2W, ...`; the DataLoader hands them out round-robin, which is
their order, so the stream is the same for any number of workers (0: on the calling thread).

A worker that builds nothing for `SWBERT_LOADER_TIMEOUT_S` seconds (stopped, stuck on a file system,
hung) is named, with its pid and state, by the rank that waits for it (`LoaderStalled`), instead of
the rank waiting silently while its peers sit in a collective until its timeout (30 minutes).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from swbert.data.stream import MaskedStream, MixedStream, check_layout

log = logging.getLogger(__name__)


class MicroBatches(torch.utils.data.IterableDataset):
    """One rank's micro-batches from global stream position `start_sample` on, without end.

    Micro-batch `j` is this rank's slice of the global micro-batch that starts at
    `start_sample + j * micro_bs * dp_size`. In a DataLoader worker `w` of `W`, it yields
    `j = w, w + W, ...` only; the DataLoader's round-robin over workers restores the order.
    """

    def __init__(
        self, stream: MaskedStream | MixedStream, start_sample: int, micro_bs: int, dp_rank: int, dp_size: int
    ) -> None:
        check_layout(start_sample, micro_bs, dp_rank, dp_size)
        self.stream = stream
        self.start_sample = start_sample
        self.micro_bs = micro_bs
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def position(self, j: int) -> int:
        """Stream position of this rank's first sample in micro-batch `j`."""
        return self.start_sample + j * self.micro_bs * self.dp_size + self.dp_rank * self.micro_bs

    def __iter__(self) -> Iterator[dict[str, torch.Tensor] | PackedBatch]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        j = worker
        while True:
            batch = self.stream.batch(self.position(j), self.micro_bs)
            yield batch if info is None else PackedBatch.pack(batch)
            j += workers


class PackedBatch:
    """A batch as one flat int32 array and its layout, for the trip from a worker to the main process.

    A torch tensor leaves a worker through its own shared-memory segment, and the main process
    connects to the worker's socket to fetch each descriptor: for four small tensors that costs
    more than building the batch. A numpy array is pickled through the worker's pipe instead, in
    int32 (every value is a token id, a position or -100), half the bytes to copy. The
    DataLoader's pin-memory thread calls `pin_memory()`, so the widening to int64 and the pinning
    happen off the training thread; `unpack()` gives int64 views of one tensor.
    """

    def __init__(
        self, flat: np.ndarray | torch.Tensor, layout: tuple[tuple[str, tuple[int, ...]], ...]
    ) -> None:
        self.flat = flat  # (N,)
        self.layout = layout

    @classmethod
    def pack(cls, batch: dict[str, torch.Tensor]) -> PackedBatch:
        layout = tuple((key, tuple(value.shape)) for key, value in batch.items())
        flat = np.concatenate([value.numpy().reshape(-1) for value in batch.values()])
        if len(flat) and (flat.max() > np.iinfo(np.int32).max or flat.min() < np.iinfo(np.int32).min):
            raise ValueError("a batch value does not fit in int32")  # a vocabulary of 2**31 ids: never
        return cls(flat.astype(np.int32), layout)

    def pin_memory(self) -> PackedBatch:
        """Called by the DataLoader's pin-memory thread (`pin_memory=True`): int64, in page-locked memory."""
        return PackedBatch(torch.from_numpy(self._int64()).pin_memory(), self.layout)

    def unpack(self) -> dict[str, torch.Tensor]:
        # numpy slicing and from_numpy: a few microseconds where torch's split and views cost 20.
        flat = self._int64() if isinstance(self.flat, np.ndarray) else self.flat  # pinned: already int64
        out, begin = {}, 0
        for key, shape in self.layout:
            end = begin + math.prod(shape)
            part = flat[begin:end].reshape(shape)
            out[key] = torch.from_numpy(part) if isinstance(part, np.ndarray) else part
            begin = end
        return out

    def _int64(self) -> np.ndarray:
        return np.asarray(self.flat).astype(np.int64)  # (N,), a copy


def _as_is(batch: PackedBatch | dict[str, torch.Tensor]) -> PackedBatch | dict[str, torch.Tensor]:
    """The DataLoader's collate step: the dataset yields finished batches."""
    return batch


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _positive_env(*names: str) -> int | None:
    """The first of the environment variables `names` that holds a positive integer."""
    for name in names:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def rank_cpus() -> int:
    """CPUs one rank may keep busy with its threads and its loader workers.

    They are the CPUs the process may run on (its affinity mask: under a SLURM step that binds
    tasks, what the step gave this task), at most SLURM_CPUS_PER_TASK (what the step asked for,
    which also holds where tasks are not bound), shared by the ranks that one launcher started on
    them: LOCAL_WORLD_SIZE under torchrun, LOCAL_SIZE under the deepspeed launcher; a rank that is
    its own SLURM task (`SWBERT_LAUNCHER=srun`) has them to itself.
    """
    cpus = usable_cpus()
    step = _positive_env("SLURM_CPUS_PER_TASK")
    if step is not None:
        cpus = min(cpus, step)
    sharing = _positive_env("LOCAL_WORLD_SIZE", "LOCAL_SIZE") or 1
    return max(1, cpus // sharing)


def resolve_num_workers(num_workers: int, cpus: int | None = None) -> int:
    """Loader workers to start: `num_workers`, or the CPU count (`cpus`, default this rank's share,
    `rank_cpus`) with a warning when it asks for more, since workers beyond the cores only take
    turns with each other."""
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers} must be 0 (batches on the training thread) or more")
    cpus = rank_cpus() if cpus is None else cpus
    if num_workers > cpus:
        log.warning("num_workers=%d is more than the %d CPUs available: using %d", num_workers, cpus, cpus)
        return cpus
    return num_workers


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_PR_SET_PDEATHSIG = 1  # prctl option: the signal this process gets when its parent dies


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills this worker (SIGKILL: it ignores the stop signals) the moment its
    rank dies, however it dies. DataLoader's own parent watchdog is not enough: after a kill -9 of
    the rank, a worker noticed it only between batches and then hung at exit, joining the feeder
    thread of a queue nobody reads, for good (it held the run's files and memory). A rank that died
    before the request was made is caught by the parent-pid check. (The kernel watches the thread
    that forked the worker: start the iterator on a thread that outlives the loader, as the
    trainer's main thread does.)"""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the DataLoader's watchdog remains
        pass
    if os.getppid() != parent_pid:
        os._exit(0)


def _leave_stop_signals_to_the_trainer(parent_pid: int | None, _worker_id: int) -> None:
    """A worker ignores SIGTERM, SIGINT and SIGUSR1: launchers (torchrun, SLURM) signal a rank's
    whole process group, and a worker that died of it would fail the rank while the trainer saves
    its pre-emption checkpoint. The trainer stops its workers when it is done; a worker whose
    trainer is gone dies with it (`_die_with_parent`).

    The worker starts with these signals blocked (`_start_shielded`): one that arrived between the
    fork and here is pending, and ignoring it discards it, before the signals are unblocked."""
    if parent_pid is not None and sys.platform.startswith("linux"):
        _die_with_parent(parent_pid)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _start_shielded(loader: torch.utils.data.DataLoader) -> Iterator:
    """`iter(loader)`, with the stop signals blocked while it forks the workers.

    A new worker first installs torch's own SIGTERM handler (which dies of a SIGTERM not sent by
    its parent) and only later runs `worker_init_fn`; a launcher's SIGTERM to the process group
    in that window killed the worker and with it the rank. The blocked mask is inherited by the
    workers (and the pin-memory thread); the trainer's mask is restored at once, so a signal that
    came meanwhile reaches the trainer's handler as soon as this returns."""
    if loader.num_workers == 0:
        return iter(loader)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        return iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


TIMEOUT_VAR = "SWBERT_LOADER_TIMEOUT_S"
# A micro-batch takes milliseconds to build (a gather from memory-mapped shards and a few numpy
# operations; a worker's first one also draws the epoch's permutation, seconds at most), so 2 minutes
# is generous, yet well inside the heartbeat's lost-rank window (SWBERT_LOST_RANK_MIN, 5 minutes):
# the rank stops and its peers name it long before the 30-minute collective timeout. Ours.
DEFAULT_TIMEOUT_S = 120.0
# The wait is counted in slices of at most this many seconds, and a slice that ran much longer than
# asked means this process itself was stopped (a whole job suspended, `scontrol suspend`): the count
# starts again, so a resumed job is not taken for a stalled worker.
WAIT_SLICE_S = 5.0
_STATES = {  # /proc/PID/stat's state letter, in words
    "T": "stopped (SIGSTOP, or a job-control stop)",
    "t": "stopped by a debugger (tracing stop)",
    "D": "waiting on I/O (a hung file system or disk?)",
    "R": "running, but built no batch (busy, or starved of CPU)",
    "S": "sleeping, but built no batch (blocked in a call)",
    "Z": "dead",
}


class LoaderStalled(RuntimeError):
    """A DataLoader worker built no batch within the loader timeout; the message names it."""


def loader_timeout() -> float:
    """Seconds a rank waits for its next micro-batch before `LoaderStalled` (`SWBERT_LOADER_TIMEOUT_S`,
    default 120; 0: for ever)."""
    raw = os.environ.get(TIMEOUT_VAR, "")
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(
            f"{TIMEOUT_VAR}={raw!r} is not a number of seconds >= 0 (the longest wait for a micro-batch "
            f"before the loader worker is named; default {DEFAULT_TIMEOUT_S:g}; 0: wait for ever)"
        )
    return 0.0 if math.isinf(seconds) else seconds


def _process_state(pid: int) -> str:
    """What a process is doing, in words, from /proc (Linux); "in an unknown state" elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone" if sys.platform.startswith("linux") else "in an unknown state"
    state = stat.rsplit(")", 1)[-1].split()[0]  # the name in parentheses may hold spaces
    return _STATES.get(state, f"in state {state!r}")


class BatchLoader:
    """Iterator over a rank's micro-batches; `next_sample` is the stream position of the global
    micro-batch the next one belongs to (what a checkpoint taken now would resume from)."""

    def __init__(
        self,
        loader: torch.utils.data.DataLoader,
        start_sample: int,
        samples_per_micro_step: int,
        timeout: float = 0.0,
    ) -> None:
        self.loader = loader
        self.timeout = timeout  # seconds without a batch before LoaderStalled (0: for ever)
        self.next_sample = start_sample
        self._step = samples_per_micro_step
        self._iterator: Iterator[dict[str, torch.Tensor] | PackedBatch] | None = _start_shielded(loader)

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._iterator is None:
            raise StopIteration
        waited = 0.0
        while True:
            asked, started = self.loader.timeout, time.monotonic()
            try:
                batch = next(self._iterator)
                break
            except RuntimeError as err:  # torch's iterator is unchanged by a timeout: ask again
                if not (asked > 0 and str(err).startswith("DataLoader timed out")):
                    raise
            took = time.monotonic() - started
            waited = 0.0 if took > 2 * asked else waited + took  # a long slice: this process was stopped
            if waited >= self.timeout:
                raise LoaderStalled(self._stalled()) from None
        self.next_sample += self._step
        return batch if isinstance(batch, dict) else batch.unpack()

    def _stalled(self) -> str:
        """The worker the rank waits for (the DataLoader takes them round-robin), and what it does."""
        iterator: Any = self._iterator
        workers = getattr(iterator, "_workers", [])
        try:  # torch's own bookkeeping (private): the worker that owes the next batch
            waiting = [iterator._task_info[iterator._rcvd_idx][0]]
        except (AttributeError, KeyError, IndexError, TypeError):
            waiting = list(range(len(workers)))
        named = "; ".join(
            f"worker {w} (pid {workers[w].pid} on {socket.gethostname()}) is {_process_state(workers[w].pid)}"
            for w in waiting
            if w < len(workers)
        )
        timeout = self.timeout
        return (
            f"no micro-batch came from the DataLoader for {timeout:g} s ({TIMEOUT_VAR}={timeout:g}): "
            f"{named or 'no worker is running'}. This rank stops rather than hold the job in a "
            "collective until its timeout: find what stopped or holds that process (kill -STOP, a "
            "debugger, a hung file system under the data folder), then restart the job with --resume "
            f"auto; if a micro-batch really takes longer here, raise {TIMEOUT_VAR} (0: wait for ever)"
        )

    def close(self) -> None:
        """Stop the workers now (they also stop when this object is garbage collected)."""
        shutdown = getattr(self._iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._iterator = None


def batch_loader(
    stream: MaskedStream | MixedStream,
    start_sample: int,
    micro_bs: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int,
    *,
    pin_memory: bool = False,
    prefetch_factor: int = 4,
    multiprocessing_context: str | None = None,
    timeout: float | None = None,
) -> BatchLoader:
    """A rank's micro-batches from `start_sample` on, built by `num_workers` DataLoader processes.

    `num_workers` as given (the caller's `resolve_num_workers` fits it to the CPUs it may use);
    0 builds them on the calling thread. Each worker keeps `prefetch_factor` micro-batches ready. Workers touch no
    CUDA (batches are CPU tensors; `pin_memory` pins them in the main process), so they may be
    forked from a process that uses a GPU; `multiprocessing_context` ("fork", "spawn",
    "forkserver"; None: torch's default) picks how they start. A worker that builds no batch for
    `timeout` seconds (None: `SWBERT_LOADER_TIMEOUT_S`, default 120; 0: wait for ever) makes the next
    batch raise `LoaderStalled`, naming it.
    """
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers} must be 0 (batches on the training thread) or more")
    timeout = loader_timeout() if timeout is None else timeout
    workers = num_workers
    # a forkserver's workers are its children, not this process's: they keep DataLoader's watchdog
    # (forkserver is also the default start method from Python 3.14 on, and in a forkserver's child)
    method = multiprocessing_context or multiprocessing.get_start_method()
    parent = None if method == "forkserver" else os.getpid()
    dataset = MicroBatches(stream, start_sample, micro_bs, dp_rank, dp_size)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=None,  # the dataset yields whole micro-batches
        collate_fn=_as_is,  # (the default would turn a PackedBatch's array into a tensor in the worker)
        num_workers=workers,
        pin_memory=pin_memory,
        # The stream has no end, so the DataLoader is iterated once; persistent workers also keep
        # a second `iter()` from starting new processes.
        persistent_workers=workers > 0,
        prefetch_factor=prefetch_factor if workers > 0 else None,
        multiprocessing_context=multiprocessing_context if workers > 0 else None,
        # its own generator: starting the iterator draws the workers' base seed, and drawing it from
        # the global RNG would shift the dropout masks of every later step (a resumed run starts its
        # loader at another step than the uninterrupted one). Masks do not use it: they are hashed.
        generator=torch.Generator().manual_seed(0),
        worker_init_fn=partial(_leave_stop_signals_to_the_trainer, parent) if workers > 0 else None,
        # a stopped or stuck worker is named (`BatchLoader`) instead of hanging the job in silence
        timeout=min(timeout, WAIT_SLICE_S) if workers > 0 else 0,
    )
    return BatchLoader(loader, start_sample, micro_bs * dp_size, timeout if workers > 0 else 0.0)
