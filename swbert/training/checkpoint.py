"""Checkpoints through the DeepSpeed engine, made crash-safe.

Layout under `<output_dir>/checkpoints/`:

    step_00000500/            DeepSpeed's per-rank model/optimizer shards (any ZeRO stage)
        rng_rank00000.pt      every rank's RNG states
        swbert_meta.json      model config, parallel layout, step (checked before loading)
        complete.json         the completeness marker: step and every file with its size and hash
    latest                    the newest complete tag, a convenience for people and tools
    incomplete/               saves a crash cut off, moved aside (never deleted)
    damaged/                  checkpoints whose files no longer match their hashes (never deleted)
    abandoned-<time>/         the newer checkpoints of a line a rewind left (never deleted)

A save writes into `step_N.partial/` and rank 0 renames it to `step_N/` once it is complete, so a
save never writes into an existing step folder (a rewind re-saving a step the abandoned line holds
has moved that line aside first). Every rank hashes (xxh3-128) the files it wrote, in parallel, and
the marker records them; a resume checks them before anything loads (`verify`): a marker without
usable hashes is damage too (`swbert.runtime.checkpoint_format.mismatched`).

A checkpoint counts only once every rank has written and fsynced its files: after DeepSpeed's
save and a barrier, rank 0 writes the meta file and then the marker (atomically, the folder
fsynced), renames the folder into place, and only then moves `latest`. Resume trusts the markers, not `latest`: a missing, empty
or stale pointer resumes from the newest complete checkpoint and says so. Nothing is deleted
except complete checkpoints older than the newest `keep_checkpoints`.

A write that fails (a full disk, a quota, a file size limit) fails the save on every rank at once
with `CheckpointSaveError`, naming the ranks and files: every rank goes through the whole save and
the ranks compare their failures before the barrier, instead of one rank raising while the others
wait in the next collective until its timeout. The partial folder stays for `set_aside_incomplete`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import resource
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from swbert.fsutil import fsync_path
from swbert.runtime.checkpoint_format import (  # noqa: F401 - the format, re-exported for callers
    CHECKPOINT_FORMAT,
    COMPLETE,
    DAMAGED_DIR,
    HASH,
    INCOMPLETE_DIR,
    LATEST,
    LATEST_UNIVERSAL,
    META,
    PARTIAL,
    PARTIAL_RE,
    TAG_RE,
    atomic_write,
    checkpoint_tags,
    damage,
    file_hash,
    is_complete,
    is_universal,
    marker_hashes,
    marker_unreadable,
    mismatched,
    newest_complete,
    read_latest,
    require_current,
    require_current_folder,
    tag_for,
    write_marker,
)
from swbert.safe_load import load as safe_load, weights_only_loads
from swbert.training.faults import kill_point, kill_requested

log = logging.getLogger(__name__)


def rng_state() -> dict[str, Any]:
    """Every RNG stream of this rank, as tensors and plain values (loadable with weights_only=True)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached)
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    tracker = _tp_rng_tracker()
    if tracker is not None:
        state["tensor_parallel"] = tracker.rng_tracker_states()
    return state


def _tp_rng_tracker():
    """swbert.parallel when tensor parallelism is active (megatron's per-rank RNG streams), else None."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")  # never imported: never active
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return None
    from swbert import parallel

    return parallel


def load_rng_state(path: Path) -> dict[str, Any]:
    """An RNG file, read without running pickled code (weights_only=True): tensors and plain values."""
    return safe_load(path)


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = _tp_rng_tracker()
    if "tensor_parallel" in state and tracker is not None:
        tracker.set_rng_tracker_states(state["tensor_parallel"])


_atomic_write = atomic_write


def _fsync_tree(root: Path) -> None:
    """Flush every file under `root` and the folders themselves to stable storage."""
    for path in sorted(root.rglob("*")):
        if path.is_file():
            fsync_path(path)
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        fsync_path(folder)


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; raised on every rank, naming the ranks and what failed."""


