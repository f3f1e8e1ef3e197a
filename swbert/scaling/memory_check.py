"""Check the closed-form model-state memory against what a DeepSpeed engine really holds (after the
second backward, every tensor storage the engine reaches, each once; docs/scaling.md). Run under a
distributed launcher; rank 0 prints one JSON line per configuration:

    torchrun --nproc-per-node 2 -m swbert.scaling.memory_check --size small --vocab-size 2048 \\
        --zero 0 1 2 3 --precision fp32 bf16

With `--tensor-parallel N` it prints, for every rank, the parameters it holds after
`swbert.parallel.parallelize` next to `params_per_rank`."""

from __future__ import annotations

import gc
import itertools
import json
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from swbert import cli
from swbert.models import SWBertConfig, SWBertForMaskedLM
from swbert.scaling.memory import Layout, Precision, model_state_bytes, params_per_rank

# Objects whose attributes are followed when collecting tensors: the engine, its optimizer and the
# module tree. Anything else (process groups, loggers, the config) is not walked.
_WALKED_MODULES = ("deepspeed", "torch.optim", "swbert", "transformers")


def emit(row: dict) -> None:
    """One JSON line in a single write: ranks sharing a pipe cannot interleave inside it."""
    sys.stdout.write(json.dumps(row) + "\n")
    sys.stdout.flush()


def held_tensor_bytes(root: Any) -> int:
    """Bytes of all tensor storages reachable from `root` through DeepSpeed/torch objects."""
    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta":
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            if obj.grad is not None:
                stack.append(obj.grad)
            stack.extend(getattr(obj, "__dict__", {}).values())  # e.g. ZeRO-3's ds_tensor
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif isinstance(obj, torch.nn.Module) or type(obj).__module__.startswith(_WALKED_MODULES):
            stack.extend(vars(obj).values())
    return sum(storages.values())


def measure(
    config: SWBertConfig, zero: int, precision: Precision, bucket: int, persistence: int
) -> dict[str, Any]:
    import deepspeed
    import torch.distributed as dist

    torch.manual_seed(0)
    model = SWBertForMaskedLM(config)
    settings: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {
            "stage": zero,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "stage3_prefetch_bucket_size": bucket,
            "stage3_param_persistence_threshold": persistence,
        },
        # A torch Adam: no C++ op to build; the states are the same fp32 m and v.
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "bf16": {"enabled": precision == "bf16"},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=settings)
    del model
    held = 0
    for step in range(2):
        ids = torch.randint(0, config.vocab_size, (2, 64))
        labels = ids.clone()
        labels[:, ::2] = -100
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        del loss
        if step == 1:  # optimizer states exist from the first step; gradients are still held
            gc.collect()
            held = held_tensor_bytes(engine)
        engine.step()
    dp = dist.get_world_size()
    closed_form = model_state_bytes(config, Layout(zero=zero), dp, precision, settings).total
    engine.destroy()
    del engine
    gc.collect()
    return {
        "zero": zero,
        "precision": precision,
        "dp": dp,
        "params": params_per_rank(config),
        "measured_bytes": held,
        "closed_form_bytes": closed_form,
        "relative_error": (closed_form - held) / held,
    }


def tensor_parallel_params(config: SWBertConfig, tp: int) -> dict[str, Any]:
    """Parameters one rank holds after `swbert.parallel.parallelize`, and the closed form."""
    import torch.distributed as dist

    from swbert import parallel

    if not parallel.is_initialized():
        parallel.initialize(tp)
    torch.manual_seed(0)
    model = parallel.parallelize(SWBertForMaskedLM(config), tp)
    held = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
    return {"tp": tp, "rank": dist.get_rank(), "held": held, "closed_form": params_per_rank(config, tp)}


@dataclass
class MemoryCheckConfig:
    """The flags of `python -m swbert.scaling.memory_check`."""

    size: str = "small"  # named model size
    attention_type: list[str] = field(default_factory=lambda: ["shared"])  # variants to check
    vocab_size: int | None = None  # override the vocabulary size
    zero: list[int] = field(default_factory=lambda: [0, 1, 2, 3])  # ZeRO stages to check
    precision: list[Literal["fp32", "bf16"]] = field(default_factory=lambda: ["fp32", "bf16"])
    bucket: int = 1_000_000  # reduce/allgather bucket (elements)
    persistence: int = 100_000  # ZeRO-3 persistence threshold
    tensor_parallel: int = 0  # count TP shards instead (the tensor-parallel size; 0: the ZeRO check)


def main(argv: list[str] | None = None) -> None:
    args = cli.parse_or_exit(MemoryCheckConfig, argv, __doc__, recipes=False)

    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    overrides = {"vocab_size": args.vocab_size} if args.vocab_size else {}
    for attention in args.attention_type:
        config = SWBertConfig.from_size(args.size, attention_type=attention, **overrides)
        if args.tensor_parallel:
            emit({"attention": attention, **tensor_parallel_params(config, args.tensor_parallel)})
            continue
        for zero, precision in itertools.product(args.zero, args.precision):
            row = measure(config, zero, precision, args.bucket, args.persistence)
            if dist.get_rank() == 0:
                emit({"attention": attention, **row})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
