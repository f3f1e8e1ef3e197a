"""Activation memory of one rank for one micro-batch: what the forward keeps for the backward, under
tensor and sequence parallelism and activation checkpointing (none, full, selective), counted tensor
by tensor from the model's own forward; what attention keeps is traced from the variant's module on
fake tensors. docs/scaling.md ("Activation memory") gives the per-token table and what each mode keeps;
tests/scaling/test_memory_estimate.py holds it against the bytes the real model keeps."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import torch

from swbert.models.attention import build_attention
from swbert.models.config import SWBertConfig
from swbert.runtime.recompute import SELECTIVE_SAVED_OPS

Precision = Literal["fp32", "bf16", "fp16"]
Checkpointing = Literal["none", "full", "selective"]
Device = Literal["gpu", "cpu"]

LN_STATS_BYTES = 8  # a LayerNorm's mean and 1/std per token, fp32 on a GPU
INDEX_BYTES = 8  # int64 positions
MLM_PROBABILITY = 0.15


def element_bytes(precision: Precision) -> int:
    """Bytes of one activation (or parameter) element."""
    return 4 if precision == "fp32" else 2


@dataclass(frozen=True)
class AttentionTrace:
    """Bytes one attention module keeps for the backward besides its input and its parameters."""

    saved: int  # every tensor autograd saves (no checkpointing)
    kept: int  # outputs of SELECTIVE_SAVED_OPS, less the module's own output (selective)
    saved_and_kept: int  # both: what the selective recompute need not bring back
    scaled_out_weight: int  # bytes of the output projection's weight scaled by `input_scale` (shared's dv)


_TRACES: dict[tuple[str, str, str, int, int, int | None], AttentionTrace] = {}


def attention_trace(
    config: SWBertConfig,
    batch: int,
    seq_len: int,
    precision: Precision = "bf16",
    device: Device = "gpu",
    rows: int | None = None,
) -> AttentionTrace:
    """`AttentionTrace` of `config`'s attention on `batch` x `seq_len` tokens (`rows`: its output at
    that many positions only, the last block's), traced at the real shape on fake tensors. Cached."""
    key = (config.to_json_string(use_diff=False), precision, device, batch, seq_len, rows)
    if key not in _TRACES:
        if device == "gpu":  # the fused kernels keep no S x S matrices, with or without dropout
            config = copy.deepcopy(config)
            config.attention_probs_dropout_prob = 0.0
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        _TRACES[key] = AttentionTrace(*_trace_once(config, dtype, batch, seq_len, rows))
    return _TRACES[key]


