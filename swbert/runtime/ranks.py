"""Who this process is: one type for pretraining, fine-tuning and the scaling tools.

Ranks are laid out tensor-parallel first (megatron-core's order): with 4 processes and TP=2, ranks
{0, 1} and {2, 3} each hold one copy of the model split in two, and ranks {0, 2} and {1, 3} are
the data-parallel groups. Without tensor parallelism every process is a data-parallel rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParallelDims:
    """Global rank and world size, this node's local rank, and the tensor/data-parallel grid.

    `tp_group`/`dp_group` are process groups once they exist (None: the whole world, or no
    process group at all in a single process)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    """This process's index on its node: the GPU it drives."""
    tp_size: int = 1
    tp_group: Any = field(default=None, compare=False, repr=False)
    dp_group: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.world % self.tp_size:
            raise ValueError(
                f"world size {self.world} is not divisible by --tensor-parallel {self.tp_size}; "
                f"launch a multiple of {self.tp_size} ranks"
            )

    @property
    def tp_rank(self) -> int:
        """This process's shard of the model: its place in its tensor-parallel group."""
        return self.rank % self.tp_size

    @property
    def dp_size(self) -> int:
        """How many copies of the model train side by side."""
        return self.world // self.tp_size

    @property
    def dp_rank(self) -> int:
        """Which copy this process belongs to: the data it reads."""
        return self.rank // self.tp_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_tp_enabled(self) -> bool:
        return self.tp_size > 1

    @classmethod
    def plan(cls, world: int, tp_size: int = 1, rank: int = 0, local_rank: int = 0) -> ParallelDims:
        """The grid of `world` processes at tensor-parallel size `tp_size`, before any group exists;
        raises a ValueError saying what to launch when `tp_size` does not divide `world`."""
        return cls(rank, world, local_rank, tp_size)

    @classmethod
    def from_env(cls, tp_size: int = 1) -> ParallelDims:
        """From the launcher's environment (torchrun, deepspeed, srun once mapped); one process when
        none is set. Needs no process group."""
        return cls.plan(
            int(os.environ.get("WORLD_SIZE", 1)),
            tp_size,
            int(os.environ.get("RANK", 0)),
            int(os.environ.get("LOCAL_RANK", 0)),
        )
