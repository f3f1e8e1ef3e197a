"""What sits at any position of a split's global sample stream: masked samples, by position.

`MaskedStream.batch(p, n)` gives the masked samples at stream positions `[p, p + n)`: the
sampler gives their indices, `PackedSequences.get_batch` reads them, and
`MaskingCollator.mask` masks each by a key hashed from (stream seed, its stream position).
Everything is a function of the position, so any process can build any micro-batch: a rank its
slice, a loader worker every W-th micro-batch, a resumed run the next one, all bit for bit alike.
"""

from __future__ import annotations

import numpy as np
import torch

from swbert.data.masking import MaskingCollator, sample_keys
from swbert.data.mix import MixSchedule
from swbert.data.packing import PackedSequences, document_seqlens
from swbert.data.sampler import GlobalSampler

VALID_STREAM_OFFSET = 1_000_003  # validation masks come from the stream seed + this, apart from training's


class MaskedStream:
    """One split's global sample stream (`GlobalSampler` order), each sample masked by its position.

    Holds no token ids: the packed sequences read the memory-mapped shards, and a pickled copy
    (a spawned worker's) maps them again and recomputes the epoch permutation it needs.
    """

    def __init__(
        self,
        sequences: PackedSequences,
        collator: MaskingCollator,
        seed: int,
        *,
        shuffle: bool,
        stream_seed: int,
        document_attention: bool = False,
    ) -> None:
        self.sequences = sequences
        self.document_attention = document_attention
        self.collator = collator
        self.stream_seed = stream_seed
        self.sampler = GlobalSampler(
            len(sequences), seed=seed, micro_batch_size=1, dp_rank=0, dp_size=1, shuffle=shuffle
        )
        self.max_predictions = collator.max_predictions(sequences.seq_len)  # checked here, before any batch

    def __len__(self) -> int:
        return len(self.sequences)

    def batch(self, position: int, count: int) -> dict[str, torch.Tensor]:
        """The `count` masked samples at stream positions `[position, position + count)` (see MaskingCollator)."""
        indices = self.sampler.take(position, count)  # (B,)
        input_ids = self.sequences.get_batch(indices)  # (B, S)
        positions = np.arange(position, position + count, dtype=np.int64)  # (B,)
        out = self.collator.mask(input_ids, sample_keys(self.stream_seed, positions), positions)
        return with_documents(out, input_ids, self.document_attention, self.sequences.sep_id)


def with_documents(out: dict, input_ids: np.ndarray, document_attention: bool, sep_id: int) -> dict:
    """`out` with the batch's documents as `cu_seqlens` and `max_seqlen` (a 0-d tensor: batches
    travel from the workers as one array) when attention stays within each document
    (`swbert.data.packing.document_seqlens`)."""
    if document_attention:
        cu_seqlens, max_seqlen = document_seqlens(input_ids, sep_id)
        out["cu_seqlens"], out["max_seqlen"] = cu_seqlens, torch.tensor(max_seqlen)
    return out


def check_layout(start_sample: int, micro_bs: int, dp_rank: int, dp_size: int) -> None:
    """A ValueError for a stream position or batch layout that cannot be."""
    if start_sample < 0:
        raise ValueError(f"the stream position must be non-negative, not {start_sample}")
    if micro_bs <= 0:
        raise ValueError(f"micro_bs must be positive, not {micro_bs}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), not {dp_rank}")


class MixedStream:
    """The global sample stream of a weighted mix of folders (`swbert.data.mix`).

    Position `p` draws from the folder `schedule` names at `p`, and takes the next sample of that
    folder's own `GlobalSampler` order (epochs per folder); it is masked by its global position,
    as in `MaskedStream`. A batch also says where each row came from: `source` (B,), the folder's
    index in the mix, and `sample` (B,), the sample's index in that folder's packed sequences.
    """

    def __init__(
        self,
        folders: list[PackedSequences],
        schedule: MixSchedule,
        collator: MaskingCollator,
        seed: int,
        *,
        stream_seed: int,
        document_attention: bool = False,
    ) -> None:
        if len(folders) != len(schedule.counts):
            raise ValueError(f"{len(folders)} folders but a schedule of {len(schedule.counts)}")
        self.folders, self.schedule, self.collator = folders, schedule, collator
        self.stream_seed = stream_seed
        self.document_attention = document_attention
        self.samplers = [
            GlobalSampler(len(f), seed=seed, micro_batch_size=1, dp_rank=0, dp_size=1) for f in folders
        ]
        self.seq_len = folders[0].seq_len
        self.max_predictions = collator.max_predictions(self.seq_len)  # checked here, before any batch

    def batch(self, position: int, count: int) -> dict[str, torch.Tensor]:
        """The `count` masked samples at stream positions `[position, position + count)`, with their
        `source` and `sample` (see the class docstring)."""
        positions = np.arange(position, position + count, dtype=np.int64)  # (B,)
        folder, draw = self.schedule.locate(positions)  # (B,), (B,)
        sample = np.empty(count, dtype=np.int64)
        input_ids = np.empty((count, self.seq_len), dtype=np.int64)  # (B, S)
        for k in np.unique(folder).tolist():
            rows = folder == k
            # a folder's draws among consecutive positions are consecutive draws of that folder
            sample[rows] = self.samplers[k].take(int(draw[rows][0]), int(rows.sum()))
            input_ids[rows] = self.folders[k].get_batch(sample[rows])
        out = self.collator.mask(input_ids, sample_keys(self.stream_seed, positions), positions)
        out = with_documents(out, input_ids, self.document_attention, self.folders[0].sep_id)
        out["source"] = torch.from_numpy(folder)
        out["sample"] = torch.from_numpy(sample)
        return out
