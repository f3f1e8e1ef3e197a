"""A data-parallel sampler whose sample order does not depend on the number of ranks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np


class GlobalSampler:
    """Infinite micro-batches of sample indices for one data-parallel rank.

    All ranks walk one global stream: the permutation of epoch 0, then that of epoch 1, ...,
    each keyed only by `(seed, epoch)`. Global batch `t` is stream positions
    `[t * G, (t + 1) * G)` with `G = micro_batch_size * dp_size`, and rank `r` takes its
    contiguous slice `[t * G + r * mb, t * G + (r + 1) * mb)`. A global batch may straddle an
    epoch boundary, so the stream (hence what the model sees) is the same for any `dp_size`,
    and the position (epoch, samples consumed within it) can be restored under another one.

    Use it as a DataLoader `batch_sampler`. `state_dict()` counts the micro-batches this
    iterator has yielded; when a DataLoader prefetches, pass how many of them have not been
    trained on yet as `in_flight`.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        seed: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        shuffle: bool = True,
    ) -> None:
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, not {num_samples}")
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive, not {micro_batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), not {dp_rank}")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.micro_batch_size, self.dp_rank, self.dp_size = (
            micro_batch_size,
            dp_rank,
            dp_size,
        )  # this rank's share
        self.epoch = 0
        self.consumed = 0  # global samples of `epoch` consumed so far, by all ranks together
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.dp_size

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_perm"], state["_perm_epoch"] = None, None  # recomputed where needed, not pickled
        return state

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of all samples in `epoch` (cached for the current epoch only)."""
        if self._perm_epoch != epoch:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, epoch])
                perm = rng.permutation(self.num_samples)
            else:
                perm = np.arange(self.num_samples)
            dtype = np.int32 if self.num_samples < 2**31 else np.int64
            self._perm, self._perm_epoch = perm.astype(dtype, copy=False), epoch
        assert self._perm is not None
        return self._perm

    def take(self, position: int, count: int) -> np.ndarray:
        """The sample indices at global stream positions `[position, position + count)`: (count,) int64.

        Position `p` is entry `p % num_samples` of epoch `p // num_samples`'s permutation, so a
        range may run across epoch boundaries.
        """
        if position < 0 or count < 0:
            raise ValueError(f"stream position ({position}) and count ({count}) must be non-negative")
        out = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            epoch, start = divmod(position + done, self.num_samples)
            chunk = self.permutation(epoch)[start : start + count - done]
            out[done : done + len(chunk)] = chunk
            done += len(chunk)
        return out

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            position = self.epoch * self.num_samples + self.consumed + self.dp_rank * self.micro_batch_size
            batch = self.take(position, self.micro_batch_size).tolist()
            self._advance(self.global_batch_size)
            yield batch

    def _advance(self, samples: int) -> None:
        total = self.epoch * self.num_samples + self.consumed + samples
        self.epoch, self.consumed = divmod(total, self.num_samples)

    def state_dict(self, in_flight: int = 0) -> dict[str, Any]:
        """Position of the global stream: `{"epoch": e, "consumed": n}` (+ the settings, to check).

        `in_flight`: micro-batches yielded but not trained on (DataLoader prefetch); the state
        rewinds over them so a resumed run sees them again.
        """
        total = self.epoch * self.num_samples + self.consumed - in_flight * self.global_batch_size
        if total < 0:
            raise ValueError(f"in_flight={in_flight} is more micro-batches than were yielded")
        epoch, consumed = divmod(total, self.num_samples)
        return {
            "epoch": epoch,
            "consumed": consumed,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; `dp_size` and `micro_batch_size` may differ from the saver's."""
        for key in ("seed", "num_samples", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]!r}, this run has {getattr(self, key)!r}: "
                    "resuming would not continue the same sample order (same data folder and seed needed)"
                )
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
        if not 0 <= self.consumed < self.num_samples:
            self._advance(0)
