"""Closed-form memory per rank: model states by ZeRO stage (with offload and tensor parallelism),
DeepSpeed's own estimators, and the activation estimate (`swbert.scaling.activations`). The bytes per
parameter of each stage and offload, as a DeepSpeed engine holds them after `backward`, are in
docs/scaling.md ("Memory per rank by ZeRO stage"); tests/scaling/test_scaling.py measures them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import torch

from swbert.models.attention import attention_class
from swbert.models.config import SWBertConfig
from swbert.models.modeling import SWBertForMaskedLM
from swbert.scaling.activations import (
    Checkpointing,
    Precision,
    check_activation_layout,
    element_bytes,
)

Offload = Literal["none", "optimizer", "params"]
OffloadDevice = Literal["cpu", "nvme"]

GIB = 1024**3
ADAM_BYTES = 8  # fp32 first and second moments
MASTER_BYTES = 4  # fp32 master weights
DEFAULT_REDUCE_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default (elements)
DEFAULT_PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold default
OPTIMIZER_SWAP_BUFFERS = 4  # DeepSpeed's offload_optimizer buffer_count default (fp32 sub-groups)


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor of `SWBertForMaskedLM` and whether tensor parallelism shards it."""

    name: str
    numel: int
    tp_sharded: bool


def model_tensors(config: SWBertConfig) -> list[ParamTensor]:
    """The parameter tensors of `SWBertForMaskedLM` (the tied decoder weight once), read off the
    model built on the meta device (every variant counted as it is built); whether tensor parallelism
    shards one is its plan's say (`swbert.parallel.plan`)."""
    # imported here: swbert.parallel brings megatron-core and DeepSpeed (seconds, import warnings)
    from swbert.parallel.plan import partition_dim

    # built once per model (a grid asks per layout and stage); a name can be registered to another class
    key = (config.to_json_string(use_diff=False), attention_class(config.attention_type))
    if key not in _TENSORS:
        with torch.device("meta"):
            model = SWBertForMaskedLM(config)
        _TENSORS[key] = [
            ParamTensor(name, p.numel(), partition_dim(name, config) is not None)
            for name, p in model.named_parameters()  # unique parameters: the tied decoder weight once
        ]
    return list(_TENSORS[key])


_TENSORS: dict[tuple[str, type], list[ParamTensor]] = {}


