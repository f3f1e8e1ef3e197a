"""`parallelize(model, tp_size)`: tensor (and sequence) parallelism applied to a TP=1 model from outside.

A fixed, logged sequence of steps; each swaps modules or parameters for the sharded ones of
`swbert.parallel.plan` and copies this rank's slice of the TP=1 weights into them, so the
parallel model computes the same function as the model it was made from.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from megatron.core import ModelParallelConfig
from torch import nn

from swbert.models import SWBertForMaskedLM
from swbert.parallel import plan, sequence
from swbert.parallel.layers import (
    ColumnLinear,
    RowLinear,
    ShardedDropout,
    TensorParallelKernel,
    TensorParallelMaskedLM,
    VocabEmbedding,
    VocabParallelDecoder,
    copy_input_to_tp_region,
    mark_tensor_parallel,
    megatron_config,
)
from swbert.parallel.state import dims, log_rank0
from swbert.runtime.ranks import ParallelDims

_STEPS = 7


def parallelize(model: SWBertForMaskedLM, tp_size: int, sequence_parallel: bool = False) -> SWBertForMaskedLM:
    """Split `model` over the tensor-parallel group, in place; returns it. No-op at `tp_size == 1`.

    Call after `swbert.parallel.initialize(tp_size)` and before `deepspeed.initialize`. Every rank
    of a tensor-parallel group must call it; the weights of TP rank 0 are used (step 1), so the
    ranks need not have built identical models. `sequence_parallel` also splits the activations
    between the tensor-parallel regions along the sequence (`swbert.parallel.sequence`).
    """
    if tp_size == 1:
        log_rank0("tensor parallel 1: model unchanged")
        return model
    d = _check(model, tp_size)
    config = model.config
    step = _Step(tp_size)
    step("broadcast TP rank 0's weights over the tensor-parallel group")
    _broadcast(model, d.tp_group)

    step("word embeddings -> VocabParallelEmbedding (%d rows per rank)", config.padded_vocab_size // tp_size)
    embeddings = model.bert.embeddings
    old = embeddings.word_embeddings
    mcfg = megatron_config(tp_size, old.weight.dtype)
    word = VocabEmbedding(old.num_embeddings, old.embedding_dim, old.padding_idx, mcfg)
    _fill(word, {"weight": old.weight}, d.tp_rank, tp_size, dims_={"weight": 0})
    embeddings.word_embeddings = word.to(old.weight.device)

    _split_layers(model, step, mcfg, d, sequence_parallel)

    step("MLM decoder -> vocab-parallel, tied to the word-embedding shard; loss -> vocab-parallel CE")
    head = model.mlm_head
    decoder = VocabParallelDecoder(word, bias=head.decoder.bias is not None, config=mcfg)
    if head.decoder.bias is not None:
        _fill(decoder, {"bias": head.decoder.bias}, d.tp_rank, tp_size, dims_={"bias": 0})
    head.decoder = decoder.to(old.weight.device)
    model.__class__ = TensorParallelMaskedLM

    step("tag sharded parameters (tensor_model_parallel) for DeepSpeed's gradient norm")
    for name, param in model.named_parameters():
        dim = plan.partition_dim(name, config)
        if dim is not None:
            mark_tensor_parallel(param, dim)

    if not sequence_parallel:
        step("sequence parallelism: off")
        return model
    step("sequence parallelism: LayerNorm/dropout/residual on S/%d tokens per rank", tp_size)
    _sequence_parallel(model, d)
    return model


def _check(model: SWBertForMaskedLM, tp_size: int) -> ParallelDims:
    """The process groups' dims, once `model` and `tp_size` are known to fit them."""
    if not isinstance(model, SWBertForMaskedLM):
        raise TypeError(f"parallelize supports SWBertForMaskedLM, got {type(model).__name__}")
    if isinstance(model, TensorParallelMaskedLM):
        raise RuntimeError("this model is already tensor-parallel")
    d = dims()
    if d.tp_size != tp_size:
        raise ValueError(
            f"parallelize(tp_size={tp_size}) but the process groups were made for {d.tp_size}; "
            f"call swbert.parallel.initialize({tp_size}) first"
        )
    plan.check_divisible(model.config, tp_size)
    return d