def save(
    engine, ckpt_root: Path, step: int, client_state: dict[str, Any], meta: dict[str, Any], keep: int
) -> Path:
    """Save on every rank; returns the tag folder. Collective: all ranks must call it.

    Every rank writes into `step_N.partial/` and hashes the files it wrote; rank 0 writes the marker
    with every hash and renames the folder to `step_N/` (an existing one is moved aside first).
    Raises CheckpointSaveError on every rank when any rank could not write its files; the previous
    checkpoints are untouched then."""
    rank = dist.get_rank()
    tag = tag_for(step)
    partial = ckpt_root / f"{tag}{PARTIAL}"
    failures: list[str] = []
    hashes: dict[str, str] = {}
    with _writes_recorded(engine, failures, step) as recorder:  # every rank runs DeepSpeed's save to its end
        rng_file = partial / f"rng_rank{rank:05d}.pt"
        try:
            partial.mkdir(parents=True, exist_ok=True)
            torch.save(rng_state(), rng_file)
            recorder.track(rng_file)
        except Exception as err:
            failures.append(_failure(rng_file, err))
        engine.save_checkpoint(str(ckpt_root), tag=partial.name, client_state=client_state, save_latest=False)
        if not failures:
            try:  # every rank flushes what its node wrote (on a shared file system too)
                _fsync_tree(partial)
                hashes = recorder.hashes(partial)
            except OSError as err:
                failures.append(_failure(partial, err))
    _fail_together(ckpt_root, tag, failures)  # a barrier: every rank's shards are on stable storage now
    hashes = _gather_hashes(hashes)
    kill_point("in_save", step, rank)  # die with the shards written, no marker
    if rank == 0:
        try:
            mark_complete(partial, step, meta, hashes)
            _into_place(ckpt_root, partial, tag)
            _atomic_write(ckpt_root / LATEST, tag)
            prune(ckpt_root, keep, step)
        except Exception as err:
            failures.append(_failure(partial / COMPLETE, err))
    _fail_together(ckpt_root, tag, failures)
    return ckpt_root / tag


