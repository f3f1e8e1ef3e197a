"""How fine-tuning examples become batches: padded, length-grouped, or unpadded (one token stream
with cumulative lengths); `--unpad auto|on|off` picks (docs/finetuning.md, "Batching", ours)."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from swbert.models.varlen import varlen_kernel
from swbert.runtime.ranks import ParallelDims

log = logging.getLogger(__name__)

# Compiled runs pad each batch up to a multiple of this many tokens (ours): a few shapes (two for
# GLUE's 128 tokens, six for SQuAD's 384), so torch.compile builds a few graphs, not one per length.
COMPILE_BUCKET = 64
Batch = dict[str, torch.Tensor | int]


@functools.cache
def resolve_unpad(setting: Literal["auto", "on", "off"], device: str, attention_dropout: float) -> bool:
    """Whether fine-tuning on `device` runs unpadded; says once which kernel it gets."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"--unpad {setting!r}: choose auto, on or off")
    kernel = varlen_kernel(device, attention_dropout)
    if setting == "off" or (setting == "auto" and kernel is None):
        log.info("--unpad %s: padded batches of similar lengths (length-grouped)", setting)
        return False
    reference = (
        f"the per-sequence reference (no variable-length kernel on {device} at dropout {attention_dropout:g})"
    )
    log.info("--unpad %s: unpadded batches, attention by %s", setting, kernel or reference)
    return True


def example_length(item: dict) -> int:
    """Real tokens of one encoded example (a window padded to a fixed length counts its mask)."""
    mask = item.get("attention_mask")
    return int(sum(mask)) if mask is not None else len(item["input_ids"])


def unpad_collate(pad_token_id: int = 0) -> Callable[[list[dict]], Batch]:
    """A ``collate_fn`` giving one token stream: per-token lists as (T,) tensors of the real tokens,
    ``cu_seqlens`` (B+1,) int32, ``max_seqlen`` (an int), per-example fields as (B,) tensors; built on
    the host, so the model needs no device-to-host sync to unpad (`pad_token_id`: as `pad_collate`'s)."""

    def collate(items: list[dict]) -> Batch:
        lengths = [example_length(it) for it in items]
        out: Batch = {}
        for key, value in items[0].items():
            if key == "attention_mask":
                continue
            if isinstance(value, list):  # per token (input_ids, token_type_ids): into the stream
                flat = [t for it, n in zip(items, lengths) for t in it[key][:n]]
                out[key] = torch.tensor(flat, dtype=torch.long)
            else:
                out[key] = torch.as_tensor(np.asarray([it[key] for it in items]))
        out["cu_seqlens"] = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
        out["max_seqlen"] = max(lengths)
        return out

    return collate


class LengthGroupedBatchSampler(Sampler[list[int]]):
    """Batches of examples of similar lengths, in a random order: little padding per batch.

    Per epoch (seeded by `seed` and the epoch): shuffle, cut into megabatches of `GROUP` global
    batches, sort each by length and cut it into global batches of `batch_size * world`, shuffle
    those. Rank r takes the r-th slice of each, so the ranks' shares together are the single-process
    batches (indices padded by repetition to a multiple of the world size, as DistributedSampler)."""

    GROUP = 50  # global batches per megabatch (ours)

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int = 0, world: int = 1, rank: int = 0):
        if batch_size <= 0 or not 0 <= rank < world:
            raise ValueError(f"batch_size={batch_size} must be positive and rank={rank} in [0, {world})")
        self.lengths = np.asarray(lengths)
        self.batch_size, self.seed, self.world, self.rank, self.epoch = batch_size, seed, world, rank, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def global_batches(self) -> list[np.ndarray]:
        """This epoch's batches of `batch_size * world` indices (the last may be smaller)."""
        rng = np.random.default_rng([self.seed, self.epoch])
        order = rng.permutation(len(self.lengths))
        extra = -len(order) % self.world  # DistributedSampler's padding: every rank the same count
        order = np.concatenate([order, order[:extra]])
        size = self.batch_size * self.world
        batches = []
        for start in range(0, len(order), size * self.GROUP):
            mega = order[start : start + size * self.GROUP]
            mega = mega[np.argsort(-self.lengths[mega], kind="stable")]
            batches += [mega[i : i + size] for i in range(0, len(mega), size)]
        return [batches[i] for i in rng.permutation(len(batches))]

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.global_batches():
            share = len(batch) // self.world  # the last batch, split evenly
            yield batch[self.rank * share : (self.rank + 1) * share].tolist()

    def __len__(self) -> int:
        return math.ceil(math.ceil(len(self.lengths) / self.world) / self.batch_size)


def train_loader(
    train_set: Dataset,
    collate: Callable,
    micro: int,
    dims: ParallelDims,
    seed: int,
    workers: int,
    grouped: bool,
) -> DataLoader:
    """This rank's share of the training set, reshuffled by its sampler's `set_epoch`: length-grouped
    batches, or random ones from a `DistributedSampler` (1 rank as N). Collated in ``workers``
    persistent processes (starting them costs more than an epoch of a small GLUE task)."""
    common: dict[str, Any] = dict(
        collate_fn=collate,
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=2 if workers > 0 else None,
        # each worker's Python, NumPy and torch generators are seeded from it (torch's worker loop)
        generator=torch.Generator().manual_seed(seed),
        pin_memory=torch.cuda.is_available(),
    )
    if grouped:
        lengths = [example_length(train_set[i]) for i in range(len(train_set))]
        batches = LengthGroupedBatchSampler(lengths, micro, seed, dims.world, dims.rank)
        return DataLoader(train_set, batch_sampler=batches, **common)
    sampler = DistributedSampler(train_set, dims.world, dims.rank, shuffle=True, seed=seed)
    return DataLoader(train_set, batch_size=micro, sampler=sampler, drop_last=False, **common)
