"""The tensor-parallel modules `parallelize` puts into the model: megatron-core layers behind the
interfaces of the modules they replace, so the model code calls them unchanged.

megatron-core's linears return `(output, bias)`; the subclasses here return the tensor. Parameters
keep their TP=1 names (`...proj.weight` holds this rank's rows), so a TP=k state dict differs from
the TP=1 one only in shapes (see `swbert.parallel.plan`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import ModelParallelConfig
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from torch import nn

from swbert.models import SWBertForMaskedLM
from swbert.models.attention import EagerKernel, Mask
from swbert.models.mlm_loss import logit_stats
from swbert.models.modeling import mlm_loss_from_stats
from swbert.parallel.sequence import reduce_scatter_seq


def _no_init(_: torch.Tensor) -> None:
    """Weights are copied from the TP=1 model, never initialised here."""


def megatron_config(tp_size: int, dtype: torch.dtype) -> ModelParallelConfig:
    """Parameters are allocated on the CPU like the model's own and filled by copying."""
    return ModelParallelConfig(
        tensor_model_parallel_size=tp_size,
        params_dtype=dtype,
        use_cpu_initialization=True,
        perform_initialization=False,
    )


def mark_tensor_parallel(param: torch.Tensor, dim: int) -> None:
    """Tag a sharded parameter the way megatron-core does, for DeepSpeed's gradient norm.

    DeepSpeed counts a parameter once per model-parallel group unless it carries
    `tensor_model_parallel`; megatron sets it only when it initialises the weight itself, which
    `perform_initialization=False` skips.
    """
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1


class _NoExtraState:
    """Weights copied in (`_no_init`), and no extra state: megatron-core layers save an empty `_extra_state` entry (for Transformer Engine); without it a
    TP=k state dict has exactly the TP=1 keys, which DeepSpeed's checkpoint tools also expect."""

    get_extra_state = nn.Module.get_extra_state
    set_extra_state = nn.Module.set_extra_state

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, init_method=_no_init, **kwargs)
        # megatron's own load pre-hook adds a `_extra_state: None` entry to every state dict loaded
        # into the layer; drop it again, or a strict `load_state_dict` of TP=1 keys fails on it.
        self._register_load_state_dict_pre_hook(_drop_default_extra_state)


def _shape_of(like: nn.Linear) -> dict:
    """The sizes and bias of the `nn.Linear` a tensor-parallel linear replaces, as megatron names them."""
    return {"input_size": like.in_features, "output_size": like.out_features, "bias": like.bias is not None}


def _drop_default_extra_state(state_dict: dict, prefix: str, *_: object) -> None:
    if state_dict.get(f"{prefix}_extra_state", 0) is None:
        del state_dict[f"{prefix}_extra_state"]


class ColumnLinear(_NoExtraState, ColumnParallelLinear):
    """`nn.Linear` split by output features: this rank's rows of W and b; input replicated.

    Its backward all-reduces the input gradient over the tensor-parallel group, unless
    `reduce_input_grad=False`: then the caller reduces once for several linears reading the same
    input (`copy_input_to_tp_region`). The reduce is megatron's `copy_to` region (a blocking
    all-reduce in the backward) rather than megatron's in-GEMM async all-reduce: `async_op=True` is
    a graph break under torch.compile, which schedules the collective against the GEMMs itself.
    """

    def __init__(self, like: nn.Linear, config: ModelParallelConfig, reduce_input_grad: bool = True) -> None:
        super().__init__(**_shape_of(like), config=config, disable_grad_reduce=True)
        self.reduce_input_grad = reduce_input_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.reduce_input_grad:
            x = copy_to_tensor_model_parallel_region(x, group=self.tp_group)
        return super().forward(x)[0]