def _split_layers(
    model: SWBertForMaskedLM, step: _Step, mcfg: ModelParallelConfig, d: ParallelDims, sp: bool
) -> None:
    """Each encoder layer's attention by heads and its MLP, then the attention's region entry."""
    config, layers = model.config, model.bert.encoder.layers
    attention_plan = plan.attention_plan(layers[0].attn)  # every layer: one class
    step(
        "%d layers: %s attention by heads (%d per rank), out_proj row; MLP fc1 column, fc2 row",
        len(layers),
        config.attention_type,
        config.num_attention_heads // d.tp_size,
    )
    for layer in layers:
        _split_by_plan(layer.attn, attention_plan, mcfg, d.tp_rank, d.tp_size, region_entry=True, seq=sp)
        _split_by_plan(layer.mlp, plan.MLP_PLAN, mcfg, d.tp_rank, d.tp_size, region_entry=sp, seq=sp)

    step("attention: one input-gradient all-reduce for all projections; dropout: TP=1's masks of these heads")
    for layer in layers:
        if not sp:  # with sequence parallelism the region entry is the all-gather of step 7
            layer.attn.register_forward_pre_hook(functools.partial(copy_input_to_tp_region, group=d.tp_group))
        layer.attn.kernel = TensorParallelKernel(layer.attn.kernel, d.tp_rank, d.tp_size)


def _sequence_parallel(model: SWBertForMaskedLM, d: ParallelDims) -> None:
    """Scatter the embeddings' output over the sequence, gather it around each tensor-parallel
    region and at the encoder's end; the norms' and row-parallel biases' gradients summed."""
    group = d.tp_group
    # the split region holds whole sequence chunks: the last layer computes every position
    model.last_layer_on_labels = False
    model.bert.embeddings.register_forward_hook(sequence.scatter_output_hook(group))
    model.bert.encoder.register_forward_hook(sequence.gather_encoder_output_hook(group))
    for layer in model.bert.encoder.layers:
        layer.attn.register_forward_pre_hook(sequence.gather_seq_pre_hook(group))
        layer.mlp.register_forward_pre_hook(sequence.gather_seq_pre_hook(group))
        # each rank drops out its own tokens (B, S/tp, d), with TP=1's masks for them
        layer.dropout = ShardedDropout(layer.dropout.p, dim=1, rank=d.tp_rank, size=d.tp_size)
        for param in (
            *layer.attn_norm.parameters(),
            *layer.mlp_norm.parameters(),
            layer.attn.out_proj.bias,
            layer.mlp.fc2.bias,
        ):
            if param is not None:
                sequence.sum_grad_over_group(param, group)


class _Step:
    """Numbered log lines, so a run's log shows the exact sequence that was applied."""

    def __init__(self, tp_size: int) -> None:
        self.n = 0
        self.tp_size = tp_size

    def __call__(self, msg: str, *args: object) -> None:
        self.n += 1
        log_rank0(f"parallelize(tp={self.tp_size}) step {self.n}/{_STEPS}: {msg}", *args)


def _broadcast(model: nn.Module, group: dist.ProcessGroup) -> None:
    src = dist.get_global_rank(group, 0)
    on_gpu = dist.get_backend(group) == "nccl"
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            buf = t.data.cuda() if on_gpu and not t.is_cuda else t.data
            dist.broadcast(buf, src, group=group)
            if buf is not t.data:
                t.data.copy_(buf)


def _fill(
    module: nn.Module,
    full: dict[str, torch.Tensor],
    tp_rank: int,
    tp_size: int,
    dims_: dict[str, int | None],
) -> None:
    """Copy this rank's slices of the TP=1 tensors `full` into `module`'s parameters."""
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, tensor in full.items():
            params[name].copy_(plan.shard(tensor.detach().cpu(), dims_[name], tp_rank, tp_size))


def _split_by_plan(
    parent: nn.Module,
    table: dict[str, plan.Split],
    mcfg: object,
    tp_rank: int,
    tp_size: int,
    region_entry: bool,
    seq: bool,
) -> None:
    """Swap `parent`'s submodules/parameters per `table`.

    `region_entry`: a hook on `parent` makes its input enter the tensor-parallel region (one
    backward all-reduce or, with `seq`, an all-gather), so column linears skip their own.
    `seq`: row linears end with a reduce-scatter along the sequence instead of an all-reduce.
    """
    for attr, split in table.items():
        old = getattr(parent, attr)
        if split == "heads":  # a per-head parameter (dq, dk, dv or U): keep this rank's heads
            setattr(parent, attr, nn.Parameter(plan.shard(old.detach(), 0, tp_rank, tp_size)))
            continue
        has_bias = old.bias is not None
        if split == "column":
            new = ColumnLinear(old, mcfg, reduce_input_grad=not region_entry)
            dims_ = {"weight": 0, "bias": 0}
        else:
            new = RowLinear(old, mcfg, reduce_scatter_output=seq)
            dims_ = {"weight": 1, "bias": None}
        tensors = {"weight": old.weight, **({"bias": old.bias} if has_bias else {})}
        _fill(new, tensors, tp_rank, tp_size, dims_)
        setattr(parent, attr, new.to(old.weight.device))
