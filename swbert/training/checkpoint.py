"""Checkpoints through the DeepSpeed engine, made crash-safe.

Layout under `<output_dir>/checkpoints/`:

    step_00000500/            DeepSpeed's per-rank model/optimizer shards (any ZeRO stage)
        rng_rank00000.pt      every rank's RNG states
        swbert_meta.json      model config, parallel layout, step (checked before loading)
    latest                    the newest complete tag, written last and atomically

A checkpoint counts only once every rank has finished writing it: DeepSpeed's save ends with a
barrier, after which rank 0 moves `latest` by writing a temporary file and renaming it. A crash
at any earlier point leaves `latest` on the previous checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"  # written by `python -m swbert.parallel.convert universal`
TAG_RE = re.compile(r"^step_(\d{8})$")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def fault_kill(variable: str, step: int) -> None:
    """Fault injection for tests and drills: rank 0 kills itself (-9) at `step` when `variable` names it."""
    if dist.get_rank() == 0 and os.environ.get(variable) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    tracker = _tp_rng_tracker()
    if tracker is not None:
        state["tensor_parallel"] = tracker.rng_tracker_states()
    return state


def _tp_rng_tracker():
    """swbert.parallel when tensor parallelism is active (megatron's per-rank RNG streams), else None."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    from swbert import parallel

    return parallel


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = _tp_rng_tracker()
    if "tensor_parallel" in state and tracker is not None:
        tracker.set_rng_tracker_states(state["tensor_parallel"])


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_latest(ckpt_root: Path, name: str = LATEST) -> str | None:
    """The tag a pointer file names, if that checkpoint folder exists."""
    pointer = ckpt_root / name
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    return tag if (ckpt_root / tag).is_dir() else None


def save(
    engine, ckpt_root: Path, step: int, client_state: dict[str, Any], meta: dict[str, Any], keep: int
) -> Path:
    """Save on every rank; returns the tag folder. Collective: all ranks must call it."""
    rank = dist.get_rank()
    tag = tag_for(step)
    tag_dir = ckpt_root / tag
    tag_dir.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), tag_dir / f"rng_rank{rank:05d}.pt")
    engine.save_checkpoint(str(ckpt_root), tag=tag, client_state=client_state, save_latest=False)
    # save_checkpoint returns after a barrier: every rank's shards are on disk now
    fault_kill("SWBERT_FAULT_KILL_IN_SAVE", step)  # die with the shards written, the pointer not moved
    if rank == 0:
        _atomic_write(tag_dir / "swbert_meta.json", json.dumps(meta, indent=1))
        _atomic_write(ckpt_root / LATEST, tag)
        prune(ckpt_root, keep)
    dist.barrier()
    return tag_dir


def prune(ckpt_root: Path, keep: int) -> None:
    """Delete complete checkpoints older than the newest `keep` (never the one `latest` names)."""
    latest = read_latest(ckpt_root)
    tags = sorted(p.name for p in ckpt_root.iterdir() if p.is_dir() and TAG_RE.match(p.name))
    complete = [t for t in tags if latest is not None and t <= latest]
    for old in complete[:-keep] if keep > 0 else []:
        if old != latest:
            shutil.rmtree(ckpt_root / old, ignore_errors=True)


def discard_incomplete(ckpt_root: Path) -> None:
    """Remove tag folders newer than `latest`: saves that a crash cut off (rank 0 only)."""
    latest = read_latest(ckpt_root) or ""
    for p in ckpt_root.iterdir() if ckpt_root.is_dir() else []:
        if p.is_dir() and TAG_RE.match(p.name) and p.name > latest:
            log.warning("removing incomplete checkpoint %s (the save did not finish)", p)
            shutil.rmtree(p, ignore_errors=True)


def resolve_resume(resume: str, ckpt_root: Path) -> tuple[Path, str] | None:
    """(load_dir, tag) for --resume none|auto|PATH; None when starting fresh."""
    if resume == "none":
        return None
    if resume == "auto":
        tag = read_latest(ckpt_root)
        return (ckpt_root, tag) if tag else None
    path = Path(resume)
    for pointer in (LATEST, LATEST_UNIVERSAL):  # a checkpoints/ folder, or a converted (universal) one
        if path.is_dir() and (path / pointer).is_file():
            tag = read_latest(path, pointer)
            if tag is None:
                raise FileNotFoundError(f"--resume {resume}: its '{pointer}' names a missing checkpoint")
            return path, tag
    if path.is_dir() and TAG_RE.match(path.name):
        return path.parent, path.name
    raise FileNotFoundError(
        f"--resume {resume}: not a checkpoint (expected a checkpoints/ folder with 'latest' or a step_* folder)"
    )


def check_compatible(tag_dir: Path, meta: dict[str, Any]) -> None:
    """Refuse a checkpoint of another model shape or parallel layout, naming what differs."""
    saved_path = tag_dir / "swbert_meta.json"
    if not saved_path.is_file():
        raise FileNotFoundError(f"{tag_dir} has no swbert_meta.json: not a complete swbert checkpoint")
    saved = json.loads(saved_path.read_text())
    diffs = [
        f"{key}: checkpoint {saved['model'].get(key)!r} vs this run {value!r}"
        for key, value in meta["model"].items()
        if saved["model"].get(key) != value
    ]
    if diffs:
        raise ValueError(
            f"checkpoint {tag_dir} is of a different model ({'; '.join(diffs)}); resume with the same "
            "--size/--attention-type/data, or start a new --output-dir"
        )
    if saved.get("tensor_parallel", 1) != meta.get("tensor_parallel", 1) and not is_universal(tag_dir):
        raise ValueError(
            f"checkpoint {tag_dir} was saved with --tensor-parallel {saved.get('tensor_parallel', 1)} but this run "
            f"uses {meta.get('tensor_parallel', 1)}; convert it first: python -m swbert.parallel.convert universal "
            f"{tag_dir.parent} NEW_DIR --tag {tag_dir.name}, then pass --resume NEW_DIR"
        )


def is_universal(tag_dir: Path) -> bool:
    """Whether `tag_dir` is a universal checkpoint (one folder per parameter): it loads at any
    tensor- and data-parallel size, with DeepSpeed's `checkpoint.load_universal`."""
    return (tag_dir / "zero").is_dir()


def load(engine, load_dir: Path, tag: str) -> dict[str, Any]:
    """Load model, optimizer and scheduler; restore this rank's RNG. Returns the client state."""
    _, client_state = engine.load_checkpoint(
        str(load_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if client_state is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {load_dir / tag}")
    rng_file = load_dir / tag / f"rng_rank{dist.get_rank():05d}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        log.warning("%s missing (world size changed?): RNG streams restart from the seed", rng_file.name)
    return client_state