def _gather_hashes(mine: dict[str, str]) -> dict[str, str]:
    """Every rank's file hashes, on rank 0 (collective; empty elsewhere)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered: list[Any] = [None] * world if rank == 0 else None  # type: ignore[assignment]
    dist.gather_object(mine, gathered, dst=0)
    return {k: v for part in gathered or [] for k, v in part.items()} if rank == 0 else {}


def _into_place(ckpt_root: Path, partial: Path, tag: str) -> None:
    """Rename a finished `step_N.partial/` to `step_N/`; a folder already there (left by a line a
    rewind abandoned) is moved aside first, never written into or deleted."""
    target = ckpt_root / tag
    if target.exists():
        moved = move_aside(ckpt_root, tag, f"abandoned-{time.strftime('%Y%m%d-%H%M%S')}")
        log.warning("moved %s to %s before saving that step again (nothing deleted)", target, moved)
    os.replace(partial, target)
    fsync_path(ckpt_root)


def hash_files(tag_dir: Path, paths: list[Path]) -> dict[str, str]:
    """{name relative to `tag_dir`: hash} of the files in `paths` that lie under it."""
    out = {}
    for path in paths:
        path = Path(path)
        if path.is_file() and path.is_relative_to(tag_dir):
            out[str(path.relative_to(tag_dir))] = file_hash(path)
    return out


class _RecordedWrites:
    """DeepSpeed's checkpoint engine, with a failed write recorded instead of raised.

    DeepSpeed runs collectives between the files it writes (barriers, ZeRO-3 gathers): a rank that
    raised out of `save_checkpoint` midway would leave the others waiting in the next collective
    until the timeout. After a failure, this rank's remaining writes are skipped."""

    def __init__(self, inner: Any, failures: list[str], step: int, pool: ThreadPoolExecutor) -> None:
        self.inner = inner
        self.failures = failures
        self.step = step
        self.pool = pool  # hashes a written file while DeepSpeed writes the next (xxhash frees the GIL)
        self.pending: list[tuple[Path, Future[str]]] = []

    def track(self, path: Path) -> None:
        """Hash a file this rank has written, in the background."""
        self.pending.append((path, self.pool.submit(file_hash, path)))

    def _save_hashed(self, state_dict: Any, path: Path) -> None:
        with open(path, "wb") as f:
            writer = _HashingWriter(f)
            self.inner.save(state_dict, writer)
        done: Future[str] = Future()
        done.set_result(writer.digest.hexdigest())
        self.pending.append((path, done))

    def hashes(self, tag_dir: Path) -> dict[str, str]:
        """{name relative to `tag_dir`: hash} of every file this rank wrote there."""
        return {str(path.relative_to(tag_dir)): done.result() for path, done in self.pending}

    def guard(self, path: str | Path, write: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.failures:
            return None
        try:
            return write(*args, **kwargs)
        except Exception as err:
            self.failures.append(_failure(Path(path), err))
            return None

    def save(self, state_dict: Any, path: str) -> None:
        # imported here, not at the module's top: the first `import deepspeed` of a rank is then
        # init_distributed's, which keeps MLflow out of it (swbert._startup.import_deepspeed)
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        if isinstance(self.inner, TorchCheckpointEngine):  # torch.save: hashed as it writes
            self.guard(path, self._save_hashed, state_dict, Path(path))
        else:
            before = len(self.failures)
            self.guard(path, self.inner.save, state_dict, path)
            if len(self.failures) == before:
                self.track(Path(path))
        kill_point("in_save_shards", self.step, dist.get_rank())  # a drill: one shard file written

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.guard(path, self.inner.makedirs, path, exist_ok=exist_ok)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _HashingWriter:
    """A file for torch.save that hashes the bytes on their way to disk: no second read."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.digest = xxhash.xxh3_128()

    def write(self, data: Any) -> int:
        self.digest.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


@contextmanager
def _writes_recorded(engine, failures: list[str], step: int) -> Iterator[_RecordedWrites]:
    """Record the failures of DeepSpeed's writes during one save: its checkpoint engine (model and
    optimizer states) and rank 0's copy of its recovery scripts (zero_to_fp32.py)."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-hash")
    recorder = _RecordedWrites(engine.checkpoint_engine, failures, step, pool)
    engine.checkpoint_engine = recorder
    copy_scripts = getattr(engine, "_copy_recovery_script", None)
    if copy_scripts is not None:
        engine._copy_recovery_script = lambda path: recorder.guard(path, copy_scripts, path)
    try:
        yield recorder
    finally:
        engine.checkpoint_engine = recorder.inner
        if copy_scripts is not None:
            del engine._copy_recovery_script
        pool.shutdown(wait=True)


def _failure(path: Path, err: BaseException) -> str:
    """One failed write, with what bounds writing there: free space and this process's file size limit."""
    text = f"{path.name}: {type(err).__name__}: {err}"
    limits = []
    try:
        folder = next(p for p in (path, *path.parents) if p.is_dir())
        limits.append(f"{shutil.disk_usage(folder).free / 2**20:,.0f} MiB free there")
    except (OSError, StopIteration):
        pass
    fsize = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if fsize != resource.RLIM_INFINITY:
        limits.append(f"file size limit (ulimit -f) {fsize} bytes")
    return f"{text} ({', '.join(limits)})" if limits else text


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _fail_together(ckpt_root: Path, tag: str, failures: list[str]) -> None:
    """Collective: raise CheckpointSaveError on every rank if any rank failed, naming every failure.
    One all-reduce when all went well."""
    flag = torch.tensor([1 if failures else 0], device=_collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dist.get_rank(), socket.gethostname(), failures))
    named = "; ".join(f"rank {r} on {host} could not write {', '.join(f)}" for r, host, f in gathered if f)
    newest = newest_complete(ckpt_root)
    if newest == tag:  # only `latest` or pruning failed: the checkpoint itself is complete
        after = f"{tag} is complete and --resume auto continues from it"
    else:
        earlier = f"from {newest}, the newest complete checkpoint, untouched" if newest else "from step 0"
        after = (
            f"--resume auto continues {earlier}; the partial {tag}{PARTIAL} is moved to "
            f"{ckpt_root / INCOMPLETE_DIR} then, never deleted"
        )
    raise CheckpointSaveError(
        f"checkpoint {tag} could not be saved in {ckpt_root}: {named}. Free space on the file system "
        f"that holds it (or raise the quota or file size limit named), then restart the run: {after}"
    )


