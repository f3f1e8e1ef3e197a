"""The scaling grid: sizes x attention variants x parallel layouts (ZeRO stage, tensor parallelism,
offload, sequence parallelism, activation checkpointing), and each point's closed forms: parameters,
FLOPs per token, the compute-optimal budget (about 20 tokens per parameter), memory per rank by ZeRO
stage, DeepSpeed's estimate and the activations (docs/scaling.md)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from swbert.models.attention import attention_types
from swbert.models.config import SWBertConfig, check_size
from swbert.models.flops import masked_lm_flops, masked_lm_params
from swbert.models.plugins import load_installed
from swbert.runtime.ds_config import load_ds_config
from swbert.scaling.activations import Checkpointing, activation_memory
from swbert.scaling.memory import (
    GIB,
    Layout,
    Precision,
    StateMemory,
    deepspeed_estimate,
    model_state_bytes,
    params_per_rank,
)

TOKENS_PER_PARAM = 20  # compute-optimal tokens per parameter (Chinchilla)
BERT_VOCAB = 30522


def ds_config_for(layout: Layout, nvme_path: str = "runs/nvme") -> dict[str, Any]:
    """A DeepSpeed config for the layout's ZeRO stage and offload: the communication settings of
    ds_configs/ (the trainer fills batch sizes, clipping and precision, "auto")."""
    ds = load_ds_config("ds_configs/zero3.json" if layout.zero == 3 else "ds_configs/zero1.json")
    zero = ds["zero_optimization"]
    zero["stage"] = layout.zero
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
    for text, sp, mode in itertools.product(layouts, sequence_parallel, checkpointing):
        try:
            out.append(Layout.parse(text, sp, mode))
        except ValueError as err:
            raise ValueError(f"--layouts {text}: {err}") from None
    return list(dict.fromkeys(out))


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
    """All combinations, sizes outermost, the layouts crossed with `sequence_parallel` and `checkpointing`."""
    check_names(sizes, attentions)
    parsed = expand_layouts(layouts, sequence_parallel, checkpointing)
    return [
        GridPoint(size, attention, layout, seq_len, micro_batch, precision)
        for size in sizes
        for attention in attentions
        for layout in parsed
    ]


def _columns(point: GridPoint, gpus: int, dp: int) -> dict[str, Any]:
    """The columns that name a point: its fields, its layout's and the devices."""
    layout = point.layout
    return {
        "name": point.name,
        **asdict(point),
        "layout": layout.name,
        "tp": layout.tp,
        "zero": layout.zero,
        "offload": layout.offload,
        "sequence_parallel": layout.sequence_parallel,
        "activation_checkpointing": layout.checkpointing,
        "gpus": gpus,
        "dp": dp,
    }


def _states(config: SWBertConfig, layout: Layout, dp: int, precision: Precision) -> StateMemory:
    """Model-state bytes of `layout` with its generated DeepSpeed config's settings."""
    return model_state_bytes(config, layout, dp, precision, ds_config_for(layout))


def estimate(
    point: GridPoint,
    gpus: int,
    vocab_size: int = BERT_VOCAB,
    fused_attention: bool = True,
) -> dict[str, Any]:
    """The closed-form figures of one point on `gpus` devices (`fused_attention` False: a CPU's)."""
    layout = point.layout
    if gpus % layout.tp:
        raise ValueError(f"{point.name}: {gpus} GPUs are not divisible by tensor-parallel size {layout.tp}")
    dp = gpus // layout.tp
    config = point.model_config(vocab_size)
    params, per_rank = masked_lm_params(config), params_per_rank(config, layout.tp)
    flops = masked_lm_flops(config, point.seq_len).training
    mine = _states(config, layout, dp, point.precision)
    activations = activation_memory(
        config,
        point.seq_len,
        point.micro_batch,
        point.precision,
        layout.tp,
        layout.sequence_parallel,
        layout.checkpointing,
        "gpu" if fused_attention else "cpu",
    )
    acts = activations.peak  # kept for the backward, plus one block recomputed
    ds = deepspeed_estimate(config, layout, dp) or (None, None)
    return {
        **_columns(point, gpus, dp),
        "vocab_size": vocab_size,
        "params": params,
        "params_per_rank": per_rank,
        "train_flops_per_token": flops,
        "compute_optimal_tokens": TOKENS_PER_PARAM * params,
        "compute_optimal_flops": TOKENS_PER_PARAM * params * flops,
        "mem_params_gib": mine.params / GIB,
        "mem_grads_gib": mine.grads / GIB,
        "mem_optimizer_gib": (mine.master + mine.optimizer) / GIB,
        "mem_buffers_gib": mine.buffers / GIB,
        "mem_activations_gib": acts / GIB,
        "mem_activations_kept_gib": activations.kept / GIB,
        "mem_recompute_gib": activations.recompute / GIB,
        "mem_device_gib": (mine.device + acts) / GIB,
        "mem_host_gib": mine.host / GIB,
        "disk_gib": mine.disk / GIB,
        # The trainer builds the whole fp32 model on every rank before DeepSpeed partitions it.
        "mem_init_gib": 4 * per_rank / GIB,
        **{
            f"mem_z{k}_gib": (_states(config, Layout(layout.tp, k), dp, point.precision).device + acts) / GIB
            for k in range(4)
        },
        "ds_estimate_device_gib": None if ds[0] is None else ds[0] / GIB,
        "ds_estimate_host_gib": None if ds[1] is None else ds[1] / GIB,
    }
