"""The scaling grid: sizes x attention variants x parallel layouts (ZeRO stage, tensor parallelism,
offload, sequence parallelism, activation checkpointing), and each point's closed forms: parameters,
FLOPs per token, the compute-optimal budget (about 20 tokens per parameter), memory per rank by ZeRO
stage, DeepSpeed's estimate and the activations (docs/scaling.md)."""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from swbert.models.attention import attention_types
from swbert.models.config import SWBertConfig, check_size
from swbert.models.flops import masked_lm_flops, masked_lm_params
from swbert.models.plugins import load_installed
from swbert.scaling.activations import Checkpointing, activation_memory
from swbert.scaling.memory import (
    GIB,
    Layout,
    Precision,
    deepspeed_estimate,
    model_state_bytes,
    params_per_rank,
    zero_config_values,
)

TOKENS_PER_PARAM = 20  # compute-optimal tokens per parameter (Chinchilla)
BERT_VOCAB = 30522

# Communication settings of every generated DeepSpeed config (those of ds_configs/); the trainer
# fills batch sizes, clipping and precision ("auto").
DS_TEMPLATE: dict[str, Any] = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "zero_optimization": {
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 20_000_000,
        "allgather_bucket_size": 50_000_000,
        "stage3_param_persistence_threshold": 100_000,
    },
    "steps_per_print": 1_000_000_000,
    "wall_clock_breakdown": False,
}


def ds_config_for(layout: Layout, nvme_path: str = "runs/nvme") -> dict[str, Any]:
    """A DeepSpeed config for the layout's ZeRO stage and offload (batch and precision: "auto")."""
    ds = copy.deepcopy(DS_TEMPLATE)
    zero = ds["zero_optimization"]
    zero["stage"] = layout.zero
    if layout.zero < 3:
        del zero["stage3_param_persistence_threshold"]
    else:
        del zero["allgather_bucket_size"]
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    target: dict[str, Any] = {"device": layout.device, "pin_memory": True}
    if layout.device == "nvme":
        target["nvme_path"] = nvme_path
        # Swap sub-groups of 100M elements: bounds the optimizer's host buffers (4 x 400 MB).
        zero["sub_group_size"] = 100_000_000
        # Release every parameter right after use: one kept for reuse (the tied embedding, the
        # last layers before backward) holds a swap buffer, and the swapper runs out of them.
        zero["stage3_max_reuse_distance"] = 0
        ds["aio"] = {
            "block_size": 1_048_576,
            "queue_depth": 8,
            "single_submit": False,
            "overlap_events": True,
        }
    if layout.offload != "none":
        zero["offload_optimizer"] = {**target, "buffer_count": 4}
    if layout.offload == "params":
        zero["offload_param"] = {**target, "buffer_count": 8, "buffer_size": 100_000_000, "max_in_cpu": 0}
    return ds