def mark_complete(
    tag_dir: Path, step: int, meta: dict[str, Any], hashes: dict[str, str] | None = None
) -> None:
    """Write the meta file, then the marker listing every file of the folder with its size and hash
    (`hashes`: those the writing ranks computed; rank 0 hashes the rest, e.g. the meta file)."""
    _atomic_write(tag_dir / META, json.dumps({**meta, "checkpoint_format": CHECKPOINT_FORMAT}, indent=1))
    write_marker(tag_dir, step, hashes)


def prune(ckpt_root: Path, keep: int, step: int = 0) -> None:
    """Delete complete checkpoints older than the newest `keep` complete ones; nothing else."""
    complete = [t for t in checkpoint_tags(ckpt_root) if is_complete(ckpt_root / t)]
    for old in complete[: -max(keep, 1)]:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if kill_requested("in_prune", step, rank):  # a drill: die with the folder half deleted
            next(p for p in sorted((ckpt_root / old).glob("*")) if p.is_file()).unlink()
            kill_point("in_prune", step, rank)
        shutil.rmtree(ckpt_root / old, ignore_errors=True)


def move_aside(ckpt_root: Path, name: str, folder: str) -> Path:
    """Move `ckpt_root/name` into `ckpt_root/folder/` (a step_N.partial as step_N), beside any
    earlier one of that name (`.1`, `.2`, ...); returns where it went. Never deletes."""
    tag = name.removesuffix(PARTIAL)
    target = ckpt_root / folder / tag
    n = 0
    while target.exists():
        n += 1
        target = ckpt_root / folder / f"{tag}.{n}"
    target.parent.mkdir(exist_ok=True)
    os.replace(ckpt_root / name, target)
    return target


def set_aside_incomplete(ckpt_root: Path) -> list[Path]:
    """Move step_* folders without a finished save, and step_*.partial folders (a save cut off before
    its rename), to `incomplete/` (rank 0, before training); returns where they went. They are kept
    for inspection, never deleted."""
    moved = []
    partials = sorted(p.name for p in ckpt_root.iterdir() if p.is_dir() and PARTIAL_RE.match(p.name))
    for name in [*(t for t in checkpoint_tags(ckpt_root) if not is_complete(ckpt_root / t)), *partials]:
        if marker_unreadable(ckpt_root / name):  # written atomically: damaged at rest, not cut off
            target = move_aside(ckpt_root, name, DAMAGED_DIR)
            log.warning(
                "moved checkpoint %s to %s: its %s does not parse (nothing deleted)", name, target, COMPLETE
            )
            moved.append(target)
            continue
        target = move_aside(ckpt_root, name, INCOMPLETE_DIR)
        log.warning(
            "moved incomplete checkpoint %s to %s (its save did not finish; nothing deleted)", name, target
        )
        moved.append(target)
    return moved


def abandon_newer(ckpt_root: Path, tag: str) -> Path | None:
    """A rewind is a branch: move the step folders newer than `tag` (the line this resume leaves)
    to `abandoned-<time>/` and point `latest` at `tag` (rank 0, before the first save). Returns the
    folder they went to, None when there was nothing newer."""
    step = int(TAG_RE.match(tag).group(1))  # type: ignore[union-attr]
    newer = [t for t in checkpoint_tags(ckpt_root) if int(t[5:]) > step]
    newer += [p.name for p in ckpt_root.glob("step_*" + PARTIAL) if int(p.name[5:13]) > step]
    if not newer:
        return None
    folder = f"abandoned-{time.strftime('%Y%m%d-%H%M%S')}"
    for name in newer:
        move_aside(ckpt_root, name, folder)
    if (ckpt_root / tag).is_dir():
        _atomic_write(ckpt_root / LATEST, tag)
    log.warning(
        "resuming from %s rewinds the run: its newer checkpoints (%s) moved to %s, kept, never deleted",
        tag, ", ".join(newer), ckpt_root / folder,
    )  # fmt: skip
    return ckpt_root / folder