def rank_tensor_sizes(config: SWBertConfig, tp: int = 1) -> list[int]:
    """Sizes of the parameter tensors one tensor-parallel rank holds."""
    for name in ("num_attention_heads", "intermediate_size", "padded_vocab_size"):
        if getattr(config, name) % tp:
            raise ValueError(f"tensor parallel size {tp} does not divide {name}={getattr(config, name)}")
    return [t.numel // tp if t.tp_sharded else t.numel for t in model_tensors(config)]


def params_per_rank(config: SWBertConfig, tp: int = 1) -> int:
    """Parameters held by one tensor-parallel rank (the whole model when tp = 1)."""
    return sum(rank_tensor_sizes(config, tp))


@dataclass(frozen=True)
class Layout:
    """A parallel layout: tensor-parallel size, ZeRO stage, what is offloaded and where to, and how
    activations are kept (sequence parallelism, activation checkpointing)."""

    tp: int = 1
    zero: int = 0
    offload: Offload = "none"
    device: OffloadDevice = "cpu"  # where offloaded states go: host memory or NVMe
    sequence_parallel: bool = False  # activations between the tensor-parallel regions split by tp
    checkpointing: Checkpointing = "none"  # activation checkpointing per block: none, full, selective

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {self.tp}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero}")
        if self.offload == "optimizer" and self.zero == 0:
            raise ValueError("optimizer offload needs ZeRO stage 1, 2 or 3")
        if self.offload == "params" and self.zero != 3:
            raise ValueError("parameter offload needs ZeRO stage 3")
        if self.device == "nvme" and self.zero != 3:
            raise ValueError("NVMe offload needs ZeRO stage 3")
        check_activation_layout(self.tp, self.sequence_parallel, self.checkpointing)

    @property
    def name(self) -> str:
        suffix = {"none": "", "optimizer": "-offload", "params": "-offload-params"}[self.offload]
        suffix += "-nvme" if self.device == "nvme" else ""
        suffix += "-sp" if self.sequence_parallel else ""
        suffix += "" if self.checkpointing == "none" else f"-ac-{self.checkpointing}"
        return f"tp{self.tp}-z{self.zero}{suffix}"

    @classmethod
    def parse(
        cls, text: str, sequence_parallel: bool = False, checkpointing: Checkpointing = "none"
    ) -> Layout:
        """`tp2-z1`, `z3-offload`, `tp1-z3-offload-params`, `z3-offload-params-nvme` (tp1 by default),
        optionally with `-sp` (sequence parallelism) and `-ac-full` or `-ac-selective` (activation
        checkpointing), which the name then fixes; otherwise `sequence_parallel` and `checkpointing`."""
        match = re.fullmatch(
            r"(?:tp(\d+)-?)?z([0-3])(-offload(?:-params)?)?(-nvme)?(?:-tp(\d+))?"
            r"(-sp)?(?:-ac-(none|full|selective))?",
            text.strip(),
        )
        if not match or (match.group(4) and not match.group(3)):
            raise ValueError(
                f"layout {text!r} is not like tp2-z1, z2, z3-offload, z3-offload-params, z3-offload-params-nvme, "
                "tp2-z1-sp or z1-ac-full (tensor-parallel size, ZeRO stage, what is offloaded, where to, "
                "sequence parallelism, activation checkpointing)"
            )
        tp = int(match.group(1) or match.group(5) or 1)
        offload = {None: "none", "-offload": "optimizer", "-offload-params": "params"}[match.group(3)]
        device = "nvme" if match.group(4) else "cpu"
        return cls(
            tp=tp,
            zero=int(match.group(2)),
            offload=offload,  # type: ignore[arg-type]
            device=device,  # type: ignore[arg-type]
            sequence_parallel=bool(match.group(6)) or sequence_parallel,
            checkpointing=match.group(7) or checkpointing,  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class StateMemory:
    """Bytes of model states on one rank, split by kind and by where they live."""

    params: float
    grads: float
    master: float
    optimizer: float
    buffers: float
    device: float  # on the accelerator (on CPU-only machines: the same host memory)
    host: float  # in host memory because of offload
    disk: float = 0.0  # on NVMe because of offload

    @property
    def total(self) -> float:
        return self.device + self.host


def model_state_bytes(
    config: SWBertConfig,
    layout: Layout,
    dp: int,
    precision: Precision = "bf16",
    ds_config: dict[str, Any] | None = None,
) -> StateMemory:
    """Model-state bytes of one rank after backward (docs/scaling.md gives them per stage), with the
    bucket, persistence and swap settings of `ds_config` (DeepSpeed's defaults where it has none)."""
    zero = (ds_config or {}).get("zero_optimization", {})
    if dp < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {dp}")
    sizes = rank_tensor_sizes(config, layout.tp)
    n = sum(sizes)
    p = element_bytes(precision)
    shard = 1 if layout.zero == 0 else dp  # stages 1-3 partition gradients and optimizer states
    params, grads = p * n, p * n / shard
    # stages 1-3 keep an fp32 master partition even when training in fp32 (docs/scaling.md)
    master = MASTER_BYTES * n / shard if precision != "fp32" or layout.zero else 0.0
    optimizer, buffers = ADAM_BYTES * n / shard, 0.0
    if layout.zero == 3:
        # Small tensors stay gathered on every rank on top of their partition.
        persistence = zero.get("stage3_param_persistence_threshold", DEFAULT_PERSISTENCE_THRESHOLD)
        params = p * (n / dp + sum(s for s in sizes if s <= persistence))
        buffers = float(p * zero.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET))
    host = disk = 0.0
    if layout.offload != "none":
        # Master weights, Adam states and an fp32 gradient partition for the CPU optimizer.
        host = master + optimizer + 4 * n / dp
        master = optimizer = 0.0
    if layout.offload == "params":
        host += p * n / dp
        params -= p * n / dp
    if layout.device == "nvme":
        # On disk; host memory keeps the swap buffers (DeepSpeed's defaults or the config's).
        sub_group = zero.get("sub_group_size", 1_000_000_000)
        disk, host = host, float(OPTIMIZER_SWAP_BUFFERS * 4 * min(sub_group, n / dp))
        if layout.offload == "params":
            buffer = zero.get("offload_param") or {}
            host += buffer.get("buffer_count", 5) * buffer.get("buffer_size", 100_000_000) * p
    device = params + grads + master + optimizer + buffers
    return StateMemory(params, grads, master, optimizer, buffers, device, host, disk)


def deepspeed_estimate(config: SWBertConfig, layout: Layout, dp: int) -> tuple[float, float] | None:
    """(device, host) bytes from DeepSpeed's own estimators for mixed precision, or None (stage 0/1):
    above `model_state_bytes` by design (the peak inside the step, host memory padded by 1.5x)."""
    n = params_per_rank(config, layout.tp)
    offload = layout.offload != "none"
    if layout.zero == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        host, device = estimate_zero2_model_states_mem_needs(n, dp, 1, cpu_offload=offload)
        return float(device), float(host)
    if layout.zero == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        largest = max(rank_tensor_sizes(config, layout.tp))
        host, device, _ = estimate_zero3_model_states_mem_needs(
            n, largest, dp, 1, cpu_offload=offload, cpu_offload_params=layout.offload == "params"
        )
        return float(device), float(host)
    return None
