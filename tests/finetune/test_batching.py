"""Fine-tuning batches (swbert.finetune.batching): the unpadded collate, length-grouped batches and
what `--unpad` resolves to."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch.testing import assert_close
from torch.utils.data import DistributedSampler

from swbert import SWBertConfig, SWBertForSequenceClassification
from swbert.finetune.batching import (
    LengthGroupedBatchSampler,
    resolve_unpad,
    train_loader,
    unpad_collate,
)
from swbert.finetune.glue_data import EncodedDataset, pad_collate
from swbert.runtime.ranks import ParallelDims


def dataset(lengths: list[int], seed: int = 0) -> EncodedDataset:
    rng = np.random.default_rng(seed)
    ids = [[2, *rng.integers(5, 100, n - 1).tolist()] for n in lengths]
    types = [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths]
    masks = [[1] * n for n in lengths]
    labels = {"labels": np.arange(len(lengths)) % 3}
    return EncodedDataset({"input_ids": ids, "attention_mask": masks, "token_type_ids": types}, labels)


def test_unpad_collate_feeds_the_model_what_padding_does():
    data = dataset([3, 1, 7])
    items = [data[i] for i in range(3)]
    flat, padded = unpad_collate(0)(items), pad_collate(0)(items)
    assert flat["cu_seqlens"].tolist() == [0, 3, 4, 11] and flat["cu_seqlens"].dtype == torch.int32
    assert flat["max_seqlen"] == 7 and "attention_mask" not in flat
    assert torch.equal(flat["input_ids"], padded["input_ids"][padded["attention_mask"].bool()])
    assert torch.equal(flat["token_type_ids"], padded["token_type_ids"][padded["attention_mask"].bool()])
    assert torch.equal(flat["labels"], padded["labels"])
    torch.manual_seed(0)
    config = SWBertConfig.from_size("tiny", vocab_size=101, num_labels=3, attention_probs_dropout_prob=0.0)
    model = SWBertForSequenceClassification(config).eval()
    assert_close(model(**flat).logits, model(**padded).logits)


def test_unpad_collate_drops_a_fixed_length_windows_padding():
    item = {"input_ids": [2, 9, 3, 0, 0], "attention_mask": [1, 1, 1, 0, 0], "start_positions": 1}
    flat = unpad_collate(0)([item, item])
    assert flat["input_ids"].tolist() == [2, 9, 3, 2, 9, 3] and flat["max_seqlen"] == 3
    assert flat["start_positions"].tolist() == [1, 1]


def padding_fraction(batches: list[list[int]], lengths: list[int]) -> float:
    real = sum(lengths[i] for b in batches for i in b)
    computed = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return 1 - real / computed


def test_grouped_batches_cover_the_epoch_with_less_padding_deterministically():
    lengths = np.random.default_rng(0).integers(5, 120, 500).tolist()
    sampler = LengthGroupedBatchSampler(lengths, batch_size=16, seed=3)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 32
    assert sorted(i for b in batches for i in b) == list(range(500))
    assert batches == list(LengthGroupedBatchSampler(lengths, batch_size=16, seed=3))
    sampler.set_epoch(1)
    assert list(sampler) != batches  # reshuffled per epoch
    random_batches = [list(range(i, min(i + 16, 500))) for i in range(0, 500, 16)]
    assert padding_fraction(batches, lengths) < 0.5 * padding_fraction(random_batches, lengths)


def test_grouped_rank_shares_partition_the_global_batches():
    lengths = np.random.default_rng(1).integers(5, 60, 101).tolist()  # odd: padded like DistributedSampler
    ranks = [list(LengthGroupedBatchSampler(lengths, 4, seed=0, world=2, rank=r)) for r in range(2)]
    whole = LengthGroupedBatchSampler(lengths, 4, seed=0, world=2, rank=0).global_batches()
    assert len(ranks[0]) == len(ranks[1]) == len(whole)
    for r0, r1, batch in zip(ranks[0], ranks[1], whole):
        assert len(r0) == len(r1) and r0 + r1 == batch.tolist()
    assert set(i for b in ranks[0] + ranks[1] for i in b) == set(range(101))


def test_train_loader_groups_only_when_asked():
    data = dataset(np.random.default_rng(2).integers(2, 40, 64).tolist())
    one = ParallelDims()  # one process
    grouped = train_loader(data, pad_collate(0), 8, one, seed=0, workers=0, grouped=True)
    assert isinstance(grouped.batch_sampler, LengthGroupedBatchSampler) and len(grouped) == 8
    plain = train_loader(data, pad_collate(0), 8, one, seed=0, workers=0, grouped=False)
    assert isinstance(plain.sampler, DistributedSampler) and len(plain) == 8

    def padded_tokens(loader):
        return sum(b["input_ids"].numel() for b in loader)

    assert padded_tokens(grouped) < padded_tokens(plain)


def test_unpad_resolves_by_device_and_says_so_once(caplog):
    resolve_unpad.cache_clear()
    with caplog.at_level(logging.INFO, logger="swbert.finetune.batching"):
        assert resolve_unpad("auto", "cpu", 0.1) is False
        assert resolve_unpad("off", "cpu", 0.0) is False
        assert resolve_unpad("on", "cpu", 0.1) is True
        assert resolve_unpad("on", "cpu", 0.1) is True
    said = [r.getMessage() for r in caplog.records if "reference" in r.getMessage()]
    assert len(said) == 1 and "--unpad on" in said[0]
    with pytest.raises(ValueError, match="--unpad 'yes'"):
        resolve_unpad("yes", "cpu", 0.0)


def test_figure3_table_says_which_batches_it_timed():
    from swbert.finetune.figures import timing_table
    from swbert.finetune.report import Timing

    timings = [
        Timing("standard", "sst2", 16, 10.0, "unpadded"),
        Timing("shared", "sst2", 16, 8.0, "grouped"),
        Timing("shared", "rte", 16, 4.0),  # recorded before --unpad: padded
    ]
    assert "Batches timed: grouped, padded, unpadded" in timing_table(timings, "standard", 16).note


@pytest.mark.slow  # fine-tunes twice (about a minute)
def test_fit_and_span_prediction_run_unpadded():
    """The loop trains on unpadded batches, and span prediction widens batches of different
    lengths to one array whose real positions hold the padded path's logits."""
    from swbert import SWBertForQuestionAnswering
    from swbert.finetune.trainer import FinetuneConfig, fit, predict

    lengths = [3, 8, 5, 2, 6, 4]  # batches of 3: widest 8, then 6
    ids = [[2, *range(5, 4 + n)] + [0] * (8 - n) for n in lengths]
    masks = [[1] * n + [0] * (8 - n) for n in lengths]
    spans = {"start_positions": np.ones(6, dtype=np.int64), "end_positions": np.array(lengths) - 1}
    data = EncodedDataset({"input_ids": ids, "attention_mask": masks}, spans)
    torch.manual_seed(0)
    model = SWBertForQuestionAnswering(SWBertConfig.from_size("tiny", vocab_size=32))
    before = model.qa_outputs.weight.clone()
    cfg = FinetuneConfig(learning_rate=1e-3, epochs=1, batch_size=3)
    fit(model, data, unpad_collate(0), lambda m: {"v": 0.0}, "v", cfg)
    assert not torch.equal(model.qa_outputs.weight, before)
    spans = ("start_logits", "end_logits")
    start, end = predict(model.eval(), data, unpad_collate(0), batch_size=3, outputs=spans)
    ref_start, ref_end = predict(model, data, pad_collate(0), batch_size=3, outputs=spans)
    assert start.shape == ref_start.shape == (6, 8)
    real = np.array(masks, dtype=bool)
    assert_close(torch.from_numpy(start[real]), torch.from_numpy(ref_start[real]))
    assert_close(torch.from_numpy(end[real]), torch.from_numpy(ref_end[real]))
    assert (start[~real] == np.finfo(np.float32).min).all()


def test_compiled_sweeps_pad_to_length_buckets_and_refuse_unpadded_batches(tmp_path):
    """--compile on pads every batch up to a multiple of 64 tokens, at most --max-seq-length, and keeps
    the mask; auto compiles nothing on a CPU; on with unpadded batches is a one-line error."""
    from swbert.finetune.glue import GlueSweep

    items = [{"input_ids": [2] * n, "attention_mask": [1] * n, "labels": 0} for n in (3, 70)]
    compiled = GlueSweep(checkpoint=["c"], output_dir=tmp_path, compile="on", unpad="off", max_seq_length=100)
    assert compiled.compiled() and compiled.finetune_config().compile
    batch = compiled.collate(0)(items)
    assert batch["input_ids"].shape == (2, 100) and batch["attention_mask"].sum() == 73
    assert compiled.collate(0)(items[:1])["input_ids"].shape == (1, 64)
    assert not GlueSweep(
        checkpoint=["c"], output_dir=tmp_path, compile="auto", unpad="off"
    ).compiled()  # a CPU
    with pytest.raises(ValueError, match="--compile on compiles padded batches.*--unpad off"):
        GlueSweep(checkpoint=["c"], output_dir=tmp_path, compile="on", unpad="on").compiled()
