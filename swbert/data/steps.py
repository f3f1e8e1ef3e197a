"""The global batch of each optimizer step, and the step each stream position belongs to.

A run takes consecutive positions of the global sample stream, `batch_at(s)` of them at step s.
Without a batch-size warm-up every step takes the full global batch. With one (ours, as recent
encoders do; the paper's batch is fixed), step s < `warmup_steps` takes

    unit x max(1, floor((start + (full - start) x s // warmup_steps) / unit))

sequences: the linear ramp from `start` to `full`, rounded down to whole multiples of `unit`
(micro-batch x data-parallel ranks: one micro-batch more per rank per unit), then `full` from
`warmup_steps` on. Everything here is integer arithmetic, so any process (a rank, a loader worker,
a resumed run) computes the same steps.

A resume that changes the schedule (`--allow-resume-change`) continues from the checkpoint's step
and stream position: `anchored(step, position)` maps the positions after it with the new schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np


@dataclass(frozen=True)
class BatchSchedule:
    """Sequences per optimizer step (`batch_at`) and the step of any stream position (`steps_of`)."""

    full: int  # the global batch after the warm-up
    unit: int  # micro-batch x data-parallel ranks: the global batch is a whole number of these
    start: int | None = None  # the global batch of step 0 (with warmup_steps > 0)
    warmup_steps: int = 0  # steps over which the batch rises linearly from start to full (0: none)
    anchor_step: int = 0  # the step that begins at stream position `anchor_position`
    anchor_position: int = 0
    # samples before each warm-up step, [0, batch_at(0), ...] (warmup_steps + 1 entries)
    _before: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.full <= 0 or self.unit <= 0 or self.full % self.unit:
            raise ValueError(f"the global batch {self.full} is not a positive multiple of {self.unit}")
        if self.warmup_steps and not (self.start is not None and 0 < self.start <= self.full):
            raise ValueError(
                f"batch_size_start={self.start} must be between 1 and global_batch_size={self.full} "
                "with batch_size_warmup_steps > 0"
            )
        sizes = [self.batch_at(s) for s in range(self.warmup_steps)]
        object.__setattr__(self, "_before", np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]))

    def batch_at(self, step: int) -> int:
        """Sequences of step `step` (0-based), over all ranks."""
        if step >= self.warmup_steps:
            return self.full
        assert self.start is not None
        ramp = self.start + (self.full - self.start) * step // self.warmup_steps
        return self.unit * max(1, ramp // self.unit)

    def accumulation(self, step: int) -> int:
        """Micro-batches each rank runs at step `step`."""
        return self.batch_at(step) // self.unit

    def samples_before(self, step: int) -> int:
        """Stream positions taken by the steps before `step` (from step 0, whatever the anchor)."""
        if step <= self.warmup_steps:
            return int(self._before[step])
        return int(self._before[-1]) + (step - self.warmup_steps) * self.full

    def steps_of(self, positions: np.ndarray) -> np.ndarray:
        """The step that draws each stream position (positions before the anchor: the anchor's step)."""
        # the position each one would have in a run that followed this schedule from step 0
        virtual = np.asarray(positions, dtype=np.int64) - self.anchor_position
        virtual = np.maximum(virtual, 0) + self.samples_before(self.anchor_step)
        ramped = np.searchsorted(self._before, virtual, side="right") - 1  # within the warm-up
        after = self.warmup_steps + (virtual - self._before[-1]) // self.full
        return np.where(virtual < self._before[-1], ramped, after)

    def anchored(self, step: int, position: int) -> BatchSchedule:
        """This schedule continued from `step` at stream position `position` (a resumed run's)."""
        return replace(self, anchor_step=step, anchor_position=position)
