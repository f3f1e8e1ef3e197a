"""Fault injection for tests and drills, switched on by environment variables, never by the config.

    SWBERT_FAULT_NONFINITE_STEPS=5,6,7   the loss of these optimizer steps is NaN on every rank
    SWBERT_FAULT_KILL_AFTER_STEP=14      rank 0 kills itself (-9) after step 14
    SWBERT_FAULT_KILL_IN_SAVE=8          rank 0 kills itself in the save of step 8 (shards written)

Drills on a real cluster use the same variables (set them in the job's environment).
"""

from __future__ import annotations

import os

NONFINITE_STEPS = "SWBERT_FAULT_NONFINITE_STEPS"


def nonfinite_steps() -> frozenset[int]:
    """The optimizer steps (1-based) whose loss the trainer replaces by NaN."""
    raw = os.environ.get(NONFINITE_STEPS, "")
    try:
        return frozenset(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{NONFINITE_STEPS}={raw!r}: expected comma-separated step numbers") from None