def _trace_once(
    config: SWBertConfig, dtype: torch.dtype, batch: int, seq: int, rows: int | None
) -> tuple[int, int, int, int]:
    """(saved, kept, both, scaled weight) bytes of one forward of the attention module on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    held: list[torch.UntypedStorage] = []  # every storage seen: a freed one's address (key) may be reused

    def key(t: torch.Tensor) -> int:
        held.append(t.untyped_storage())
        return held[-1]._cdata

    saved: dict[int, int] = {}
    kept: dict[int, int] = {}
    scaled: list[int] = []

    class KeptOutputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if func in SELECTIVE_SAVED_OPS:
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        kept[key(t)] = t.untyped_storage().nbytes()
            return out

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[key(t)] = t.untyped_storage().nbytes()
        return t

    def out_proj_args(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if kwargs.get("input_scale") is not None:
            scaled.append(module.weight.numel() * module.weight.element_size())

    previous = torch.get_default_dtype()
    try:
        with FakeTensorMode():
            torch.set_default_dtype(dtype)  # built in `dtype`: .to() cannot swap fake parameters
            attn = build_attention(config).train()
            torch.set_default_dtype(previous)
            attn.out_proj.register_forward_pre_hook(out_proj_args, with_kwargs=True)
            x = torch.empty(batch, seq, config.hidden_size, dtype=dtype, requires_grad=True)
            # the positions as the model gives them: (batch indices, positions), `rows` of each
            index = () if rows is None else (torch.zeros(rows, dtype=torch.long),) * 2
            with KeptOutputs(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = attn(x, None, index or None)
            skip = {key(x), key(y), *(key(t) for t in index), *(key(p) for p in attn.parameters())}
    except Exception as err:  # a variant whose forward fake tensors cannot run
        raise ValueError(
            f"could not trace attention {config.attention_type!r} on fake tensors to count the "
            f"activations it keeps: {err}"
        ) from err
    finally:
        torch.set_default_dtype(previous)
    saved_bytes = {k: n for k, n in saved.items() if k not in skip}
    kept_bytes = {k: n for k, n in kept.items() if k not in skip}
    both = sum(n for k, n in saved_bytes.items() if k in kept_bytes)
    return sum(saved_bytes.values()), sum(kept_bytes.values()), both, sum(scaled)


@dataclass(frozen=True)
class ActivationMemory:
    """Activation bytes of one rank for one micro-batch, by where they are kept."""

    embeddings: float  # embedding LayerNorm input and stats, dropout mask, position ids
    blocks: float  # every encoder block, across the forward (under checkpointing: what it keeps)
    head: float  # MLM head on the predicted positions, the returned logits, the loss's log-probs
    recompute: float  # live only during one block's recompute in the backward (checkpointing)

    @property
    def kept(self) -> float:
        """Bytes held from the end of the forward into the backward."""
        return self.embeddings + self.blocks + self.head

    @property
    def peak(self) -> float:
        """What a rank must hold: the kept bytes plus one block being recomputed."""
        return self.kept + self.recompute


def check_activation_layout(tp: int, sequence_parallel: bool, checkpointing: Checkpointing) -> None:
    """The combinations `launchers/pretrain.py` refuses, refused here with the flag to change."""
    if checkpointing not in ("none", "full", "selective"):
        raise ValueError(f"--activation-checkpointing {checkpointing!r} is not one of none, full, selective")
    if sequence_parallel and tp == 1:
        raise ValueError(
            "--sequence-parallel true needs a tensor-parallel size > 1 (it splits the activations "
            "between the tensor-parallel regions): use a tpN layout or --sequence-parallel false"
        )
    if checkpointing == "selective" and tp > 1:
        raise ValueError(
            f"--activation-checkpointing selective cannot run with tensor parallel size {tp} (the trainer "
            "refuses it): use --activation-checkpointing full, or a tp1 layout"
        )


def activation_memory(
    config: SWBertConfig,
    seq_len: int,
    micro_batch: int,
    precision: Precision = "bf16",
    tp: int = 1,
    sequence_parallel: bool = False,
    checkpointing: Checkpointing = "none",
    device: Device = "gpu",
) -> ActivationMemory:
    """Activation bytes of one rank for `micro_batch` x `seq_len` tokens, 15% of them predicted;
    `device`: whose kernels ("gpu": fused attention, bool dropout masks)."""
    check_activation_layout(tp, sequence_parallel, checkpointing)
    if sequence_parallel and seq_len % tp:
        raise ValueError(f"sequence length {seq_len} is not divisible by tensor-parallel size {tp}")
    p = element_bytes(precision)
    d, f, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    B, S = micro_batch, seq_len
    T = B * S
    N = B * max(1, round(S * MLM_PROBABILITY))
    m = 0 if config.hidden_dropout_prob == 0 else (1 if device == "gpu" else p)
    # a block's masks under sequence parallelism: a bool chunk on every device (ShardedDropout)
    block_m = 1 if sequence_parallel and m else m
    stats = LN_STATS_BYTES if device == "gpu" else 2 * p  # a CPU's LayerNorm keeps them in its dtype
    split = tp if sequence_parallel else 1  # the divisor of what lies between the tensor-parallel regions

    def block(rows: int | None) -> tuple[float, float]:
        """(kept, recomputed) bytes of one block; `rows`: the positions it computes after attention."""
        R = T if rows is None else rows
        trace = attention_trace(config, B, S, precision, device, rows)
        attention = trace.saved
        if tp > 1 and trace.scaled_out_weight:
            # the row-parallel output projection scales its input (R x d/t) where the TP=1 module
            # scales its d x d weight
            attention += p * d * R - trace.scaled_out_weight
        x = p * d * T  # the attention input (with sequence parallelism: the gathered one)
        residual = R * (2 * (p * d + stats) + 2 * block_m * d) / split
        mlp = p * d * R + 2 * p * f * R / tp  # MLP input (whole per rank), GELU input and output
        none = x + attention / tp + residual + mlp
        if checkpointing == "none":
            return none, 0.0
        if checkpointing == "full":
            # the block's input; with sequence parallelism the S/t chunk, and the recompute gathers anew
            return p * d * T / split, none - (x if split == 1 else 0.0)
        kept = x + trace.kept + p * (d + f + d) * R  # + out_proj, MLP first and second outputs
        recompute = trace.saved - trace.saved_and_kept + residual + p * (d + f) * R
        return kept, recompute

    full_kept, full_recompute = block(None)
    last_kept, _ = block(None if sequence_parallel else N)  # the last block on the predicted rows only
    blocks = (layers - 1) * full_kept + last_kept
    embeddings = T * (p * d + stats + m * d) + INDEX_BYTES * S
    if tp > 1:  # the vocab-parallel lookup keeps its local ids and the mask of other ranks' ids
        embeddings += T * (INDEX_BYTES + 1)
    return ActivationMemory(embeddings, blocks, _head_bytes(config, N, p, stats, tp), full_recompute)


def _head_bytes(config: SWBertConfig, rows: int, p: int, stats: int, tp: int) -> float:
    """The MLM head's activations on its `rows` predicted positions in training: the chunked loss
    (swbert.models.mlm_loss) keeps no logits, only each row's fp32 log-sum-exp, and the head returns
    each row's predicted id (int64) for the accuracy."""
    d = config.hidden_size
    # dense, GELU and LayerNorm inputs, the decoder input; LayerNorm stats; the row indices
    head = rows * (4 * p * d + stats + INDEX_BYTES)
    if tp > 1:  # the vocabulary shards' reductions: each row's max, its two fp32 sums and its id
        head += rows * (4 + 8 + INDEX_BYTES)
    return head + rows * (4 + INDEX_BYTES)  # the log-sum-exp and the predicted ids
