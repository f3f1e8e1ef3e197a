"""Tensor parallelism under DeepSpeed ZeRO on gloo: training matches TP=1, the `mpu` wiring is what
keeps the shards apart, and checkpoints move between tensor-parallel sizes and to Hugging Face.

The TP=1 references are plain PyTorch loops (AdamW, DeepSpeed's default clipping at 1.0) on the
unsplit model; a data-parallel reference averages the losses of the per-rank batches, which is what
DeepSpeed's gradient averaging computes.
"""

from __future__ import annotations

from pathlib import Path

import deepspeed
import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from swbert.models import SWBertForMaskedLM
from swbert.models.attention import SelfAttention, StandardAttention, unpack_heads
from swbert.parallel import (
    destroy,
    gather_state_dict,
    initialize,
    mpu,
    parallelize,
    shard_state_dict,
)
from swbert.parallel.convert import full_state_dict, reshard, to_hf, to_universal, universal_files
from tests.parallel.test_parallel_harness import mlm_batch, reference_model, run_ranks, tiny_config

LR = 1e-2
CLIP = 1.0  # DeepSpeed's default gradient_clipping; TP must compute the same global norm


def _engine(model: torch.nn.Module, stage: int, with_mpu: bool = True, **config: object):
    ds_config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        **config,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config, mpu=mpu() if with_mpu else None
    )
    return engine


def _tp_model(ref: SWBertForMaskedLM, tp: int, sequence_parallel: bool = False) -> SWBertForMaskedLM:
    model = SWBertForMaskedLM(ref.config)
    model.load_state_dict(ref.state_dict())
    return parallelize(model, tp, sequence_parallel=sequence_parallel)


class _Reference:
    """TP=1 AdamW steps on the mean loss of the data-parallel ranks' batches."""

    def __init__(self, ref: SWBertForMaskedLM) -> None:
        self.model = ref
        self.optimizer = torch.optim.AdamW(ref.parameters(), lr=LR)

    def step(self, batches: list[dict[str, torch.Tensor]]) -> list[float]:
        losses = [self.model(**b).loss for b in batches]
        (sum(losses) / len(losses)).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return [loss.item() for loss in losses]


def _shards_across_tp(param: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(param) for _ in range(2)]
    dist.all_gather(parts, param.detach(), group=initialize(2).tp_group)
    return parts


