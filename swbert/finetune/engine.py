"""What one fine-tuning run trains with: the process group and the DeepSpeed engine. Every run is a
DeepSpeed engine, one process included (a 1-rank group), so precision, optimizer wrapping and
clipping are the same on 1 GPU as on N (`swbert.runtime.ds_config.resolve_precision`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from swbert.runtime.optim import build_optimizer, build_scheduler
from swbert.runtime.ranks import ParallelDims

# the variables `swbert.runtime.dist.map_launcher_env` sets for a process no launcher started
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_DS_CONFIG = "zero2.json"  # pretraining's default too; stage 2 sums bf16 gradients in fp32


@contextmanager
def process_group() -> Iterator[ParallelDims]:
    """The job's process group for the duration of the block, with this process's place in it.

    Under a launcher (torchrun, deepspeed, srun) the group is the job's, left up. A plain ``python``
    process gets a 1-rank group, destroyed on leaving with the launcher variables it set, so the
    process is left as it was (its threads may outlive it: start later ranks from a fresh process,
    not by forking this one). A sweep holds one group around all its runs."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        yield ParallelDims.from_env()
        return
    from swbert.runtime.dist import init_distributed

    launched = "RANK" in os.environ
    saved = {k: os.environ.get(k) for k in LAUNCH_ENV}
    init_distributed()  # NCCL on GPU, gloo on CPU; sets this rank's GPU
    try:
        yield ParallelDims.from_env()
    finally:
        if not launched:  # DeepSpeed's references, then torch's group (its teardown leaves it up)
            import deepspeed.comm

            deepspeed.comm.destroy_process_group()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            for key, value in saved.items():  # the launcher variables it set
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def build_engine(
    model: nn.Module,
    ds_config: dict[str, Any],
    lr: float,
    weight_decay: float,
    total: int,
    warmup: int,
    on_gpu: bool,
) -> Any:
    """A DeepSpeed engine of AdamW over pretraining's parameter groups and its linear schedule (the
    engine's `lr_scheduler`, stepped once per optimizer step), as pretraining's `build_engine`."""
    import deepspeed

    from swbert.runtime.dist import bound_every_group

    optimizer = build_optimizer(model, lr, weight_decay, kind="torch_adamw", on_gpu=on_gpu)
    scheduler = build_scheduler(optimizer, total, warmup=warmup)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, dist_init_required=False
    )
    bound_every_group()  # SWBERT_DIST_TIMEOUT_MIN for DeepSpeed's groups too
    return engine


class CompiledInTraining:
    """A model's ``forward``, compiled for its training steps only: evaluation (other batch sizes, no
    gradients) runs eagerly, so the graphs are the training batches' shapes, one per length bucket.
    Static shapes (``dynamic=False``): each is compiled once, as pretraining compiles its units.
    Set as the model's ``forward`` (`fit` with ``compile``); `uncompile` removes it."""

    def __init__(self, module: nn.Module, backend: Any) -> None:
        self.module, self.eager = module, module.forward
        self.compiled = torch.compile(module.forward, backend=backend, dynamic=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return (self.compiled if self.module.training else self.eager)(*args, **kwargs)


def uncompile(model: nn.Module) -> None:
    """The model's own ``forward`` back: a fitted model is evaluated, saved and fitted again as it was."""
    if isinstance(model.__dict__.get("forward"), CompiledInTraining):
        del model.forward
