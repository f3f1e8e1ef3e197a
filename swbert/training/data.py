"""The trainer's view of the data: packed sequences, the global sample stream, masks by position.

Every sample has a position in one global stream (see `swbert.data.GlobalSampler`), and its
mask is a hash of (seed, position, token position) (see `swbert.data.masking`). So what a step
sees depends only on how many samples came before it: not on the number of ranks or loader
workers, and not on whether the run was interrupted and resumed.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, fields
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from swbert.data import MaskingCollator, PackedSequences, open_corpus
from swbert.data.folder import prepare_data
from swbert.data.integrity import CACHE_NAME, VerifyResult, verify_shards
from swbert.data.loader import BatchLoader, batch_loader, resolve_num_workers
from swbert.data.manifest import MANIFEST_NAME
from swbert.data.masking import MaskingRates
from swbert.data.mix import MixEntry, MixSchedule, check_mix_folders, window_counts
from swbert.data.steps import BatchSchedule
from swbert.data.stream import VALID_STREAM_OFFSET, MaskedStream, MixedStream, check_layout

__all__ = ["TrainingData", "prepare_data", "resolve_num_workers", "verify_data"]


def _all_gather(obj: object) -> list[object]:
    """Every rank's `obj` (the default group), or `[obj]` without a process group."""
    if not torch.distributed.is_initialized():
        return [obj]
    out: list[object] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def verify_data(data: TrainingData, run_dir: Path) -> VerifyResult:
    """Every shard the run reads (of every folder of a mix) checked against its manifest's sha256, each
    rank hashing its share (call after the process group starts, before the first batch). Verified
    files are remembered in each data folder (`.shard_hashes.json`; shared by every run on that data)
    or, when a folder is read-only, in the run folder, so a restart hashes only files changed since."""
    dist = torch.distributed
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    results = []
    for source in data.sources:
        cache_dir = source.data_dir if os.access(source.data_dir, os.W_OK) else run_dir
        cache = cache_dir / CACHE_NAME
        results.append(verify_shards(source.data_dir, source.manifest, cache, rank, world, _all_gather))
    if len(results) == 1:
        return results[0]
    return VerifyResult(*(sum(getattr(r, f.name) for r in results) for f in fields(VerifyResult)))


@dataclass
class Source:
    """One folder of the run's data: its weight in the mix (1 for a lone --data-dir) and its splits."""

    name: str
    data_dir: Path
    weight: Fraction
    manifest: dict[str, Any]
    train: PackedSequences
    valid: PackedSequences | None


def _open_source(entry: MixEntry, seq_len: int, tokenizer: str | None) -> Source:
    """A folder's train split and, when it holds at least one sequence, its validation split."""
    corpus = open_corpus(entry.path, "train", tokenizer)
    valid = None
    if any(shard["valid"]["documents"] > 0 for shard in corpus.manifest["shards"]):
        try:
            valid = PackedSequences(open_corpus(entry.path, "valid", corpus.tokenizer_hash), seq_len)
        except ValueError as err:
            if "less than one sequence" not in str(err):
                raise
    train = PackedSequences(corpus, seq_len)
    return Source(entry.name, Path(entry.path), entry.weight, corpus.manifest, train, valid)


