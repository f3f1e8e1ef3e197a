"""Fault injection for tests and drills, switched on by environment variables, never by the config.

    SWBERT_FAULT_NONFINITE_STEPS=5,6,7      the loss of these optimizer steps is NaN on every rank
    SWBERT_FAULT_NONFINITE_STEPS=7:inf@1    ... inf instead of NaN, and on rank 1 only
    SWBERT_FAULT_KILL=in_step:7@1           rank 1 kills itself (-9) in the middle of step 7
    SWBERT_FAULT_KILL=in_prune:8            rank 0 dies while its save of step 8 prunes older checkpoints
                                            (every point: `kill_requested`)

Drills on a real cluster use the same variables (set them in the job's environment).
"""

from __future__ import annotations

import os
import re
import signal

NONFINITE_STEPS = "SWBERT_FAULT_NONFINITE_STEPS"
_ENTRY = re.compile(r"^(\d+)(?::(nan|inf|-inf))?(?:@(\d+))?$")


class NonFiniteFaults:
    """The optimizer steps (1-based) whose loss the trainer multiplies by NaN or inf, and on which ranks."""

    def __init__(self, spec: str = "") -> None:
        self.steps: dict[int, tuple[float, int | None]] = {}
        for entry in (x.strip() for x in spec.split(",")):
            if not entry:
                continue
            match = _ENTRY.match(entry)
            if match is None:
                raise ValueError(
                    f"{NONFINITE_STEPS}={spec!r}: {entry!r} is not STEP[:nan|inf][@RANK] (e.g. 7, 7:inf@1)"
                )
            step, value, rank = match.groups()
            self.steps[int(step)] = (float(value or "nan"), None if rank is None else int(rank))

    def value_at(self, step: int, rank: int) -> float | None:
        """The factor for this rank's loss at `step`, or None when the step is not faulted here."""
        value, only = self.steps.get(step, (None, None))
        return value if value is not None and only in (None, rank) else None


def nonfinite_faults() -> NonFiniteFaults:
    return NonFiniteFaults(os.environ.get(NONFINITE_STEPS, ""))


KILL = "SWBERT_FAULT_KILL"  # POINT:STEP[@RANK], comma-separated; rank 0 when no @RANK
KILL_POINTS = ("in_step", "after_step", "in_save_shards", "in_save", "in_prune", "in_export")
# the variables of the first drills, refused with their spelling today (a drill that set one would
# otherwise run without its kill)
RENAMED_KILLS = {"SWBERT_FAULT_KILL_AFTER_STEP": "after_step", "SWBERT_FAULT_KILL_IN_SAVE": "in_save"}


def kill_requested(point: str, step: int, rank: int) -> bool:
    """Whether the environment asks `rank` to die at `point` of optimizer step `step`:

    in_step         after the first micro-batch's backward, before the update
    after_step      after the step (and its log and save)
    in_save_shards  in the step's save, after DeepSpeed's first shard file, before the others
    in_save         in the step's save, every shard written, no completeness marker yet
    in_prune        in the step's save, marker and `latest` written, amid deleting an older checkpoint
    in_export       in the final export, the new folder written but not yet renamed into place
    """
    for old, where in RENAMED_KILLS.items():
        if os.environ.get(old):
            raise ValueError(f"{old} is no longer read: set {KILL}={where}:{os.environ[old]} instead")
    wanted = [x.strip() for x in os.environ.get(KILL, "").split(",") if x.strip()]
    for entry in wanted:
        where, _, at = entry.partition(":")
        at_step, _, at_rank = at.partition("@")
        if where not in KILL_POINTS:
            raise ValueError(f"{KILL}: {entry!r} names no kill point; points: {', '.join(KILL_POINTS)}")
        if where == point and at_step == str(step) and int(at_rank or 0) == rank:
            return True
    return False


def kill_point(point: str, step: int, rank: int) -> None:
    """This process kills itself with SIGKILL at `point` when `kill_requested` says so."""
    if kill_requested(point, step, rank):
        os.kill(os.getpid(), signal.SIGKILL)
