"""The trainer's view of the data: packed sequences, the global sample stream, masks by position.

Every sample has a position in one global stream (see `swbert.data.GlobalSampler`), and its
mask is a hash of (seed, position, token position) (see `swbert.data.masking`). So what a step
sees depends only on how many samples came before it: not on the number of ranks or loader
workers, and not on whether the run was interrupted and resumed.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from swbert.data import MaskingCollator, PackedSequences, open_corpus
from swbert.data.folder import prepare_data
from swbert.data.integrity import CACHE_NAME, VerifyResult, verify_shards
from swbert.data.loader import BatchLoader, batch_loader, resolve_num_workers
from swbert.data.stream import VALID_STREAM_OFFSET, MaskedStream, check_layout

__all__ = ["TrainingData", "prepare_data", "resolve_num_workers", "verify_data"]


def _all_gather(obj: object) -> list[object]:
    """Every rank's `obj` (the default group), or `[obj]` without a process group."""
    if not torch.distributed.is_initialized():
        return [obj]
    out: list[object] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def verify_data(data: TrainingData, run_dir: Path) -> VerifyResult:
    """Every shard the run reads checked against the manifest's sha256, each rank hashing its share
    (call after the process group starts, before the first batch). Verified files are remembered in
    the data folder (`.shard_hashes.json`; shared by every run on that data) or, when the folder is
    read-only, in the run folder, so a restart hashes only files changed since."""
    cache_dir = data.data_dir if os.access(data.data_dir, os.W_OK) else run_dir
    dist = torch.distributed
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return verify_shards(data.data_dir, data.manifest, cache_dir / CACHE_NAME, rank, world, _all_gather)


class TrainingData:
    """Train and validation sequences of one data folder, served by global stream position.

    `batch()` builds one micro-batch on the calling thread; `loader()` streams consecutive ones
    from DataLoader workers. Both return the same dicts of CPU tensors (see
    `swbert.data.MaskingCollator`): `input_ids`, `labels` (B, S), `mlm_positions`, `mlm_labels`
    (B, P) with P = `max_predictions_per_seq`, and `attention_mask` only when a batch holds padding
    (packed sequences never do).
    """

    def __init__(
        self,
        data_dir: Path,
        seq_len: int,
        mlm_probability: float,
        seed: int,
        max_predictions_per_seq: int | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        corpus = open_corpus(data_dir, "train")
        self.manifest = corpus.manifest
        self.train = PackedSequences(corpus, seq_len)
        self.vocab_size = corpus.vocab_size
        self.tokenizer_hash = corpus.tokenizer_hash
        self.tokenizer_dir = corpus.tokenizer_dir
        self.valid = None
        if any(shard["valid"]["documents"] > 0 for shard in corpus.manifest["shards"]):
            try:
                self.valid = PackedSequences(open_corpus(data_dir, "valid", corpus.tokenizer_hash), seq_len)
            except ValueError as err:
                if "less than one sequence" not in str(err):
                    raise
        self.collator = MaskingCollator(
            self.vocab_size, mlm_probability=mlm_probability, max_predictions_per_seq=max_predictions_per_seq
        )
        self.max_predictions_per_seq = self.collator.max_predictions(seq_len)  # P, resolved and checked
        self.seed = seed
        self._streams = {
            False: MaskedStream(self.train, self.collator, seed, shuffle=True, stream_seed=seed),
        }
        if self.valid is not None:  # in order, and masked by another stream than training's
            self._streams[True] = MaskedStream(
                self.valid, self.collator, seed, shuffle=False, stream_seed=seed + VALID_STREAM_OFFSET
            )

    @property
    def has_valid(self) -> bool:
        return self.valid is not None

    def _stream(self, eval_split: bool) -> MaskedStream:
        if eval_split and self.valid is None:
            raise ValueError(f"{self.data_dir} has no validation split large enough for one sequence")
        return self._streams[eval_split]

    def batch(
        self, samples_before: int, micro_bs: int, dp_rank: int, dp_size: int, eval_split: bool = False
    ) -> dict[str, torch.Tensor]:
        """This rank's micro-batch of the global batch that starts at stream position `samples_before`."""
        check_layout(samples_before, micro_bs, dp_rank, dp_size)
        return self._stream(eval_split).batch(samples_before + dp_rank * micro_bs, micro_bs)

    def loader(
        self,
        start_sample: int,
        micro_bs: int,
        dp_rank: int,
        dp_size: int,
        num_workers: int,
        pin_memory: bool = False,
        prefetch_factor: int = 4,
        eval_split: bool = False,
        multiprocessing_context: str | None = None,
    ) -> BatchLoader:
        """This rank's micro-batches for consecutive micro-steps from stream position `start_sample`:
        micro-batch j is `batch(start_sample + j * micro_bs * dp_size, micro_bs, dp_rank, dp_size)`,
        built by `num_workers` DataLoader processes (0: on the calling thread) and prefetched;
        `pin_memory` on CUDA. See `swbert.data.loader.batch_loader`."""
        return batch_loader(
            self._stream(eval_split),
            start_sample,
            micro_bs,
            dp_rank,
            dp_size,
            num_workers,
            pin_memory=pin_memory,
            prefetch_factor=prefetch_factor,
            multiprocessing_context=multiprocessing_context,
        )

    def sampler_state(self, samples_consumed: int) -> dict:
        epoch, consumed = divmod(samples_consumed, len(self.train))
        return {"epoch": epoch, "consumed": consumed, "seed": self.seed, "num_samples": len(self.train)}
