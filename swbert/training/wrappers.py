"""Every wrapper a run puts around the model, applied by one function in a fixed, logged order.

    1. tensor (and sequence) parallelism   megatron-core layers swapped in (swbert.parallel)
    2. activation checkpointing            per encoder block: none, full or selective
    3. compile                             per unit: each block, the MLM head
    4. ZeRO-3 gathering units              the same units: one all-gather each, hooks outside

The order matters. Tensor parallelism first: it replaces the modules the later steps wrap.
Checkpointing before compile, so the compiler traces the checkpointed forward (torchtitan's order)
and recomputes inside the compiled backward. Compile per unit rather than the whole model: a graph
of the whole model has one backward, so every gradient hook (ZeRO's reduce) fires after all of it
and no communication overlaps the backward; per block, block i's gradients are reduced while the
blocks before it still run backward (`tests/test_compile_overlap.py` measures it). Only the
`forward` of each unit is compiled; the module's hooks (ZeRO-3's gather and release, DeepSpeed's)
run eagerly around it, and with each unit a ZeRO-3 leaf the parameters a compiled graph reads are
exactly the ones its module gathered (no parameter is read outside the module that gathers it).

The model's names, state dict and checkpoints are those of the eager model: `forward` is replaced
on the instances, nothing is wrapped in a new module.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from swbert.models import SWBertForMaskedLM
from swbert.runtime.recompute import SELECTIVE_SAVED_OPS

log = logging.getLogger("swbert.train")

ActivationCheckpointing = Literal["none", "full", "selective"]


def _selective_policy(_ctx: object, op: object, *_args: object, **_kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SELECTIVE_SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> tuple:
    return create_selective_checkpoint_contexts(_selective_policy)


def checkpointed(forward: Callable, mode: ActivationCheckpointing) -> Callable:
    """`forward` whose activations are recomputed in the backward (`full`: all of them; `selective`:
    all but the outputs of `SELECTIVE_SAVED_OPS` (swbert.runtime.recompute)). Non-reentrant, so it
    composes with compile; the default RNG state is restored for the recompute, so dropout draws
    the same masks (under tensor parallelism too: every dropout draws from the default generator,
    see `swbert.parallel.layers.ShardedDropout`)."""
    if mode == "none":
        return forward
    extra = {"context_fn": _selective_context} if mode == "selective" else {}

    @functools.wraps(forward)
    def run(*args: object, **kwargs: object) -> object:
        if not torch.is_grad_enabled():  # evaluation: nothing to save
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    return run


def compile_units(model: SWBertForMaskedLM) -> list[nn.Module]:
    """The modules compiled one by one and gathered one by one under ZeRO-3, in forward order.

    The embeddings stay eager and are gathered per table, as DeepSpeed does by default: a lookup
    and a LayerNorm gain little from compile, and marked as one ZeRO-3 unit their backward fails
    in DeepSpeed 0.19.8 (a gathered table reads as released: a size-0 tensor in its gradient)."""
    return [*model.bert.encoder.layers, model.mlm_head]


def wrap_model(
    model: SWBertForMaskedLM,
    *,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    activation_checkpointing: ActivationCheckpointing = "none",
    compile: bool = False,
    compile_backend: str = "inductor",
    zero_stage: int = 0,
    log_steps: bool = True,
) -> SWBertForMaskedLM:
    """Apply the run's wrappers to `model` in place, in the order of this module's docstring, each
    step logged (on the calling rank when `log_steps`); returns the model. Call before
    `deepspeed.initialize` (ZeRO-3 reads the leaf marks when it partitions)."""
    say = log.info if log_steps else log.debug
    if tp_size > 1:
        from swbert import parallel

        model = parallel.parallelize(model, tp_size, sequence_parallel=sequence_parallel)
        say(
            "wrap 1/4: tensor parallel %d%s",
            tp_size,
            " with sequence parallelism" if sequence_parallel else "",
        )
    else:
        say("wrap 1/4: tensor parallel 1 (model unchanged)")
    for block in model.bert.encoder.layers:
        block.forward = checkpointed(block.forward, activation_checkpointing)
    say("wrap 2/4: activation checkpointing %s", activation_checkpointing)
    units = compile_units(model)
    if compile:
        for unit in units:
            # dynamic=False: the shapes are static (a fixed sequence length and predictions per
            # sequence), and one graph per shape is what the GPU kernels are tuned for
            unit.forward = torch.compile(unit.forward, backend=compile_backend, dynamic=False)
        say("wrap 3/4: compiled per unit (%d blocks, MLM head)", len(units) - 1)
    else:
        say("wrap 3/4: eager (no compile)")
    if zero_stage == 3:
        from deepspeed.utils import set_z3_leaf_module

        for unit in units:
            set_z3_leaf_module(unit, True)
        say("wrap 4/4: ZeRO-3 gathers per unit (%d units)", len(units))
    else:
        say("wrap 4/4: ZeRO stage %d: parameters whole on every rank", zero_stage)
    return model
