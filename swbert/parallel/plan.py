"""How each parameter is split over tensor-parallel ranks, used by `parallelize` to swap modules
and by the checkpoint tools to shard and merge state dicts.

Every split is into `tp` equal contiguous chunks. Each attention class carries its own table
(`SelfAttention.tp_plan()`): its projections are split by output features, which is by heads
(`split_heads` views features as (H, Dh), head-major), and its per-head parameters by heads, so
rank r owns heads [r H/tp, (r+1) H/tp) and computes their Q, K, V with no communication; the
output projection is row-parallel. For example the shared variant's table is proj (Ws, bs)
column; dq, dk, dv by heads; out_proj row.

MLP: fc1 column, fc2 row. Word embedding and the tied MLM decoder (weight and bias): by
vocabulary rows. Everything else (LayerNorms, position and token-type embeddings, row-parallel
biases, the MLM transform) is replicated.
"""

from __future__ import annotations

import math
import re

import torch

from swbert.models import SWBertConfig
from swbert.models.attention import SelfAttention, Split, attention_class

MLP_PLAN: dict[str, Split] = {"fc1": "column", "fc2": "row"}
VOCAB_PARALLEL = ("embeddings.word_embeddings.weight", "mlm_head.decoder.weight", "mlm_head.decoder.bias")

_LAYER_PARAM = re.compile(r"(?:^|\.)layers\.\d+\.(attn|mlp)\.(\w+?)(?:\.(weight|bias))?$")


def attention_plan(attn: SelfAttention) -> dict[str, Split]:
    """The split table of an attention layer (its class's `tp_plan()`), checked to place every
    parameter: one left whole would stay equal on every rank while its gradient came from that
    rank's heads only, a silently wrong model."""
    table = type(attn).tp_plan()
    unplaced = sorted({name.split(".")[0] for name, _ in attn.named_parameters()} - set(table))
    if unplaced:
        raise ValueError(
            f"{type(attn).__qualname__} (attention_type={attn.attention_type!r}) has parameters "
            f"{unplaced} that its qkv_plan does not place; add each to {type(attn).__qualname__}.qkv_plan "
            "as 'column' (an nn.Linear producing per-head features) or 'heads' (a per-head parameter)"
        )
    return table


def partition_dim(name: str, config: SWBertConfig) -> int | None:
    """The dimension along which TP=1 tensor `name` is split over ranks; None if replicated."""
    if name.endswith(VOCAB_PARALLEL):
        return 0
    m = _LAYER_PARAM.search(name)
    if m is None:
        return None
    block, module, kind = m.groups()
    if block == "attn":
        cls = attention_class(config.attention_type)
        table = cls.tp_plan()
    else:
        table = MLP_PLAN
    split = table.get(module)
    if split == "column" or split == "heads":
        return 0
    if split == "row":
        return 1 if kind == "weight" else None  # the bias is added once, after the all-reduce
    return None


def shard(full: torch.Tensor, dim: int | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank `tp_rank`'s chunk of a TP=1 tensor (the tensor itself if replicated)."""
    if dim is None or tp_size == 1:
        return full
    return full.chunk(tp_size, dim=dim)[tp_rank].clone()


def check_divisible(config: SWBertConfig, tp_size: int) -> None:
    """Raise a ValueError saying what to change when the model cannot be split `tp_size` ways."""
    flag = f"--tensor-parallel {tp_size}"
    if config.num_attention_heads % tp_size:
        ok = [t for t in range(1, config.num_attention_heads + 1) if config.num_attention_heads % t == 0]
        raise ValueError(
            f"num_attention_heads={config.num_attention_heads} is not divisible by {flag}: each rank "
            f"owns whole heads; use a tensor-parallel size in {ok}"
        )
    if config.intermediate_size % tp_size:
        raise ValueError(
            f"intermediate_size={config.intermediate_size} is not divisible by {flag}; "
            "use a tensor-parallel size that divides it"
        )
    rows = config.padded_vocab_size
    if rows % tp_size:
        multiple = math.lcm(128, tp_size)
        raise ValueError(
            f"vocab_size={config.vocab_size} (padded to {rows} rows with pad_vocab_multiple="
            f"{config.pad_vocab_multiple}) is not divisible by {flag}: the embedding and the MLM decoder "
            f"are split by vocabulary rows. Pad the vocabulary to a multiple of {tp_size}: "
            f"pad_vocab_multiple={multiple} (pretraining: --pad-vocab-multiple {multiple}); the padded "
            "rows are never read nor predicted"
        )
