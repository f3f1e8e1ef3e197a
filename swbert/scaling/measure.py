"""Measured short runs of grid points on this machine: the pretraining launcher as a study's job
(`swbert.studies.jobs`), the memory of all its processes sampled; its metrics.jsonl gives loss and
throughput. A point that fails (out of memory, a bad layout) is recorded with the reason."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from swbert.scaling.grid import GridPoint
from swbert.scaling.memory import GIB
from swbert.studies import jobs
from swbert.studies.outputs import read_metrics
from swbert.studies.runner import absolute, absolute_plugins

RUNTIME_GIB_PER_RANK = 0.8  # resident memory of a rank before the model: torch, DeepSpeed, data
# Peaks of measured CPU runs over their whole life (start-up, optimizer swaps, the final checkpoint)
# were 1.5-1.75x the steady-state estimate of the model states and activations (docs/scaling.md):
# plan for 1.5x, and the memory watchdog stops a run that goes beyond the plan anyway.
PLANNING_FACTOR = 1.5


@dataclass
class Hardware:
    """What this machine offers to measured runs."""

    accelerator: str  # "cuda" or "cpu"
    ranks: int  # processes a measured run starts
    device_bytes: float  # per rank on GPU; on CPU the host memory the ranks share
    host_bytes: float  # available host memory
    disk_bytes: float = float("inf")  # free disk where NVMe offload swaps
    headroom: float = 0.9  # the share of host memory (and GPU memory) a run may plan to use

    @classmethod
    def detect(
        cls, ranks: int, memory_limit_gib: float | None = None, swap_dir: Path | None = None
    ) -> Hardware:
        """This machine; `memory_limit_gib` caps the host memory measured runs may plan to use."""
        host = float(psutil.virtual_memory().available)
        if memory_limit_gib is not None:
            host = min(host, memory_limit_gib * GIB)
        disk = float("inf")
        if swap_dir is not None:  # free space of its nearest existing folder
            probe = next(p for p in [swap_dir, *swap_dir.parents] if p.exists())
            disk = float(shutil.disk_usage(probe).free)
        import torch

        if torch.cuda.is_available():
            if torch.cuda.device_count() < ranks:
                raise ValueError(f"--nproc {ranks} but this machine has {torch.cuda.device_count()} GPU(s)")
            return cls("cuda", ranks, float(torch.cuda.mem_get_info()[1]), host, disk)
        return cls("cpu", ranks, host, host, disk)

    def fits(self, row: dict[str, Any]) -> str | None:
        """None when the estimate fits, else the reason (with the numbers) it does not."""
        headroom, cpu = self.headroom, self.accelerator == "cpu"
        device = row["mem_device_gib"] * GIB * (PLANNING_FACTOR if cpu else 1.0)
        host = row["mem_host_gib"] * GIB * PLANNING_FACTOR + (device if cpu else 0.0)  # a CPU's device: host
        init = row.get("mem_init_gib", 0.0) * GIB  # the whole fp32 model, built in host memory first
        if not cpu and device > headroom * self.device_bytes:
            gpu = self.device_bytes / GIB
            return f"estimated {device / GIB:.1f} GiB per GPU > {headroom:.0%} of {gpu:.1f} GiB"
        need_host = self.ranks * (max(host, init) + RUNTIME_GIB_PER_RANK * GIB)
        need_disk = self.ranks * row.get("disk_gib", 0.0) * GIB
        if need_disk > headroom * self.disk_bytes:
            free = self.disk_bytes / GIB
            return f"estimated {need_disk / GIB:.1f} GiB of NVMe swap > {headroom:.0%} of {free:.1f} GiB free"
        if need_host > headroom * self.host_bytes:
            return (
                f"planned {need_host / GIB:.1f} GiB of host memory for {self.ranks} rank(s) (estimate "
                f"x{PLANNING_FACTOR} for peaks, or the fp32 model at start-up, plus runtime) > "
                f"{headroom:.0%} of {self.host_bytes / GIB:.1f} GiB available"
            )
        return None


@dataclass
class Measurement:
    status: str  # "measured", "failed", or "stopped" (on request, or its folder held: runs again)
    reason: str = ""
    wall_s: float = 0.0
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    loss_first: float | None = None
    loss_last: float | None = None
    peak_rss_gib: float | None = None  # all processes of the run together, start-up to final save
    peak_rank_rss_gib: float | None = None  # the largest single process, start-up to final save
    peak_device_gib: float | None = None  # the trainer's own peak (GPU allocator), when reported
    train_rss_gib: float | None = None  # rank 0's resident memory at the logged steps (CPU runs)
    records: list[dict[str, Any]] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "records"}


class MemorySampler(threading.Thread):
    """Samples the memory of a process tree while the block runs; kills the tree above `limit`
    bytes, before the kernel's out-of-memory killer picks a process, maybe someone else's."""

    def __init__(self, pid: int, limit: float | None = None, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.limit, self.interval = pid, limit, interval
        self.peak_total = self.peak_single = 0
        self.exceeded: int | None = None  # the total that crossed the limit
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                root = psutil.Process(self.pid)
                sizes = []
                for proc in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        try:  # proportional set size (shared pages split between their users)
                            sizes.append(proc.memory_full_info().pss)
                        except (psutil.AccessDenied, AttributeError):  # else resident size
                            sizes.append(proc.memory_info().rss)
                total = sum(sizes)
                self.peak_total = max(self.peak_total, total)
                self.peak_single = max(self.peak_single, max(sizes, default=0))
                if self.limit is not None and total > self.limit and self.exceeded is None:
                    self.exceeded = total
                    os.killpg(self.pid, signal.SIGKILL)
            except (psutil.Error, ProcessLookupError):
                pass
            self._stop_event.wait(self.interval)

    def __enter__(self) -> MemorySampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop_event.set()
        self.join()


def pretrain_args(point: GridPoint, ds_config: Path, output_dir: Path, steps: int, dp: int) -> list[str]:
    """`launchers/pretrain.py`'s arguments for a short run of `point` (here, or an array task)."""
    return [
        "--size", point.size, "--attention-type", point.attention, "--seq-len", str(point.seq_len),
        "--micro-batch-size", str(point.micro_batch), "--global-batch-size", str(point.micro_batch * dp),
        "--precision", point.precision, "--tensor-parallel", str(point.layout.tp),
        "--deepspeed-config", str(ds_config), "--train-steps", str(steps), "--warmup-steps", "1",
        "--log-interval", "1", "--eval-interval", str(steps + 1), "--eval-batches", "1",
        "--save-interval", str(steps + 1), "--export", "false", "--mlflow", "false", "--progress-bar", "false",
        "--output-dir", str(output_dir), "--sequence-parallel", str(point.layout.sequence_parallel).lower(),
        "--activation-checkpointing", point.layout.checkpointing,
    ]  # fmt: skip