def write_ds_config(layout: Layout, folder: Path, nvme_path: Path | None = None) -> Path:
    """The layout's DeepSpeed config as folder/LAYOUT.json (NVMe swap files under `nvme_path`)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{layout.name}.json"
    nvme = nvme_path or folder.parent / "nvme"
    if layout.device == "nvme":
        nvme.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ds_config_for(layout, str(nvme)), indent=2) + "\n")
    return path


def activation_args(layout: Layout) -> list[str]:
    """The `launchers/pretrain.py` flags that keep activations as `layout` says."""
    return [
        "--sequence-parallel", str(layout.sequence_parallel).lower(),
        "--activation-checkpointing", layout.checkpointing,
    ]  # fmt: skip


@dataclass(frozen=True)
class GridPoint:
    """One point of the study: model size, attention variant, layout and the batch shape."""

    size: str
    attention: str
    layout: Layout
    seq_len: int = 128
    micro_batch: int = 8
    precision: Precision = "bf16"

    @property
    def name(self) -> str:
        return f"{self.size}-{self.attention}-{self.layout.name}"

    def model_config(self, vocab_size: int = BERT_VOCAB) -> SWBertConfig:
        return SWBertConfig.from_size(
            self.size,
            attention_type=self.attention,
            vocab_size=vocab_size,
            max_position_embeddings=max(512, self.seq_len),
        )


def expand_layouts(
    layouts: Sequence[str],
    sequence_parallel: Sequence[bool] = (False,),
    checkpointing: Sequence[Checkpointing] = ("none",),
) -> list[Layout]:
    """Every layout name with every value of `sequence_parallel` and `checkpointing`, each once (a name
    that says `-sp` or `-ac-MODE` keeps its own); a combination the trainer refuses is an error."""
    out: list[Layout] = []
    for text in layouts:
        for sp in sequence_parallel:
            for mode in checkpointing:
                try:
                    layout = Layout.parse(text, sp, mode)
                except ValueError as err:
                    raise ValueError(f"--layouts {text}: {err}") from None
                if layout not in out:
                    out.append(layout)
    return out


def check_names(sizes: Sequence[str], attentions: Sequence[str]) -> None:
    """Unknown sizes and attention variants are errors that list the known ones."""
    for size in sizes:
        check_size(size, "--sizes")
    load_installed()  # variants of installed packages (swbert.models.plugins)
    for name in attentions:
        if name not in attention_types():
            raise ValueError(
                f"--attentions {name}: not a registered attention variant; known: "
                f"{', '.join(attention_types())} (add one with --plugins)"
            )


def build_grid(
    sizes: list[str],
    attentions: list[str],
    layouts: list[str],
    seq_len: int = 128,
    micro_batch: int = 8,
    precision: Precision = "bf16",
    sequence_parallel: Sequence[bool] = (False,),
    checkpointing: Sequence[Checkpointing] = ("none",),
) -> list[GridPoint]:
    """All combinations, sizes outermost (`check_names`). `sequence_parallel` and `checkpointing` are
    crossed with the layouts (`expand_layouts`)."""
    check_names(sizes, attentions)
    parsed = expand_layouts(layouts, sequence_parallel, checkpointing)
    return [
        GridPoint(size, attention, layout, seq_len, micro_batch, precision)
        for size in sizes
        for attention in attentions
        for layout in parsed
    ]


def _point_columns(point: GridPoint, gpus: int, dp: int) -> dict[str, Any]:
    """The columns that name a point: its fields and its layout's, the devices."""
    layout = point.layout
    return {
        "name": point.name,
        "size": point.size,
        **{k: v for k, v in asdict(point).items() if k not in ("size", "layout")},
        "layout": layout.name,
        "tp": layout.tp,
        "zero": layout.zero,
        "offload": layout.offload,
        "sequence_parallel": layout.sequence_parallel,
        "activation_checkpointing": layout.checkpointing,
        "gpus": gpus,
        "dp": dp,
    }


def estimate(
    point: GridPoint,
    gpus: int,
    vocab_size: int = BERT_VOCAB,
    fused_attention: bool = True,
) -> dict[str, Any]:
    """The closed-form figures of one point on `gpus` devices; `fused_attention`: count the
    activations a GPU keeps (False: a CPU's)."""
    layout = point.layout
    if gpus % layout.tp:
        raise ValueError(f"{point.name}: {gpus} GPUs are not divisible by tensor-parallel size {layout.tp}")
    dp = gpus // layout.tp
    config = point.model_config(vocab_size)
    params = masked_lm_params(config)
    flops = masked_lm_flops(config, point.seq_len).training
    settings = zero_config_values(ds_config_for(layout))
    states = model_state_bytes(config, layout, dp, point.precision, **settings)
    acts_by_part = activation_memory(
        config,
        point.seq_len,
        point.micro_batch,
        point.precision,
        layout.tp,
        layout.sequence_parallel,
        layout.checkpointing,
        device="gpu" if fused_attention else "cpu",
    )
    acts = acts_by_part.peak  # kept for the backward, plus one block recomputed
    tokens = TOKENS_PER_PARAM * params
    row: dict[str, Any] = {
        **_point_columns(point, gpus, dp),
        "vocab_size": vocab_size,
        "params": params,
        "params_per_rank": params_per_rank(config, layout.tp),
        "train_flops_per_token": flops,
        "compute_optimal_tokens": tokens,
        "compute_optimal_flops": tokens * flops,
        "mem_params_gib": states.params / GIB,
        "mem_grads_gib": states.grads / GIB,
        "mem_optimizer_gib": (states.master + states.optimizer) / GIB,
        "mem_buffers_gib": states.buffers / GIB,
        "mem_activations_gib": acts / GIB,
        "mem_activations_kept_gib": acts_by_part.kept / GIB,
        "mem_recompute_gib": acts_by_part.recompute / GIB,
        "mem_device_gib": (states.device + acts) / GIB,
        "mem_host_gib": states.host / GIB,
        "disk_gib": states.disk / GIB,
        # The trainer builds the whole fp32 model on every rank before DeepSpeed partitions it.
        "mem_init_gib": 4 * params_per_rank(config, layout.tp) / GIB,
    }
    for stage in range(4):
        other = Layout(tp=layout.tp, zero=stage)
        other_settings = zero_config_values(ds_config_for(other))
        other_states = model_state_bytes(config, other, dp, point.precision, **other_settings)
        row[f"mem_z{stage}_gib"] = (other_states.device + acts) / GIB
    ds = deepspeed_estimate(config, layout, dp)
    row["ds_estimate_device_gib"] = ds[0] / GIB if ds else None
    row["ds_estimate_host_gib"] = ds[1] / GIB if ds else None
    return row
