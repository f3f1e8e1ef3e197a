"""Training-side data: packing, the rank-independent sampler, masking by position, the batch loader."""

from __future__ import annotations

import itertools
import json
import logging
import os
import pickle
import signal
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pytest
import torch

from data_prep.preprocess import preprocess
from data_prep.train_tokenizer import train_tokenizer
from swbert.data import (
    CLS_ID,
    MASK_ID,
    PAD_ID,
    SEP_ID,
    SPECIAL_IDS,
    GlobalSampler,
    MaskingCollator,
    PackedSequences,
    open_corpus,
)
from swbert.data.loader import PackedBatch
from swbert.training.config import TrainConfig
from swbert.training.data import TrainingData, resolve_num_workers
from tests.masking_reference import stream_batch

SEQ, SEED = 64, 11


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loading")
    corpus = root / "topics.jsonl"
    with open(corpus, "w", encoding="utf-8") as stream:
        for name in sorted(topics)[:25]:
            stream.write(json.dumps({"text": topics[name]}) + "\n")
    train_tokenizer([str(corpus)], root / "tok", vocab_size=600, threads=1)
    # A quarter held out, so the validation stream has sequences too.
    preprocess(
        [str(corpus)],
        root / "tok",
        root / "shards",
        workers=1,
        shard_bytes=40 << 10,
        valid_fraction=0.25,
        progress=False,
    )
    return root / "shards"