class RowLinear(_NoExtraState, RowParallelLinear):
    """`nn.Linear` split by input features; the partial products are summed by one all-reduce, or
    with `reduce_scatter_output` by a reduce-scatter along the sequence (sequence parallelism)."""

    def __init__(self, like: nn.Linear, config: ModelParallelConfig, reduce_scatter_output: bool = False):
        super().__init__(**_shape_of(like), config=config, input_is_parallel=True, skip_bias_add=False)
        self.reduce_scatter_output = reduce_scatter_output

    def forward(self, x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        # input_scale: this rank's slice of a per-input-feature scale (shared attention's dv, split
        # by heads like the input). The product and the reduce are written here rather than by
        # megatron's forward, which passes no group to its linear (a warning, and a graph break
        # under torch.compile); megatron's row linear reduces no input gradient, so the
        # computation is the same.
        if input_scale is not None:
            x = x * input_scale
        y = F.linear(x, self.weight)  # this rank's partial sum
        if self.reduce_scatter_output:
            y = reduce_scatter_seq(y, self.tp_group)  # (B, S/tp, d)
        else:
            y = reduce_from_tensor_model_parallel_region(y, group=self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabEmbedding(VocabParallelEmbedding):
    """`nn.Embedding` split by vocabulary rows, keeping its `padding_idx` (no gradient to [PAD])."""

    def __init__(self, num_embeddings: int, dim: int, padding_idx: int | None, config: ModelParallelConfig):
        super().__init__(num_embeddings, dim, init_method=_no_init, config=config)
        self.padding_idx = padding_idx
        inside = padding_idx is not None and self.vocab_start_index <= padding_idx < self.vocab_end_index
        self.local_padding_idx = padding_idx - self.vocab_start_index if inside else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)  # other ranks' tokens
        local_ids = (ids - self.vocab_start_index).masked_fill(outside, 0)
        h = F.embedding(local_ids, self.weight, padding_idx=self.local_padding_idx)  # (B, S, d)
        h = h.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(h, group=self.tp_group)  # sum over ranks


class VocabParallelDecoder(_NoExtraState, ColumnParallelLinear):
    """The MLM decoder, tied to the vocab-parallel word embedding: local logits (N, V / tp), or the
    chunked cross entropy and predictions without any rank holding vocabulary-wide logits."""

    def __init__(self, embedding: VocabEmbedding, bias: bool, config: ModelParallelConfig) -> None:
        super().__init__(
            embedding.embedding_dim,
            embedding.num_embeddings,
            config=config,
            bias=bias,
            skip_weight_param_allocation=True,
            disable_grad_reduce=True,  # reduced by the copy_to region in forward, as ColumnLinear
        )
        self.weight = embedding.weight  # the same Parameter, as `tie_word_embeddings` does at TP=1
        self.vocab_start_index = embedding.vocab_start_index  # this rank's first id

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = copy_to_tensor_model_parallel_region(x, group=self.tp_group)
        return super().forward(x)[0]

    def chunked_mlm_loss(
        self, x: torch.Tensor, target: torch.Tensor, vocab_size: int, chunk_bytes: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean masked-LM cross entropy over the labelled rows of x (N, d) (replicated over the
        group) and each row's predicted id, as `MLMHead` computes them at TP=1 (ours: chunked, see
        `swbert.models.mlm_loss`).

        Each rank computes its shard's per-row numbers in vocabulary chunks (ids past vocab_size,
        a padded table's, left out), then three (N,) all-reduces combine them: the largest logit
        (max), the softmax sums and target logits (one sum of (N, 2), differentiable: identity
        backward, as megatron's vocab-parallel cross entropy), the first id holding the largest
        logit (min), torch's `argmax` rule. The input gradient is summed over the group by the
        copy_to region's backward."""
        group, start = self.tp_group, self.vocab_start_index
        x = copy_to_tensor_model_parallel_region(x, group=group)
        local_vocab = min(max(vocab_size - start, 0), self.weight.shape[0])
        lse, picked, best, index = logit_stats(
            x, self.weight, self.bias, target - start, local_vocab, chunk_bytes
        )
        top = best.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)  # (N,): no gradient (a stabiliser)
        sums = reduce_from_tensor_model_parallel_region(torch.stack([torch.exp(lse - top), picked], 1), group)
        loss = mlm_loss_from_stats(torch.log(sums[:, 0]) + top, sums[:, 1], target)
        predicted = torch.where(best == top, index + start, vocab_size)  # not this rank's: past every id
        dist.all_reduce(predicted, op=dist.ReduceOp.MIN, group=group)
        return loss, predicted


def copy_input_to_tp_region(module: nn.Module, args: tuple, group: dist.ProcessGroup | None = None) -> tuple:
    """Forward pre-hook on an attention module: identity forward, input-gradient all-reduce backward
    over `group` (given explicitly: megatron's fallback to its global group warns, and under
    torch.compile the warning is a graph break).

    The projections of a layer read the same input. The paper's variants fuse theirs into one linear
    (`in_proj`), but a variant may keep several (a registered fifth one, shared's `proj` beside its
    per-head diagonals): each is built with `reduce_input_grad=False` and this hook reduces their
    summed input gradient once per layer, whatever their number.
    """
    x, *rest = args
    return (copy_to_tensor_model_parallel_region(x, group=group), *rest)


class ShardedDropout(nn.Module):
    """`nn.Dropout` on this rank's chunk (along `dim`) of a tensor split over the tensor-parallel
    group: the mask is this rank's chunk of the mask TP=1's dropout draws for the whole tensor.

    The chunks' masks are then independent draws (the ranks hold different heads, or different
    tokens under sequence parallelism) while every rank draws from the default generator, which is
    identical across the group (see `swbert.parallel.manual_seed`), as the replicated activations'
    dropout needs. This is DTensor's rule for random ops on a sharded tensor (the shard of the
    unsharded draw), and it swaps no generator state: megatron's RNG-tracker fork is a graph break
    under torch.compile, this traces into the block's graph. It costs the whole tensor's random
    draw on every rank (the dropout TP=1 runs); only this rank's chunk of the mask is kept for the
    backward, as a bool.
    """

    def __init__(self, p: float, dim: int, rank: int, size: int) -> None:
        super().__init__()
        self.p, self.dim, self.rank, self.size = p, dim, rank, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p >= 1.0:
            return x * 0.0
        full = list(x.shape)
        full[self.dim] *= self.size
        # F.dropout of ones: TP=1's own draw for the whole tensor, whatever the device's kernel
        keep = F.dropout(x.new_ones(full), self.p).chunk(self.size, self.dim)[self.rank] != 0
        return x * keep * (1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, dim={self.dim}, chunk {self.rank} of {self.size}"


class TensorParallelKernel(nn.Module):
    """The attention kernel on this rank's heads; in training with attention dropout, the model's
    eager kernel with `ShardedDropout` over the heads, so the masks are TP=1's for these heads.

    A fused kernel (SDPA: flash, memory-efficient) draws its dropout from the default generator
    inside the kernel, which cannot be told to draw a chunk: every rank would draw the same masks
    for its own heads. Without dropout (or in evaluation) `kernel` runs as given.
    """

    def __init__(self, kernel: nn.Module, rank: int, size: int) -> None:
        super().__init__()
        self.kernel = kernel
        rate = kernel.dropout  # SDPAKernel: the rate; EagerKernel: an nn.Dropout
        self.p = float(rate.p if isinstance(rate, nn.Dropout) else rate)
        self.dropped = EagerKernel(0.0)
        self.dropped.dropout = ShardedDropout(self.p, dim=1, rank=rank, size=size)  # (B, H/tp, S, S)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor:
        if self.training and self.p > 0.0:
            return self.dropped(q, k, v, mask)
        return self.kernel(q, k, v, mask)


class TensorParallelMaskedLM(SWBertForMaskedLM):
    """`SWBertForMaskedLM` whose decoder is split over the vocabulary.

    `parallelize` switches the model's class to this one (as `torch.distributed.fsdp.fully_shard`
    does), so `isinstance(model, SWBertForMaskedLM)` still holds and the call signature is the
    same. In training (`return_logits=False`, the trainer's path) the loss and the predicted ids
    come from the vocab-parallel chunked cross entropy (`VocabParallelDecoder.chunked_mlm_loss`):
    vocabulary-wide logits never exist on one rank. When logits are asked for, they are gathered
    (full vocabulary, as at TP=1) and the loss is TP=1's on them.
    """

    def logits_and_loss(
        self, h: torch.Tensor, target: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h is replicated over the group; the decoder's output is this rank's vocabulary shard,
        gathered (its backward keeps this rank's slice of the gradient). With a padded vocabulary
        (config.pad_vocab_multiple) the gathered logits end at vocab_size as at TP=1."""
        local_logits = self.mlm_head(h)  # (..., padded V / tp)
        logits = gather_from_tensor_model_parallel_region(local_logits, group=self.mlm_head.decoder.tp_group)
        logits = logits[..., : self.config.vocab_size]
        return logits, None if target is None else self.loss_on(logits, target)

    def save_pretrained(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "this model is split over tensor-parallel ranks; export with "
            "swbert.parallel.gather_state_dict(model), or from a checkpoint: python -m swbert.parallel.convert hf CKPT_DIR OUT_DIR"
        )
