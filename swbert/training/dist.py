"""Process-group start-up shared by torchrun, the deepspeed launcher, srun and plain python."""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import socket
import sys

import torch


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
    """Linux: a worker whose launcher (torchrun, deepspeed) is killed dies too, instead of training on
    as an orphan that holds GPUs and writes into the run folder."""
    if not sys.platform.startswith("linux"):
        return
    try:
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def init_distributed(timeout_minutes: float | None = None) -> tuple[int, int, int]:
    """Start DeepSpeed's process group (NCCL on GPU, gloo on CPU). Returns (rank, local_rank, world).

    The collective timeout (default 30 min) can be set per job with SWBERT_DIST_TIMEOUT_MIN: a rank
    that dies then fails the others after that long instead of the backend's default.
    """
    import deepspeed

    if timeout_minutes is None:
        timeout_minutes = float(os.environ.get("SWBERT_DIST_TIMEOUT_MIN", "30"))
    launched = "RANK" in os.environ
    map_launcher_env()
    if launched:
        die_with_launcher()
    on_gpu = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if on_gpu:
        torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(
        dist_backend="nccl" if on_gpu else "gloo",
        timeout=datetime.timedelta(minutes=timeout_minutes),
        auto_mpi_discovery=False,
    )
    return torch.distributed.get_rank(), local_rank, torch.distributed.get_world_size()
