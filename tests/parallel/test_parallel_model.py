"""`parallelize` preserves the function: TP=2 loss, logits and (gathered) gradients equal TP=1's,
for every attention variant, with and without sequence parallelism; state dicts shard and merge
exactly; bad sizes give clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from swbert.models import SWBertForMaskedLM
from swbert.parallel import (
    check_divisible,
    destroy,
    gather_state_dict,
    gather_tensors,
    initialize,
    merge_state_dicts,
    parallelize,
    shard_state_dict,
)
from swbert.parallel.layers import ColumnLinear, RowLinear, TensorParallelMaskedLM, VocabEmbedding
from tests.model_helpers import PAPER_VARIANTS
from tests.parallel.test_parallel_harness import mlm_batch, reference_model, run_ranks, tiny_config


def _check_variant(attention_type: str, sequence_parallel: bool, **overrides: object) -> None:
    config = tiny_config(attention_type, **overrides)
    ref = reference_model(config)
    model = SWBertForMaskedLM(config)
    model.load_state_dict(ref.state_dict())
    d = initialize(2)
    parallelize(model, 2, sequence_parallel=sequence_parallel)
    attn = model.bert.encoder.layers[0].attn
    assert isinstance(attn.out_proj, RowLinear)
    assert isinstance(model.bert.embeddings.word_embeddings, VocabEmbedding)
    assert model.mlm_head.decoder.weight is model.bert.embeddings.word_embeddings.weight  # still tied
    rows = config.padded_vocab_size // 2
    assert model.bert.embeddings.word_embeddings.weight.shape == (rows, config.hidden_size)
    if attention_type == "shared":
        assert isinstance(attn.proj, ColumnLinear) and attn.dq.shape == (config.hidden_size // 2,)
        assert (attn.proj.bias is not None) == config.shared_bias
    if type(attn).packed:  # one fused projection, this rank's heads of each part
        parts = len(type(attn).packed["in_proj"])
        assert isinstance(attn.in_proj, ColumnLinear)
        assert attn.in_proj.weight.shape == (parts * config.hidden_size // 2, config.hidden_size)
    if attention_type == "pairwise":
        assert attn.pair.shape == (config.num_attention_heads // 2, config.head_dim, config.head_dim)

    # plain TP computes the last layer on the labelled rows only; the sequence-split region cannot
    assert model.last_layer_on_labels is not sequence_parallel and ref.last_layer_on_labels
    batch = mlm_batch(seed=1, vocab=config.vocab_size)
    expected, got = ref(**batch), model(**batch)
    expected.loss.backward()
    got.loss.backward()
    assert_close(got.loss, expected.loss)
    assert_close(got.logits, expected.logits)  # gathered to the full vocabulary
    assert_close(model(input_ids=batch["input_ids"]).logits, ref(input_ids=batch["input_ids"]).logits)

    grads = gather_tensors({n: p.grad for n, p in model.named_parameters()}, config)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")

    # a batch with no labelled position: a zero loss that still backpropagates, as at TP=1
    unlabelled = dict(batch, labels=torch.full_like(batch["labels"], -100))
    got, expected = model(**unlabelled), ref(**unlabelled)
    got.loss.backward()
    assert got.loss.item() == 0.0 == expected.loss.item() and got.logits.shape == expected.logits.shape

    # the state dict gathers back to TP=1 exactly, and TP=1 shards back to this rank's
    full = gather_state_dict(model)
    for name, t in ref.state_dict().items():
        assert torch.equal(full[name], t), name
    mine = shard_state_dict(full, d.tp_rank, 2, config)
    local = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert mine.keys() == local.keys()
    assert all(torch.equal(mine[k], local[k]) for k in mine)
    destroy()


def _all_variants() -> None:
    for attention_type in PAPER_VARIANTS:
        for sequence_parallel in (False, True):
            _check_variant(attention_type, sequence_parallel)
    _check_variant("shared", False, shared_bias=False)  # the paper's form, no bs
    # a padded vocabulary: 100 ids in 128 rows, the padding in rank 1's shard; then 60 ids, rank 1's
    # shard all padding (its logits all -inf in the vocab-parallel loss)
    _check_variant("standard", False, vocab_size=100, pad_vocab_multiple=128)
    _check_variant("shared", True, vocab_size=60, pad_vocab_multiple=128)
    # bad input inside a real group: a world of 2 cannot be split 3 ways
    with pytest.raises(
        ValueError, match=r"--tensor-parallel 3 does not divide the number of processes \(2\)"
    ):
        initialize(3)
    initialize(2)
    model = SWBertForMaskedLM(tiny_config())
    model.config.num_attention_heads = 3  # what a user's config with 3 heads would hold
    with pytest.raises(ValueError, match=r"num_attention_heads=3 is not divisible by --tensor-parallel 2"):
        parallelize(model, 2)
    assert not isinstance(model, TensorParallelMaskedLM)  # refused before anything was swapped
    model = parallelize(SWBertForMaskedLM(tiny_config()), 2, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence length 15 is not divisible by --tensor-parallel 2"):
        model(input_ids=torch.ones(2, 15, dtype=torch.long))
    dist.barrier()


@pytest.mark.slow
def test_tp2_equals_tp1_for_every_variant_with_and_without_sequence_parallelism():
    run_ranks(_all_variants, 2)


def test_shard_and_merge_round_trip_without_processes():
    config = tiny_config("pairwise")
    full = reference_model(config).state_dict()
    shards = [shard_state_dict(full, r, 4, config) for r in range(4)]
    assert shards[3]["bert.encoder.layers.0.attn.pair"].shape == (1, config.head_dim, config.head_dim)
    assert shards[1]["bert.encoder.layers.1.attn.out_proj.weight"].shape == (64, 16)  # row: by input
    assert shards[1]["bert.encoder.layers.1.attn.out_proj.bias"].shape == (64,)  # replicated
    merged = merge_state_dicts(shards, config)
    assert merged.keys() == full.keys()
    assert all(torch.equal(merged[k], full[k]) for k in full)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_attention_heads", 4, r"num_attention_heads=4 is not divisible by --tensor-parallel 3"),
        (
            "vocab_size",
            130,
            r"vocab_size=130 \(padded to 130 rows.*--tensor-parallel 4.*pad_vocab_multiple=128",
        ),
        ("intermediate_size", 250, r"intermediate_size=250 is not divisible by --tensor-parallel 4"),
    ],
)
def test_sizes_that_do_not_split_name_the_field_and_the_fix(field, value, message):
    config = tiny_config()
    setattr(config, field, value)
    tp = 3 if field == "num_attention_heads" else 4
    with pytest.raises(ValueError, match=message):
        check_divisible(config, tp)