def test_packed_sequences_are_the_document_stream_cut_in_pieces(data_dir: Path) -> None:
    corpus = open_corpus(data_dir)
    assert len(corpus.prefixes) >= 2  # documents come from several shards
    stream: list[int] = []
    for doc in range(len(corpus)):
        stream += corpus.document(doc).tolist() + [SEP_ID]
    stream.pop()  # separators go between documents only
    seq_len = 64
    packed = PackedSequences(corpus, seq_len)
    assert len(packed) == len(stream) // (seq_len - 2)
    for i in [0, 1, len(packed) // 2, len(packed) - 1]:
        sample = packed[i]
        assert sample.dtype == torch.long and sample.shape == (seq_len,)
        assert sample[0] == CLS_ID and sample[-1] == SEP_ID
        assert sample[1:-1].tolist() == stream[i * (seq_len - 2) : (i + 1) * (seq_len - 2)]
    every = torch.stack([packed[i] for i in range(len(packed))])
    assert not (every == PAD_ID).any() and (every[:, 1:-1] == SEP_ID).sum() >= len(corpus) - 2
    assert torch.equal(pickle.loads(pickle.dumps(packed))[3], packed[3])  # DataLoader workers reopen shards
    with pytest.raises(IndexError):
        packed[len(packed)]
    with pytest.raises(ValueError, match="shorter seq_len"):
        PackedSequences(corpus, corpus.num_tokens + len(corpus) + 5)


def _stream(data_dir: Path, split: str) -> list[int]:
    corpus = open_corpus(data_dir, split)
    stream: list[int] = []
    for doc in range(len(corpus)):
        stream += corpus.document(doc).tolist() + [SEP_ID]
    return stream[:-1]


def test_get_batch_reads_any_samples_at_once(data_dir: Path) -> None:
    packed, stream = PackedSequences(open_corpus(data_dir), SEQ), _stream(data_dir, "train")
    n = len(packed)
    indices = [n - 1, 0, 5, 5, n // 2]
    batch = packed.get_batch(indices)
    assert batch.shape == (5, SEQ) and batch.dtype == np.int64
    for row, i in zip(batch.tolist(), indices, strict=True):
        assert row == [CLS_ID] + stream[i * (SEQ - 2) : (i + 1) * (SEQ - 2)] + [SEP_ID]
    with pytest.raises(IndexError, match=rf"sample {n} out of range \[0, {n}\)"):
        packed.get_batch([3, n])


def _batches(sampler: GlobalSampler, count: int) -> list[list[int]]:
    return list(itertools.islice(iter(sampler), count))


def test_sampler_order_does_not_depend_on_the_number_of_ranks() -> None:
    n, steps = 37, 40  # 37 is prime: global batches straddle epoch boundaries
    single = _batches(GlobalSampler(n, seed=3, micro_batch_size=4, dp_rank=0, dp_size=1), steps)
    ranks = [
        _batches(GlobalSampler(n, seed=3, micro_batch_size=2, dp_rank=r, dp_size=2), steps) for r in range(2)
    ]
    assert all(single[t] == ranks[0][t] + ranks[1][t] for t in range(steps))
    stream = list(itertools.chain.from_iterable(single))
    for epoch in range(3):
        assert sorted(stream[epoch * n : (epoch + 1) * n]) == list(range(n))  # each epoch: every sample once
    assert stream[:n] != stream[n : 2 * n]  # reshuffled per epoch
    other_seed = _batches(GlobalSampler(n, seed=4, micro_batch_size=4, dp_rank=0, dp_size=1), steps)
    assert other_seed != single
    ordered = _batches(GlobalSampler(n, seed=3, micro_batch_size=4, dp_rank=0, dp_size=1, shuffle=False), 2)
    assert ordered == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("k", [1, 9, 10])
def test_sampler_resumes_exactly_even_with_another_dp_size(k: int) -> None:
    n = 37
    ranks = [GlobalSampler(n, seed=5, micro_batch_size=2, dp_rank=r, dp_size=2) for r in range(2)]
    iterators = [iter(s) for s in ranks]
    for _ in range(k):
        for it in iterators:
            next(it)
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict() and state["epoch"] * n + state["consumed"] == k * 4
    expected = [next(iterators[0]) + next(iterators[1]) for _ in range(12)]
    # Same dp size: each rank continues exactly.
    again = GlobalSampler(n, seed=5, micro_batch_size=2, dp_rank=1, dp_size=2)
    again.load_state_dict(state)
    assert _batches(again, 12) == [batch[2:] for batch in expected]
    # One rank with the whole global batch: sees the union of what the two ranks would have seen.
    single = GlobalSampler(n, seed=5, micro_batch_size=4, dp_rank=0, dp_size=1)
    single.load_state_dict(state)
    assert _batches(single, 12) == expected


def test_sampler_state_rewinds_over_prefetched_batches() -> None:
    sampler = GlobalSampler(10, seed=0, micro_batch_size=3, dp_rank=0, dp_size=1)
    batches = _batches(sampler, 5)
    resumed = GlobalSampler(10, seed=0, micro_batch_size=3, dp_rank=0, dp_size=1)
    resumed.load_state_dict(sampler.state_dict(in_flight=2))  # trained on 3, 2 were prefetched
    assert _batches(resumed, 2) == batches[3:]
    with pytest.raises(ValueError, match="seed"):
        GlobalSampler(10, seed=1, micro_batch_size=3, dp_rank=0, dp_size=1).load_state_dict(
            sampler.state_dict()
        )


def _big_batch(vocab: int = 1000, rows: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(len(SPECIAL_IDS), vocab, (rows, 512), generator=gen)
    batch[:, 0], batch[:, -1], batch[:, 200] = CLS_ID, SEP_ID, SEP_ID
    batch[-4:, 400:] = PAD_ID  # a padded tail
    return batch


def test_masking_statistics() -> None:
    vocab, batch = 1000, _big_batch(rows=256)
    out = MaskingCollator(vocab)(batch, generator=torch.Generator().manual_seed(1))
    special = torch.isin(batch, torch.tensor(SPECIAL_IDS))
    selected = out["labels"] != -100
    assert not (selected & special).any() and torch.equal(out["input_ids"][special], batch[special])
    assert torch.equal(out["labels"][selected], batch[selected])
    # a fixed count per row: round(n x 0.15) of its n maskable tokens (509 or 397 here), P = 77
    n = (~special).sum(1)
    assert torch.equal(selected.sum(1), torch.round(n * 0.15).long()) and out["mlm_positions"].shape == (
        256,
        77,
    )
    masked = (out["input_ids"] == MASK_ID) & selected
    replaced = (out["input_ids"] != batch) & selected & ~masked
    kept = (out["input_ids"] == batch) & selected
    total = selected.sum()  # 19.5k predictions: standard deviations 0.003 and 0.002
    assert abs(masked.sum() / total - 0.8) < 0.012
    assert abs(replaced.sum() / total - 0.1) < 0.01 and abs(kept.sum() / total - 0.1) < 0.01
    assert not torch.isin(out["input_ids"][replaced], torch.tensor(SPECIAL_IDS)).any()
    assert torch.equal(out["attention_mask"], (batch != PAD_ID).long())  # padding: the mask is there
    assert torch.equal(out["attention_mask"][-1, 400:], torch.zeros(112, dtype=torch.long))
    packed = MaskingCollator(vocab)(batch[:-4], generator=torch.Generator().manual_seed(1))
    assert "attention_mask" not in packed  # no padding: no mask, so SDPA may pick flash attention


def test_masking_is_reproducible_and_configurable() -> None:
    batch = _big_batch()
    collate = MaskingCollator(1000)
    first = collate(list(batch), generator=torch.Generator().manual_seed(7))
    again = collate(batch, generator=torch.Generator().manual_seed(7))
    other = collate(batch, generator=torch.Generator().manual_seed(8))
    assert first.keys() == again.keys() and all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first["labels"], other["labels"])
    assert torch.equal(batch, _big_batch())  # the input is not modified in place
    heavy = MaskingCollator(1000, mlm_probability=0.4)(batch, generator=torch.Generator().manual_seed(7))
    special = torch.isin(batch, torch.tensor(SPECIAL_IDS))
    assert abs((heavy["labels"] != -100).sum() / (~special).sum() - 0.4) < 0.01
    with pytest.raises(ValueError):
        MaskingCollator(1000, mlm_probability=1.5)


def test_constants_match_the_tokenizer_contract() -> None:
    assert (PAD_ID, CLS_ID, SEP_ID, MASK_ID) == (0, 2, 3, 4) and SPECIAL_IDS == (0, 1, 2, 3, 4)
    assert np.iinfo(np.uint16).max > 8000  # default vocabularies fit the uint16 shards


# ---- the trainer's batches: TrainingData.batch ----------------------------------------------------


@pytest.fixture(scope="module")
def training_data(data_dir: Path) -> TrainingData:
    return TrainingData(data_dir, SEQ, 0.15, SEED)


def test_batches_equal_the_per_sample_reference(data_dir: Path, training_data: TrainingData) -> None:
    """Reading, order and masks: `batch()` against tests/masking_reference.py, sample by sample."""
    n = len(training_data.train)  # 467 sequences of 64
    vocab = training_data.vocab_size
    for split, stream_seed, shuffle, starts in [
        ("train", SEED, True, [0, n - 3, 3 * n + 5]),  # the second straddles an epoch boundary
        ("valid", SEED + 1_000_003, False, [0, len(training_data.valid) - 2]),
    ]:
        stream = _stream(data_dir, split)
        for start in starts:
            got = training_data.batch(
                start, 3, 1, 2, valid=0 if split == "valid" else None
            )  # rank 1: start + 3
            want = stream_batch(stream, SEQ, SEED, shuffle, start + 3, 3, vocab, stream_seed)
            assert set(got) == {"input_ids", "labels", "mlm_positions", "mlm_labels"}  # packed: no mask
            for name, rows in want.items():
                assert got[name].dtype == torch.int64 and got[name].tolist() == rows, (split, start, name)
    assert training_data.max_predictions_per_seq == 10 and got["mlm_positions"].shape == (3, 10)


def _global(data: TrainingData, position: int, global_bs: int, dp_size: int) -> dict[str, torch.Tensor]:
    parts = [data.batch(position, global_bs // dp_size, r, dp_size) for r in range(dp_size)]
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}


def test_masks_do_not_depend_on_the_number_of_ranks(training_data: TrainingData) -> None:
    n = len(training_data.train)
    for position in [0, 8 * (n // 8), 5 * n - 4]:  # the last two straddle epoch boundaries
        one = _global(training_data, position, 8, 1)
        for dp_size in (2, 4):
            many = _global(training_data, position, 8, dp_size)
            assert all(torch.equal(one[name], many[name]) for name in one), (position, dp_size)
    # A fresh process' view (a resumed run) builds the same batch at the same position.
    again = TrainingData(training_data.data_dir, SEQ, 0.15, SEED).batch(5 * n - 4, 8, 0, 1)
    assert all(torch.equal(again[name], one[name]) for name in one)
    other_seed = TrainingData(training_data.data_dir, SEQ, 0.15, SEED + 1)
    assert not torch.equal(other_seed.batch(0, 8, 0, 1)["labels"], one["labels"])


def test_batch_layout_and_prediction_count_errors(training_data: TrainingData) -> None:
    with pytest.raises(ValueError, match=r"dp_rank must be in \[0, dp_size=2\), not 2"):
        training_data.batch(0, 4, 2, 2)
    with pytest.raises(ValueError, match="micro_bs must be positive"):
        training_data.batch(0, 0, 0, 1)
    with pytest.raises(ValueError, match=r"max_predictions_per_seq=9 .*Set max_predictions_per_seq to 10"):
        TrainingData(training_data.data_dir, SEQ, 0.15, SEED, max_predictions_per_seq=9)
    wide = TrainingData(training_data.data_dir, SEQ, 0.15, SEED, max_predictions_per_seq=16)
    batch = wide.batch(0, 4, 0, 1)
    assert batch["mlm_positions"].shape == (4, 16) and (batch["mlm_labels"][:, 9:] == -100).all()
    assert torch.equal(batch["labels"], training_data.batch(0, 4, 0, 1)["labels"])  # P pads, k stays
    TrainConfig(max_predictions_per_seq=20).check()
    with pytest.raises(ValueError, match=r"max_predictions_per_seq=12 .*Set max_predictions_per_seq to 19"):
        TrainConfig(seq_len=128, max_predictions_per_seq=12).check()


# ---- TrainingData.loader: the same batches from DataLoader workers ----------------------------------


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_loader_yields_the_consecutive_batches_from_any_start(
    training_data: TrainingData, workers: int
) -> None:
    n = len(training_data.train)
    start = 8 * (n // 8) - 16  # a resume two micro-steps before the end of epoch 0
    loader = training_data.loader(start, 4, 1, 2, num_workers=workers, prefetch_factor=2)
    try:
        for j in range(7):  # micro-step 2 straddles the boundary
            assert loader.next_sample == start + j * 8
            want = training_data.batch(start + j * 8, 4, 1, 2)
            got = next(loader)
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), (workers, j)
            assert all(got[k].dtype == torch.int64 for k in got)
    finally:
        loader.close()
    valid = training_data.loader(0, 4, 0, 1, num_workers=workers, valid=0)
    first = next(valid)
    valid.close()
    assert all(torch.equal(first[k], training_data.batch(0, 4, 0, 1, valid=0)[k]) for k in first)


@pytest.mark.slow  # a spawned worker imports torch and swbert: seconds
def test_loader_workers_start_by_spawn_too(training_data: TrainingData) -> None:
    """A spawned worker gets the data pickled (no mapped shard, no permutation) and maps the shards
    itself; what it builds is what the calling thread builds."""
    loader = training_data.loader(24, 4, 0, 1, num_workers=1, multiprocessing_context="spawn")
    try:
        for j in range(2):
            want = training_data.batch(24 + 4 * j, 4, 0, 1)
            assert all(torch.equal(v, want[k]) for k, v in next(loader).items())
    finally:
        loader.close()


def test_a_stop_signal_at_a_workers_start_does_not_kill_it(training_data: TrainingData) -> None:
    """torchrun and SLURM signal a rank's whole process group; a SIGTERM that reaches a worker the
    moment it is forked (before any init code of its own runs) is ignored, the worker builds its
    batches, and the starting thread's signal mask is left as it was."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    loader = training_data.loader(8, 4, 0, 1, num_workers=2)
    try:
        workers = loader._iterator._workers
        for worker in workers:
            os.kill(worker.pid, signal.SIGTERM)
            os.kill(worker.pid, signal.SIGUSR1)
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
        for j in range(4):
            want = training_data.batch(8 + 4 * j, 4, 0, 1)
            assert all(torch.equal(v, want[k]) for k, v in next(loader).items()), j
        assert all(w.is_alive() for w in workers)
    finally:
        loader.close()


def test_worker_count_errors(training_data: TrainingData, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="swbert.data.loader"):
        assert resolve_num_workers(5, cpus=2) == 2
    assert "num_workers=5 is more than the 2 CPUs available: using 2" in caplog.text
    assert resolve_num_workers(2, cpus=2) == 2 and resolve_num_workers(0) == 0
    with pytest.raises(ValueError, match="num_workers=-1"):
        resolve_num_workers(-1)
    with pytest.raises(ValueError, match="micro_bs must be positive"):
        training_data.loader(0, 0, 0, 1, num_workers=0)
    TrainConfig(num_workers=0).check()
    with pytest.raises(ValueError, match="num_workers=-1"):
        TrainConfig(num_workers=-1).check()


def test_a_packed_batch_comes_back_equal_pinned_or_not(training_data: TrainingData, monkeypatch) -> None:
    """The worker-to-main trip (int32 array through the pipe) and the pin-memory thread's path,
    with pinning itself, which needs a GPU, replaced by a copy."""
    batch = training_data.batch(8, 4, 0, 1)
    packed = PackedBatch.pack(batch)
    assert packed.flat.dtype == np.int32
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())
    for back in (pickle.loads(pickle.dumps(packed)).unpack(), packed.pin_memory().unpack()):
        assert back.keys() == batch.keys()
        assert all(back[k].dtype == torch.int64 and torch.equal(back[k], batch[k]) for k in batch)


def test_starting_a_loader_leaves_the_global_rng_alone(training_data: TrainingData) -> None:
    """Dropout draws from the global RNG, which a resume restores; a loader started at the resumed
    step must not draw from it, or every later mask would differ from the uninterrupted run's."""
    torch.manual_seed(3)
    before = torch.get_rng_state()
    loader = training_data.loader(0, 4, 0, 1, num_workers=1)
    try:
        next(loader)
    finally:
        loader.close()
    assert torch.equal(torch.get_rng_state(), before)
