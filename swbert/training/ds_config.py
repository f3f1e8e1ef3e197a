"""DeepSpeed configs are filled from the training config, never silently disagreeing with it.

The JSON files in ds_configs/ choose the ZeRO stage, offload and communication settings; batch
sizes, accumulation, clipping and precision come from `TrainConfig`. A field left "auto" (or
absent) is filled; a hard-coded value that disagrees with the training config is an error.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swbert.training.config import TrainConfig, ds_config_dirs


def resolve_precision(requested: str, on_gpu: bool) -> str:
    """auto -> bf16 on GPU, fp32 on CPU. fp16 needs a GPU (DeepSpeed refuses it on CPU)."""
    if requested == "auto":
        return "bf16" if on_gpu else "fp32"
    if requested == "fp16" and not on_gpu:
        raise ValueError("--precision fp16 needs a GPU (DeepSpeed has no fp16 on CPU); use bf16 or fp32")
    return requested


def find_ds_config(path: str | Path) -> Path:
    """The file a `--deepspeed-config` value names.

    An existing path wins. A bare name (`zero2.json`) or the recipes' `ds_configs/<name>` form that
    does not exist from the working directory is looked up among the shipped configs, so a run
    works from any folder with a non-editable install; any other missing path is an error.
    """
    p = Path(path)
    if p.is_file():
        return p
    dirs = ds_config_dirs()
    if p.parent in (Path(), Path("ds_configs")):
        for folder in dirs:
            if (folder / p.name).is_file():
                return folder / p.name
    shipped = sorted({x.name for folder in dirs for x in folder.glob("*.json")})
    raise FileNotFoundError(
        f"--deepspeed-config {path} not found; give an existing JSON file or the name of a shipped "
        f"one ({', '.join(shipped) or 'none found: reinstall swbert'})"
    )


def load_ds_config(path: str | Path) -> dict[str, Any]:
    p = find_ds_config(path)
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"--deepspeed-config {p}: invalid JSON ({err})") from None


@dataclass(frozen=True)
class BatchShape:
    """Sequences per optimizer step over all ranks, per forward pass on one rank, and the number
    of micro-batches accumulated per step (global = micro x data-parallel ranks x accumulation)."""

    global_batch: int
    micro_batch: int
    accum: int


@dataclass(frozen=True)
class Flags:
    """The command-line flags that set each managed value, for error messages."""

    global_batch: str = "--global-batch-size"
    micro_batch: str = "--micro-batch-size"
    accum: str = "--grad-accum-steps"
    grad_clip: str = "--grad-clip"
    lr: str = "the training config (--lr, --warmup-steps, --lr-schedule, ...)"
    source: str = "the training config gives"
    job: str = "pretraining"


def build_ds_config(
    path: str | Path,
    batch: BatchShape,
    grad_clip: float,
    precision: str,
    flags: Flags = Flags(),
    max_zero_stage: int = 3,
) -> dict[str, Any]:
    """The DeepSpeed config for a run: the JSON template (a path or a shipped name) with every
    managed field filled, and any hard-coded value that disagrees with the run an error naming the
    flag that sets it. Pretraining and fine-tuning both build theirs here."""
    ds = copy.deepcopy(load_ds_config(path))
    for section in ("optimizer", "scheduler"):
        if section in ds:
            raise ValueError(
                f"{path} has a '{section}' section; swbert builds the optimizer and LR schedule from "
                f"{flags.lr}: remove the '{section}' section"
            )
    stage = zero_stage(ds)
    if stage > max_zero_stage:
        raise ValueError(
            f"{path}: ZeRO stage {stage} is not supported for {flags.job}; use stage 0-{max_zero_stage} "
            f"(e.g. zero{min(max_zero_stage, 2)}.json)"
        )
    managed = [
        ("train_batch_size", batch.global_batch, flags.global_batch),
        ("train_micro_batch_size_per_gpu", batch.micro_batch, flags.micro_batch),
        ("gradient_accumulation_steps", batch.accum, flags.accum),
        ("gradient_clipping", float(grad_clip), flags.grad_clip),
    ]
    for key, value, flag in managed:
        current = ds.get(key, "auto")
        if current == "auto":
            ds[key] = value
        elif current != value:
            raise ValueError(
                f"{path} sets {key}={current!r} but {flags.source} {value!r}; set it to "
                f'"auto" in the DeepSpeed config and choose the value with {flag}'
            )
    for dtype in ("bf16", "fp16"):
        section = ds.setdefault(dtype, {})
        wanted = precision == dtype
        enabled = section.get("enabled", "auto")
        if enabled == "auto":
            section["enabled"] = wanted
        elif bool(enabled) != wanted:
            raise ValueError(
                f"{path} sets {dtype}.enabled={enabled} but the run's precision is {precision}; "
                f'set "enabled": "auto" or pass --precision {dtype if enabled else precision}'
            )
    if not torch.cuda.is_available():  # pinned host memory needs a GPU
        for offload in ("offload_optimizer", "offload_param"):
            target = ds.get("zero_optimization", {}).get(offload, {})
            if target.get("pin_memory"):
                target["pin_memory"] = False
    return ds


def pretraining_ds_config(config: TrainConfig, dp_size: int, precision: str) -> dict[str, Any]:
    """The pretraining run's DeepSpeed config: batch shape, clipping and precision from `config`."""
    batch = BatchShape(*config.batch_layout(dp_size))
    return build_ds_config(config.deepspeed_config, batch, config.grad_clip, precision)


def zero_stage(ds: dict[str, Any]) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def offloads_optimizer(ds: dict[str, Any]) -> bool:
    device = ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    return device not in (None, "none")