def _training_and_mpu_wiring(stage: int, steps: int) -> None:
    config = tiny_config("shared")
    d = initialize(2)
    name = "bert.encoder.layers.0.attn.proj.weight"  # Ws: column-parallel, rows differ by rank

    # Without mpu DeepSpeed takes both TP ranks for data-parallel copies: rank 0's shard is
    # broadcast over rank 1's. This is the failure the wiring below must prevent.
    unwired = _engine(_tp_model(reference_model(config), 2), stage, with_mpu=False)
    shards = _shards_across_tp(dict(unwired.module.named_parameters())[name])
    assert torch.equal(shards[0], shards[1])
    del unwired

    reference = _Reference(reference_model(config))
    engine = _engine(_tp_model(reference_model(config), 2), stage)
    losses, expected = [], []
    for step in range(steps):
        batch = mlm_batch(100 + step)
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        expected += reference.step([batch])
        if step == 0:  # after one step each rank holds its own slice of the TP=1 weights
            shards = _shards_across_tp(dict(engine.module.named_parameters())[name])
            assert not torch.equal(shards[0], shards[1])
            # Adam's first step moves every element by ~LR whatever its gradient, so an element whose
            # gradient is near eps may land a visible fraction of LR apart in two float orders;
            # a wrong or swapped shard is off by the weights' own scale (~0.05).
            mine = shard_state_dict(reference.model.state_dict(), d.tp_rank, 2, config)
            for n, p in engine.module.named_parameters():
                assert_close(p.detach(), mine[n], rtol=0, atol=LR / 10, msg=lambda m, n=n: f"{n}: {m}")
    assert_close(losses, expected, rtol=1e-4, atol=1e-4)

    # sequence parallelism: LayerNorm and row-bias gradients are summed over the group before
    # DeepSpeed sees them
    reference = _Reference(reference_model(config))
    engine = _engine(_tp_model(reference_model(config), 2, sequence_parallel=True), stage)
    for step in range(5):
        batch = mlm_batch(200 + step)
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        assert_close(loss.item(), reference.step([batch])[0], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_tp2_zero2_trains_like_tp1_and_needs_the_mpu():
    """20 ZeRO-2 steps at TP=2 x DP=1 (then 5 with sequence parallelism) give the TP=1 losses."""
    run_ranks(_training_and_mpu_wiring, 2, 2, 20, deepspeed=True)


def _tp2_dp2_like_tp1_dp2(stages: tuple[int, ...], steps: int) -> None:
    config = tiny_config("pairwise")
    d = initialize(2)
    assert (d.tp_size, d.dp_size) == (2, 2)
    for stage in stages:
        reference = _Reference(reference_model(config))
        engine = _engine(_tp_model(reference_model(config), 2), stage)
        for step in range(steps):
            batches = [mlm_batch(1000 + 2 * step + r) for r in range(2)]  # one per data-parallel rank
            loss = engine(**batches[d.dp_rank]).loss
            engine.backward(loss)
            engine.step()
            expected = reference.step(batches)[d.dp_rank]
            assert_close(loss.item(), expected, rtol=1e-4, atol=1e-4, msg=f"ZeRO-{stage} step {step}")


@pytest.mark.slow
def test_tp2_dp2_zero2_and_zero3_train_like_tp1_dp2():
    run_ranks(_tp2_dp2_like_tp1_dp2, 4, (2, 3), 4, deepspeed=True)


def _checkpoints(tmp: str, attention_type: str, overrides: dict[str, object]) -> None:
    config = tiny_config(attention_type, **overrides)
    saved_tp1, universal, saved_tp2 = f"{tmp}/tp1", f"{tmp}/universal", f"{tmp}/tp2"

    def batches(step: int) -> list[dict[str, torch.Tensor]]:
        return [mlm_batch(2000 + 2 * step + r, vocab=config.vocab_size) for r in range(2)]

    # TP=1 x DP=2: train, save, and keep going to see what the continuation should give
    d = initialize(1)
    engine = _engine(_tp_model(reference_model(config), 1), stage=2)
    expected: list[float] = []  # losses of steps 3 and 4, both data-parallel ranks
    for step in range(5):
        if step == 3:
            engine.save_checkpoint(saved_tp1, tag="s3")  # without swbert's client state: layout from config
        loss = engine(**batches(step)[d.dp_rank]).loss
        engine.backward(loss)
        engine.step()
        if step >= 3:
            per_rank = [None, None]
            dist.all_gather_object(per_rank, loss.item())
            expected += per_rank
    del engine
    destroy()

    # TP=2 x DP=1 resumes from it (weights, Adam moments and step) through a universal checkpoint;
    # two accumulated micro-batches stand for the two data-parallel ranks
    d = initialize(2)
    if dist.get_rank() == 0:
        to_universal(saved_tp1, universal, config=config)
    dist.barrier()
    engine = _engine(
        _tp_model(reference_model(config, seed=7), 2),  # other weights: the load must replace them
        stage=2,
        gradient_accumulation_steps=2,
        checkpoint={"load_universal": True},
    )
    engine.load_checkpoint(universal)
    losses = []
    for step in (3, 4):
        for micro in batches(step):
            loss = engine(**micro).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    assert_close(losses, expected, rtol=1e-4, atol=1e-4)

    # TP=2 checkpoint -> merged Hugging Face folder -> the logits of the TP run
    engine.save_checkpoint(saved_tp2, tag="s5")
    engine.eval()
    probe = mlm_batch(3000, vocab=config.vocab_size)
    with torch.no_grad():
        tp_logits = engine.module(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    full = gather_state_dict(engine.module)
    if dist.get_rank() == 0:
        hf = SWBertForMaskedLM.from_pretrained(to_hf(saved_tp2, f"{tmp}/hf", config=config)).eval()
        with torch.no_grad():
            hf_logits = hf(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
        assert_close(hf_logits, tp_logits, rtol=1e-5, atol=1e-5)
        # the weights-only path: TP=2 files -> TP=1 files hold the gathered weights
        merged = torch.load(
            reshard(saved_tp2, f"{tmp}/tp1_weights", 1, config=config) / "s5" / "mp_rank_00_model_states.pt",
            weights_only=False,
        )
        assert all(torch.equal(merged["module"][k], full[k]) for k in full)
        # the weights-only path the other way: TP=1 files -> TP=2 files
        reshard(saved_tp1, f"{tmp}/tp2_weights", 2, config=config)
    dist.barrier()

    # which load into a TP=2 engine (a plain one: the engine above expects universal checkpoints) as
    # each rank's slice of the TP=1 weights
    engine = _engine(_tp_model(reference_model(config, seed=7), 2), stage=2)
    engine.load_checkpoint(f"{tmp}/tp2_weights", load_module_only=True)
    tp1_weights, _ = full_state_dict(saved_tp1, config=config)
    mine = shard_state_dict(tp1_weights, initialize(2).tp_rank, 2, config)
    for name, p in engine.module.named_parameters():
        assert torch.equal(p.detach(), mine[name]), name


@pytest.mark.slow
@pytest.mark.parametrize(
    ("attention_type", "overrides"),
    [
        ("shared", {}),
        # the fused, head-interleaved in_proj, and a vocabulary padded from 100 ids to 128 rows
        ("standard", {"vocab_size": 100, "pad_vocab_multiple": 128}),
    ],
)
def test_checkpoints_move_between_tp_sizes_and_to_hugging_face(tmp_path, attention_type, overrides):
    run_ranks(_checkpoints, 2, str(tmp_path), attention_type, overrides, deepspeed=True)


class _SeparateQKV(SelfAttention):
    """Standard attention as it was before the fused projection: q_proj, k_proj, v_proj, three GEMMs."""

    def __init__(self, fused: StandardAttention, config) -> None:
        super().__init__(config)
        self.out_proj.load_state_dict(fused.out_proj.state_dict())
        parts = [
            unpack_heads(t.detach(), 3, self.head_dim) for t in (fused.in_proj.weight, fused.in_proj.bias)
        ]
        for name, w, b in zip(StandardAttention.packed["in_proj"], *parts):
            linear = torch.nn.Linear(w.shape[1], w.shape[0])
            linear.load_state_dict({"weight": w, "bias": b})
            setattr(self, name, linear)

    def qkv(self, x):
        return tuple(self.split_heads(getattr(self, n)(x)) for n in ("q_proj", "k_proj", "v_proj"))


def _resume_from_before_the_fusion(tmp: str) -> None:
    from swbert.training.compat import check_parameter_names
    from swbert.upgrade import fuse_model_states, fuse_universal

    config = tiny_config("standard")
    old_dir, universal = f"{tmp}/old", f"{tmp}/universal"

    def batches(step: int) -> list[dict[str, torch.Tensor]]:
        return [mlm_batch(4000 + 2 * step + r) for r in range(2)]

    # a ZeRO-2 run of the model as it was (parameters q_proj, k_proj, v_proj), saved at step 3
    d = initialize(1)
    old = SWBertForMaskedLM(config)
    old.load_state_dict(reference_model(config).state_dict())
    for layer in old.bert.encoder.layers:
        layer.attn = _SeparateQKV(layer.attn, config)
    engine = _engine(old, stage=2)
    expected: list[float] = []
    for step in range(5):
        if step == 3:
            engine.save_checkpoint(old_dir, tag="s3")  # no client state: the layout comes from the config
        loss = engine(**batches(step)[d.dp_rank]).loss
        engine.backward(loss)
        engine.step()
        if step >= 3:
            expected.append(loss.item())
    del engine
    tag_dir = Path(old_dir) / "s3"
    with pytest.raises(ValueError, match=r"attn\.k_proj\.bias.*another model's"):
        check_parameter_names(tag_dir, config.to_dict())  # its ZeRO buffers are in the old order
    if dist.get_rank() == 0:  # what swbert.upgrade does to it
        universal_files(old_dir, universal, "s3", config=config)
        fuse_universal(Path(universal) / "s3", config)
        fuse_model_states(Path(universal) / "s3", config)
    dist.barrier()
    check_parameter_names(Path(universal) / "s3", config.to_dict())  # repacked: resumable

    # today's model (fused in_proj) resumes it: weights, Adam moments and step carry over
    engine = _engine(
        _tp_model(reference_model(config, seed=7), 1), stage=2, checkpoint={"load_universal": True}
    )
    engine.load_checkpoint(universal)
    losses = []
    for step in (3, 4):
        loss = engine(**batches(step)[d.dp_rank]).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert_close(losses, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_checkpoint_from_before_the_fused_projections_resumes_once_upgraded(tmp_path):
    run_ranks(_resume_from_before_the_fusion, 2, str(tmp_path), deepspeed=True)


def test_the_mpu_names_megatron_cores_groups_and_hides_sequence_parallel():
    """DeepSpeed's `get_model_parallel_*` are megatron-core's tensor-parallel getters; a
    `get_sequence_parallel_*` must not exist, or DeepSpeed would take it for Ulysses."""
    from megatron.core import parallel_state

    from swbert.parallel import DeepSpeedMPU

    m = DeepSpeedMPU()
    assert m.get_model_parallel_rank is parallel_state.get_tensor_model_parallel_rank
    assert m.get_data_parallel_world_size is parallel_state.get_data_parallel_world_size
    assert m.get_pipeline_model_parallel_group is parallel_state.get_pipeline_model_parallel_group
    assert not hasattr(m, "get_sequence_parallel_world_size")
    assert not hasattr(m, "get_sequence_parallel_group")