class TrainingData:
    """Train and validation sequences of one data folder, or of a weighted mix of folders, served
    by global stream position.

    `batch()` builds one micro-batch on the calling thread; `loader()` streams consecutive ones
    from DataLoader workers. Both return the same dicts of CPU tensors (see
    `swbert.data.MaskingCollator`): `input_ids`, `labels` (B, S), `mlm_positions`, `mlm_labels`
    (B, P) with P = `max_predictions_per_seq`, and `attention_mask` only when a batch holds padding
    (packed sequences never do); a mix adds `source` and `sample` (B,) (`MixedStream`), and
    `document_attention` adds the documents as `cu_seqlens` and `max_seqlen`. Validation
    reads each folder's own split, in order (`batch(..., valid=k)`).
    """

    def __init__(
        self,
        data: str | Path | list[MixEntry],
        seq_len: int,
        mlm_probability: float,
        seed: int,
        max_predictions_per_seq: int | None = None,
        document_attention: bool = False,
    ) -> None:
        self.mixed = isinstance(data, list)
        entries = data if isinstance(data, list) else [MixEntry(Path(data), Fraction(1))]
        if self.mixed:
            check_mix_folders(entries)  # the tokenizers agree, naming both folders when not
        self.sources = [_open_source(entries[0], seq_len, None)]
        self.tokenizer_hash = self.sources[0].train.corpus.tokenizer_hash
        self.sources += [_open_source(e, seq_len, self.tokenizer_hash) for e in entries[1:]]
        first = self.sources[0]
        self.data_dir, self.manifest, self.train, self.valid = (
            first.data_dir,
            first.manifest,
            first.train,
            first.valid,
        )
        self.vocab_size = first.train.corpus.vocab_size
        self.tokenizer_dir = first.train.corpus.tokenizer_dir
        self.special_ids = first.train.corpus.special_ids  # the tokenizer's, from the manifest
        self.collator = MaskingCollator(
            self.vocab_size,
            mlm_probability=mlm_probability,
            max_predictions_per_seq=max_predictions_per_seq,
            mask_token_id=self.special_ids.mask,
            pad_token_id=self.special_ids.pad,
            special_ids=self.special_ids.ids,
        )
        self.max_predictions_per_seq = self.collator.max_predictions(seq_len)  # P, resolved and checked
        self.seed = seed
        self.schedule = MixSchedule(window_counts([s.weight for s in self.sources]))
        self._train, self._valid = self._streams(seed, document_attention)

    def schedule_masking(self, mlm_probability_final: float, total_steps: int, steps: BatchSchedule) -> None:
        """The masking-rate schedule (ours): a training sample is masked at the rate of the optimizer
        step that draws it (`steps`), linear from mlm_probability to `mlm_probability_final` over
        `total_steps`; P is sized for the larger rate. Validation masks at the final rate with the
        same P. Call before the first batch (again with a resumed run's anchored `steps`)."""
        seq_len = self.train.seq_len
        start = self.collator.mlm_probability
        self.collator.rates = MaskingRates(start, mlm_probability_final, total_steps, steps)
        self.max_predictions_per_seq = self.collator.max_predictions(seq_len)
        valid = self.collator.at_fixed_rate(mlm_probability_final, seq_len)
        for stream in self._valid.values():
            stream.collator = valid

    def _streams(
        self, seed: int, document_attention: bool
    ) -> tuple[MaskedStream | MixedStream, dict[int, MaskedStream]]:
        """The training stream (one folder's, or the mix's) and each folder's validation stream in
        order, masked by another stream than training's."""
        streams = dict(collator=self.collator, seed=seed, document_attention=document_attention)
        train: MaskedStream | MixedStream = MaskedStream(
            self.train, shuffle=True, stream_seed=seed, **streams
        )
        if self.mixed:
            train = MixedStream([s.train for s in self.sources], self.schedule, stream_seed=seed, **streams)
        valid = {
            k: MaskedStream(s.valid, shuffle=False, stream_seed=seed + VALID_STREAM_OFFSET, **streams)
            for k, s in enumerate(self.sources)
            if s.valid is not None
        }
        return train, valid

    @property
    def has_valid(self) -> bool:
        return bool(self._valid)

    @property
    def names(self) -> list[str]:
        """Each folder's name, in mix order."""
        return [s.name for s in self.sources]

    def valid_sources(self) -> list[int]:
        """The folders (indices in the mix) whose validation split holds a sequence."""
        return sorted(self._valid)

    def _stream(self, valid: int | None) -> MaskedStream | MixedStream:
        if valid is None:
            return self._train
        if valid not in self._valid:
            folder = self.sources[valid].data_dir
            raise ValueError(f"{folder} has no validation split large enough for one sequence")
        return self._valid[valid]

    def batch(
        self,
        samples_before: int,
        micro_bs: int,
        dp_rank: int,
        dp_size: int,
        valid: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """This rank's micro-batch of the global batch that starts at stream position `samples_before`
        (of the training stream, or with `valid=k` of folder k's validation split)."""
        check_layout(samples_before, micro_bs, dp_rank, dp_size)
        return self._stream(valid).batch(samples_before + dp_rank * micro_bs, micro_bs)

    def loader(
        self,
        start_sample: int,
        micro_bs: int,
        dp_rank: int,
        dp_size: int,
        num_workers: int,
        valid: int | None = None,
        **options: Any,
    ) -> BatchLoader:
        """This rank's micro-batches for consecutive micro-steps from stream position `start_sample`:
        micro-batch j is `batch(start_sample + j * micro_bs * dp_size, micro_bs, dp_rank, dp_size)`,
        built by `num_workers` DataLoader processes (0: on the calling thread) and prefetched.
        `options` are `swbert.data.loader.batch_loader`'s (`pin_memory` on CUDA, `prefetch_factor`,
        `multiprocessing_context`)."""
        stream = self._stream(valid)
        return batch_loader(stream, start_sample, micro_bs, dp_rank, dp_size, num_workers, **options)

    def sampler_state(self, samples_consumed: int) -> dict[str, Any]:
        """The data position after `samples_consumed` samples (a checkpoint records it; resume needs only
        the count, since every position is a function of it). A mix says, for each folder, the samples it
        gave, the epoch it is in and the epochs it went through (a fraction)."""
        if not self.mixed:
            epoch, consumed = divmod(samples_consumed, len(self.train))
            return {"epoch": epoch, "consumed": consumed, "seed": self.seed, "num_samples": len(self.train)}
        drawn = self.schedule.drawn(samples_consumed).tolist()
        return {
            "position": samples_consumed,
            "seed": self.seed,
            "window": self.schedule.window,
            "folders": {
                s.name: {"drawn": d, "epoch": d // len(s.train), "epochs": d / len(s.train)}
                for s, d in zip(self.sources, drawn)
            },
        }

    def mix_record(self, total_samples: int) -> dict[str, Any]:
        """What a run records of its mix (checkpoint, MLflow, resolved config): the window, and for each
        folder its path, weight, samples per window, manifest sha256, and the epochs of it that a run of
        `total_samples` samples goes through."""
        drawn = self.schedule.drawn(total_samples).tolist()
        return {
            "window": self.schedule.window,
            "folders": {
                s.name: {
                    "path": str(s.data_dir),
                    "weight": str(s.weight),
                    "per_window": int(c),
                    "manifest_sha256": manifest_sha256(s.data_dir),
                    "epochs_planned": round(d / len(s.train), 6),
                }
                for s, c, d in zip(self.sources, self.schedule.counts, drawn)
            },
        }

    def fingerprint(self) -> str:
        """The data exact resume depends on, as a checkpoint records it: a lone folder's manifest hash
        (16 hex digits, as before mixes); for a mix, each folder's samples per window and manifest hash."""
        if not self.mixed:
            return manifest_sha256(self.data_dir)[:16]
        return " ".join(
            f"{s.name}={c}/{self.schedule.window}@{manifest_sha256(s.data_dir)[:16]}"
            for s, c in zip(self.sources, self.schedule.counts.tolist())
        )


def manifest_sha256(data_dir: Path) -> str:
    """sha256 of a folder's manifest.json (it lists every shard's own sha256)."""
    return hashlib.sha256((data_dir / MANIFEST_NAME).read_bytes()).hexdigest()
