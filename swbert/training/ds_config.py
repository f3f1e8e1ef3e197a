"""DeepSpeed configs are filled from the training config, never silently disagreeing with it.

The JSON files in ds_configs/ choose the ZeRO stage, offload and communication settings; batch
sizes, accumulation, clipping and precision come from `TrainConfig`. A field left "auto" (or
absent) is filled; a hard-coded value that disagrees with the training config is an error.
"""

from __future__ import annotations

import copy
import json
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


def _fill(ds: dict[str, Any], key: str, value: Any, source: str, path: str) -> None:
    current = ds.get(key, "auto")
    if current == "auto":
        ds[key] = value
    elif current != value:
        raise ValueError(
            f"{path} sets {key}={current!r} but the training config gives {value!r} ({source}); "
            f'set it to "auto" in the DeepSpeed config and choose the value with --{source.replace("_", "-")}'
        )


def build_ds_config(config: TrainConfig, dp_size: int, precision: str) -> dict[str, Any]:
    """The DeepSpeed config for this run: the template with every managed field filled and checked."""
    path = config.deepspeed_config
    ds = copy.deepcopy(load_ds_config(path))
    for section in ("optimizer", "scheduler"):
        if section in ds:
            raise ValueError(
                f"{path} has a '{section}' section; swbert builds the optimizer and LR schedule from the "
                "training config (--lr, --warmup-steps, --lr-schedule, ...): remove the section"
            )
    global_bs, micro_bs, accum = config.batch_layout(dp_size)
    _fill(ds, "train_batch_size", global_bs, "global_batch_size", path)
    _fill(ds, "train_micro_batch_size_per_gpu", micro_bs, "micro_batch_size", path)
    _fill(ds, "gradient_accumulation_steps", accum, "grad_accum_steps", path)
    _fill(ds, "gradient_clipping", float(config.grad_clip), "grad_clip", path)
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
    if not torch.cuda.is_available():
        offload = ds.get("zero_optimization", {}).get("offload_optimizer", {})
        if offload.get("pin_memory"):
            offload["pin_memory"] = False  # pinned host memory needs a GPU
        param_offload = ds.get("zero_optimization", {}).get("offload_param", {})
        if param_offload.get("pin_memory"):
            param_offload["pin_memory"] = False
    return ds


def zero_stage(ds: dict[str, Any]) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def offloads_optimizer(ds: dict[str, Any]) -> bool:
    device = ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    return device not in (None, "none")
