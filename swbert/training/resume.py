"""The resume decision, in one place: which checkpoint a run continues from, or none.

`resolve_resume` is the one step. `Trainer.setup` calls it twice with the same arguments: before the
process group exists, every rank decides alone, so an incompatible checkpoint (another model, tensor-
parallel size, ZeRO stage, setting) is refused at once on every rank, naming what differs, from its
meta file once that file and the marker pass their check (one whose do not is looked past, or
refused when named explicitly); with the process group, the call is collective: rank 0's choice on
every rank (each checks it can see the folder), every file checked against the hashes its marker
records (the ranks share the reading), a damaged checkpoint set aside and the previous complete one
taken instead, then checked again, its tensors' names too. Nothing of a checkpoint is read before
its hash is checked.

`find_checkpoint` is what a `--resume` value (or a path given to the export) names: the newest
complete checkpoint of a checkpoints/ folder (`latest` is a convenience only), an explicit step
folder (which must be complete), or a universal copy (`latest_universal`).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from swbert.runtime.checkpoint_format import (
    COMPLETE,
    DAMAGED_DIR,
    LATEST,
    LATEST_UNIVERSAL,
    META,
    TAG_RE,
    checkpoint_tags,
    damage,
    is_complete,
    is_universal,
    mismatched,
    newest_complete,
    read_latest,
    require_current,
    require_current_folder,
)
from swbert.training import checkpoint as ckpt
from swbert.training.compat import check_compatible
from swbert.training.config import TrainConfig

log = logging.getLogger(__name__)


class CheckpointDamaged(ValueError):
    """A checkpoint named explicitly (--resume PATH/step_N) is incomplete or fails its hashes."""


@dataclass(frozen=True)
class Resume:
    """The checkpoint a run continues from, and the deliberate changes (--allow-resume-change) it
    lets through, as "key: saved -> now"."""

    load_dir: Path
    tag: str
    changes: tuple[str, ...] = ()

    @property
    def tag_dir(self) -> Path:
        return self.load_dir / self.tag

    @property
    def universal(self) -> bool:
        """Converted to load at another tensor- or data-parallel size (`checkpoint.load_universal`)."""
        return is_universal(self.tag_dir)


def _newest(ckpt_root: Path, flag: str, warn: bool = True) -> tuple[Path, str] | None:
    """The newest complete checkpoint under `ckpt_root`, saying so when `latest` names another."""
    tag = newest_complete(ckpt_root)
    pointed = read_latest(ckpt_root)
    if warn and tag is not None and pointed != tag:
        why = (
            "is missing" if not (ckpt_root / LATEST).exists() else f"names {pointed or 'no valid checkpoint'}"
        )
        log.warning(
            "%s %s; resuming from the newest complete checkpoint, %s (%s)", ckpt_root / LATEST, why, tag, flag
        )
    return (ckpt_root, tag) if tag else None


def find_checkpoint(resume: str, ckpt_root: Path, warn: bool = True) -> tuple[Path, str] | None:
    """(load_dir, tag) for --resume none|auto|PATH; None when starting fresh.

    auto and a checkpoints/ folder resume its newest complete checkpoint (`latest` is only a
    convenience); a step folder named explicitly must be complete, else a one-line error."""
    if resume == "none":
        return None
    if resume == "auto":
        require_current_folder(ckpt_root, "--resume auto: ")
        return _newest(ckpt_root, "--resume auto", warn)
    path = Path(resume)
    if path.is_dir() and (path / LATEST_UNIVERSAL).is_file():  # a converted (universal) folder
        tag = read_latest(path, LATEST_UNIVERSAL)
        if tag is None:
            raise FileNotFoundError(f"--resume {resume}: its '{LATEST_UNIVERSAL}' names a missing checkpoint")
        require_current(path / tag, f"--resume {resume}: ")
        if not is_complete(path / tag):
            raise CheckpointDamaged(
                f"--resume {resume}: {path / tag} is incomplete (a file listed in its {COMPLETE} is missing "
                "or has another size: the conversion did not finish?); convert the checkpoint again"
            )
        return path, tag
    if path.is_dir() and TAG_RE.match(path.name):
        require_current(path, f"--resume {resume}: ")
        if not is_complete(path):
            newest = newest_complete(path.parent)
            raise CheckpointDamaged(
                f"--resume {resume}: this checkpoint is incomplete (its save did not finish, or a file "
                f"listed in {COMPLETE} is missing or has another size); resume from "
                + (f"{path.parent / newest}, the newest complete one" if newest else "another checkpoint")
                + ", or --resume auto"
            )
        return path.parent, path.name
    if path.is_dir() and ((path / LATEST).is_file() or checkpoint_tags(path)):  # a checkpoints/ folder
        require_current_folder(path, f"--resume {resume}: ")
        found = _newest(path, f"--resume {resume}", warn)
        if found is None:
            raise FileNotFoundError(f"--resume {resume}: holds no complete checkpoint")
        return found
    raise FileNotFoundError(
        f"--resume {resume}: not a checkpoint (expected a checkpoints/ folder with 'latest' or a step_* folder)"
    )


def _checked(
    cfg: TrainConfig, choice: tuple[Path, str] | None, record: dict[str, Any], tensors: bool = True
) -> Resume | None:
    """`choice` against this run (`compat.check_compatible`: model, tensor-parallel size, settings;
    with `tensors`, the names of the tensors it holds: its files' hashes checked already)."""
    if choice is None:
        return None
    changes = check_compatible(choice[0] / choice[1], record, cfg.allow_resume_change, tensors)
    return Resume(choice[0], choice[1], tuple(changes))


def _explicit(cfg: TrainConfig) -> bool:
    """Whether --resume names one checkpoint (a step folder, or a converted folder): refused when
    damaged, where a checkpoints/ folder's newest is set aside for the previous one."""
    path = Path(cfg.resume)
    return bool(TAG_RE.match(path.name)) or (path / LATEST_UNIVERSAL).is_file()


def _damaged(cfg: TrainConfig, tag_dir: Path, bad: list[str]) -> CheckpointDamaged:
    return CheckpointDamaged(
        f"--resume {cfg.resume}: {tag_dir} is damaged ({damage(bad)}; damaged on disk?); resume from an "
        "earlier checkpoint, or --resume auto to fall back to the newest intact one"
    )


def _meta_checked(cfg: TrainConfig, choice: tuple[Path, str] | None) -> tuple[Path, str] | None:
    """Before the process group: `choice`, or the newest older complete checkpoint, whose marker and
    meta file pass their check (`mismatched`), so that compatibility is judged on a meta file that is
    what was saved (the collective check sets a damaged one aside). Named explicitly, one that fails
    is refused."""
    while choice is not None:
        bad = mismatched(choice[0] / choice[1], only=[META])
        if not bad:
            return choice
        if _explicit(cfg):
            raise _damaged(cfg, choice[0] / choice[1], bad)
        older = [t for t in checkpoint_tags(choice[0]) if t < choice[1] and is_complete(choice[0] / t)]
        choice = (choice[0], older[-1]) if older else None
    return None


def resolve_resume(cfg: TrainConfig, ckpt_root: Path, record: dict[str, Any]) -> Resume | None:
    """The checkpoint this run resumes from (None: a fresh start); see the module's docstring.

    Without a process group, this rank's choice, refused here if incompatible; with one (collective),
    the one every rank loads: agreed, its hashes verified, a damaged one set aside for the previous."""
    if not (dist.is_available() and dist.is_initialized()):
        choice = _meta_checked(cfg, find_checkpoint(cfg.resume, ckpt_root))
        return _checked(cfg, choice, record, tensors=False)  # the tensors: once their hashes are checked
    warn = False  # said already, by the call before the process group
    while True:
        found: tuple[Path, str] | Exception | None = None
        if dist.get_rank() == 0:
            try:
                found = find_checkpoint(cfg.resume, ckpt_root, warn)
            except (OSError, ValueError) as err:  # raised on every rank, not on rank 0 alone
                found = err
        choice = agree_on_resume(found)
        if choice is None or not _set_aside_if_damaged(cfg, choice):
            return _checked(cfg, choice, record)
        warn = True


def _set_aside_if_damaged(cfg: TrainConfig, choice: tuple[Path, str]) -> bool:
    """Collective: whether `choice` failed its hashes and was moved to damaged/ (rank 0; never
    deleted), so the caller falls back to the previous complete one. A step folder named
    explicitly is refused instead, in one line naming the files."""
    tag_dir = choice[0] / choice[1]
    bad = ckpt.verify(tag_dir)
    if not bad:
        return False
    if _explicit(cfg):
        raise _damaged(cfg, tag_dir, bad)
    if dist.get_rank() == 0:
        moved = ckpt.move_aside(choice[0], choice[1], DAMAGED_DIR)
        log.warning(
            "checkpoint %s is damaged (%s); moved to %s (nothing deleted), falling back to the previous "
            "complete checkpoint", tag_dir, damage(bad), moved,
        )  # fmt: skip
    dist.barrier()
    return True


def agree_on_resume(
    choice: tuple[Path, str] | Exception | None, visible: Callable[[Path], bool] = Path.is_dir
) -> tuple[Path, str] | None:
    """Rank 0's checkpoint to resume from, on every rank (collective); rank 0's error choosing it is
    raised on every rank. Each rank checks that it can see that folder; if any cannot, every rank
    raises, naming those ranks and their hosts."""
    decision = [choice]
    dist.broadcast_object_list(decision, src=0)
    chosen = decision[0]
    if isinstance(chosen, Exception):
        raise chosen
    ok = chosen is None or visible(chosen[0] / chosen[1])
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (dist.get_rank(), socket.gethostname(), ok))
    blind = [f"rank {r} on {host}" for r, host, can_see in seen if not can_see]
    if blind:
        raise RuntimeError(
            f"{', '.join(blind)} cannot see checkpoint {chosen[0] / chosen[1]}, which rank 0 resumes from: "
            "the output folder must be on a file system every node shares"
        )
    return chosen
