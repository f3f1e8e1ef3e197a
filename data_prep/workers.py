"""Run shard jobs on a pool of worker processes, with a progress bar fed by the workers."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from queue import Empty
from typing import Any

from data_prep.outdir import DiskFull, is_disk_full
from data_prep.shard_writer import ShardJob, write_shard
from data_prep.sources import InputError
from swbert.data._megatron import indexed_dataset

log = logging.getLogger("data_prep.preprocess")
_queue: Any = None
_parent_pid: int | None = None


def _init_worker(queue: Any, parent_pid: int, close_fds: tuple[int, ...]) -> None:
    global _queue, _parent_pid
    _queue, _parent_pid = queue, parent_pid
    for fd in close_fds:  # the output folder's lock: it must die with the main process, not with us
        os.close(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle


def _report(docs: int, tokens: int, progress: int) -> None:
    _queue.put((docs, tokens, progress))


def _run(job: ShardJob) -> dict[str, Any]:
    return write_shard(job, _report, _parent_pid)


def _context() -> multiprocessing.context.BaseContext:
    # fork shares the already-imported tokenizer and megatron modules (seconds per worker under
    # spawn); the workers use neither threads nor torch ops, so forking is safe here.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def run_jobs(
    jobs: list[ShardJob],
    workers: int,
    records: dict[int, dict[str, Any]],
    *,
    progress: bool,
    total: int,
    done: int,
    close_fds: tuple[int, ...] = (),
) -> tuple[int, int, float]:
    """Write every job's shard, adding its record to `records`.

    Returns the documents and tokens written and the seconds spent (module imports excluded).

    `close_fds`: descriptors the forked workers must not keep open (the output folder's lock).
    """
    if not jobs:
        return 0, 0, 0.0
    indexed_dataset()  # import before forking, so the workers share it instead of each importing it
    context = _context()
    progress_ = _Progress(context.Queue(), total, done, progress)
    pool = ProcessPoolExecutor(
        min(workers, len(jobs)),
        mp_context=context,
        initializer=_init_worker,
        initargs=(progress_.queue, os.getpid(), close_fds),
    )
    futures = {pool.submit(_run, job): job for job in jobs}
    remaining = set(futures)
    clean = False
    try:
        while remaining:
            finished, remaining = wait(remaining, timeout=0.2, return_when=FIRST_COMPLETED)
            progress_.drain()
            for future in finished:
                records[futures[future].index] = _result(future, futures[future])
        clean = True
    except KeyboardInterrupt:
        log.warning("interrupted: finished shards are kept; re-run the same command to resume")
        raise
    finally:
        if not clean:  # stop the other workers now rather than after their current shard
            processes = getattr(pool, "_processes", None) or {}  # private, but the only handle
            for process in list(processes.values()):
                process.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        progress_.drain()
        progress_.bar.close()
    return progress_.docs, progress_.tokens, time.perf_counter() - progress_.started


class _Progress:
    """The workers' counts (documents, tokens, input bytes per message on `queue`) summed into a
    bar of the input bytes."""

    def __init__(self, queue: Any, total: int, done: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.queue = queue
        tty = sys.stderr.isatty()
        self.bar = tqdm(
            total=total,
            initial=done,
            unit="B",
            unit_scale=True,
            disable=not enabled,
            mininterval=0.5 if tty else 30.0,
            desc="preprocess",
            file=sys.stderr,
        )
        self.docs = self.tokens = 0
        self.started = time.perf_counter()

    def drain(self) -> None:
        while True:
            try:
                d, t, p = self.queue.get_nowait()
            except Empty:
                break
            self.docs, self.tokens = self.docs + d, self.tokens + t
            self.bar.update(p)
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        rate = f"{self.docs / elapsed:,.0f} docs/s, {self.tokens / elapsed:,.0f} tokens/s"
        self.bar.set_postfix_str(rate, refresh=False)


def _result(future: Any, job: ShardJob) -> dict[str, Any]:
    """The shard record, or an error that names the shard and its input."""
    try:
        return future.result()
    except BrokenProcessPool as err:
        raise RuntimeError(
            f"a worker process died while writing {job.name} (killed, or out of memory?); finished "
            "shards are kept: re-run the same command to resume"
        ) from err
    except InputError as err:
        raise InputError(f"{job.name}: {err}") from err
    except Exception as err:
        if is_disk_full(err):  # one line that says what was kept and how to resume, not a traceback
            raise DiskFull(Path(job.output_dir), job.name, err) from None
        raise RuntimeError(
            f"writing {job.name} (from {job.source.path}, {job.chunk.start} to {job.chunk.end}) failed: "
            f"{type(err).__name__}: {err}"
        ) from err