def verify(tag_dir: Path) -> list[str]:
    """Collective: the files of `tag_dir` that do not match their recorded hashes, on every rank;
    every rank hashes its share of the files, so the check reads the checkpoint once in all."""
    mine = mismatched(tag_dir, dist.get_rank(), dist.get_world_size())
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return sorted({name for part in gathered for name in part})  # a marker's fault: once, not per rank


def load(engine, load_dir: Path, tag: str) -> dict[str, Any]:
    """Load model, optimizer and scheduler; restore this rank's RNG. Returns the client state.
    Every file DeepSpeed reads is loaded with weights_only=True (swbert.safe_load). What DeepSpeed
    restores from the checkpoint over this run's configuration is put back (`_keep_configured`)."""
    configured = _configured(engine)
    with weights_only_loads():
        _, client_state = engine.load_checkpoint(
            str(load_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
    if client_state is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {load_dir / tag}")
    changed = _keep_configured(engine, configured)
    if changed and dist.get_rank() == 0:
        log.warning("resume keeps this run's %s over the checkpoint's", "; ".join(changed))
    rng_file = load_dir / tag / f"rng_rank{dist.get_rank():05d}.pt"
    if rng_file.is_file():
        set_rng_state(load_rng_state(rng_file))
    else:
        log.warning("%s missing (world size changed?): RNG streams restart from the seed", rng_file.name)
    return client_state


# Optimizer group settings the resume applies itself, logged and tagged as --allow-resume-change
# lets them through (swbert.runtime.optim.apply_hyperparameters), and the schedule's state.
_APPLIED_ON_RESUME = ("lr", "initial_lr", "betas", "eps", "weight_decay")


def _configured(engine) -> dict[str, Any]:
    """What DeepSpeed's load overwrites with the checkpoint's values although this run configures it:
    the clipping of its ZeRO-1/2, bf16 and fp16 optimizers (`clip_grad`, restored by their
    `load_state_dict`), the loss scaler (another precision's, after --allow-resume-change precision)
    and the optimizer groups' other options (e.g. torch's `fused`, `foreach`)."""
    optimizer = engine.optimizer
    groups = getattr(optimizer, "param_groups", None) or []
    return {
        "clip_grad": getattr(optimizer, "clip_grad", None),
        "loss_scaler": getattr(optimizer, "loss_scaler", None),
        "dynamic_loss_scale": getattr(optimizer, "dynamic_loss_scale", None),
        "groups": [
            {k: v for k, v in g.items() if k != "params" and k not in _APPLIED_ON_RESUME} for g in groups
        ],
    }


def _keep_configured(engine, configured: dict[str, Any]) -> list[str]:
    """Put back what `_configured` recorded before the load; returns what differed ("clip_grad: 1.0
    -> 0.25"). A dynamic loss scaler of the same kind is the checkpoint's: its scale is state."""
    optimizer, changed = engine.optimizer, []
    clip = configured["clip_grad"]
    if clip is not None and optimizer.clip_grad != clip:
        changed.append(f"clip_grad: {optimizer.clip_grad!r} -> {clip!r} (--grad-clip)")
        optimizer.clip_grad = clip
    fresh = configured["loss_scaler"]
    restored = getattr(optimizer, "loss_scaler", None)
    if fresh is not None and restored is not fresh and _scaler(restored) != _scaler(fresh):
        changed.append(f"loss scaling: {_scaler(restored)} -> {_scaler(fresh)} (--precision)")
        optimizer.loss_scaler = fresh
        optimizer.dynamic_loss_scale = configured["dynamic_loss_scale"]
    for group, options in zip(getattr(optimizer, "param_groups", None) or [], configured["groups"]):
        for key, value in options.items():
            if group.get(key, value) != value:
                changed.append(f"{key}: {group[key]!r} -> {value!r}")
            group[key] = value
    return list(dict.fromkeys(changed))


def _scaler(scaler: Any) -> str:
    """A loss scaler's kind: dynamic (its scale is state), or static at its scale."""
    if getattr(scaler, "dynamic", False):
        return "dynamic"
    return f"static {getattr(scaler, 'cur_scale', None)!r}"