def run_point(
    point: GridPoint,
    ds_config: Path,
    output_dir: Path,
    hardware: Hardware,
    steps: int,
    data_dir: str | None = None,
    timeout_s: float = 1800,
    plugins: Sequence[str] = (),
) -> Measurement:
    """Run `steps` optimizer steps of `point` with `hardware.ranks` processes and measure them (its
    paths made absolute: the job starts in the checkout)."""
    output_dir = output_dir.resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    args = pretrain_args(point, absolute(ds_config), output_dir, steps, hardware.ranks // point.layout.tp)
    args += ["--keep-checkpoints", "1", "--resume", "none"]
    args += ["--data-dir", absolute(data_dir)] if data_dir else []
    args += ["--plugins", *absolute_plugins(plugins)] if plugins else []
    cmd = jobs.pretrain_command(hardware.ranks, args)
    cpu = hardware.accelerator == "cpu"
    env = {"DS_ACCELERATOR": "cpu", **jobs.job_env()} if cpu else None  # None: `job_env()`'s
    limit = hardware.headroom * hardware.host_bytes if cpu else None
    samplers: list[MemorySampler] = []

    def watch(pid: int) -> MemorySampler:  # one sampler per attempt: the last is the job's
        samplers.append(MemorySampler(pid, limit))
        return samplers[-1]

    end = jobs.run_job(cmd, output_dir / "run.log", timeout_s, env, watch)
    sampler = samplers[-1]
    m = Measurement("failed", wall_s=end.wall_s, peak_rss_gib=sampler.peak_total / GIB)
    m.peak_rank_rss_gib = sampler.peak_single / GIB
    if sampler.exceeded is not None and limit is not None:
        m.reason = (
            f"stopped at {sampler.exceeded / GIB:.1f} GiB, above the {limit / GIB:.1f} GiB planned for "
            f"measured runs (--memory-limit-gib, free memory); log: {end.log}"
        )
        return m
    failure = end.failure(timeout_s)
    if failure is not None:
        m.status, m.reason = failure
        return m
    return parse_metrics(output_dir, point, m, hardware.ranks // point.layout.tp)


def parse_metrics(output_dir: Path, point: GridPoint, m: Measurement, dp: int) -> Measurement:
    """Fill loss, throughput and the trainer's memory figures from metrics.jsonl."""
    path = output_dir / "metrics.jsonl"
    records = m.records = list(read_metrics(output_dir).values()) if path.is_file() else []
    if not records:
        m.status, m.reason = "failed", f"{path} is empty" if path.is_file() else f"no {path}"
        return m
    m.status = "measured"
    m.loss_first, m.loss_last = records[0]["loss"], records[-1]["loss"]
    # The first step pays for warm-up (allocations, kernel selection): leave it out when possible.
    timed = records[1:] or records
    rates = [r["tokens_per_s"] for r in timed if r.get("tokens_per_s")]
    if rates:
        m.tokens_per_s = sum(rates) / len(rates)
        m.step_time_s = point.micro_batch * dp * point.seq_len / m.tokens_per_s
    device = [r["mem_allocated_gib"] for r in records if r.get("mem_allocated_gib") is not None]
    m.peak_device_gib = max(device) if device else None
    rss = [r["mem_rss_gib"] for r in records if r.get("mem_rss_gib") is not None]
    m.train_rss_gib = max(rss) if rss else None
    return m
