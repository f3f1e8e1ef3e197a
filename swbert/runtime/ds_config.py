"""DeepSpeed configs are filled from a run's own settings, never silently disagreeing with them.

The JSON files in ds_configs/ choose the ZeRO stage, offload and communication settings; batch
sizes, accumulation, clipping and precision come from the run (pretraining's `TrainConfig`,
fine-tuning's flags), through `BatchShape` and `Flags`. A field left "auto" (or
absent) is filled; a hard-coded value that disagrees with the training config is an error.

Two settings are swbert's on every config it writes (`run_settings`), since DeepSpeed's defaults
cost a GPU run time or accuracy: the throughput timer is off (on, it synchronises the device twice
per micro-batch), and bf16 runs accumulate gradients in fp32 at ZeRO stages 2-3 and reduce them in
bf16. A template that brings back per-tensor loops or per-micro-batch syncs gets one warning per key
at start (`host_cost_warnings`). docs/performance.md ("DeepSpeed settings for GPUs") gives the reasons.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


def ds_config_dirs() -> list[Path]:
    """Where shipped DeepSpeed configs are looked up by name, first match wins.

    A checkout's (or editable install's) top-level `ds_configs/`, the folder users edit, comes first;
    a wheel carries a copy of it as `swbert/ds_configs/` (see setup.py), found from any directory.
    """
    package = Path(__file__).resolve().parents[1]
    candidates = [package.parent / "ds_configs", package / "ds_configs"]
    return [d for d in candidates if d.is_dir() and any(d.glob("*.json"))]


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
    run_settings(ds, precision, batch.accum, path)
    for warning in host_cost_warnings(ds, precision, batch.accum):
        log.warning("%s: %s", path, warning)
    if not torch.cuda.is_available():  # pinned host memory needs a GPU
        for offload in ("offload_optimizer", "offload_param"):
            target = ds.get("zero_optimization", {}).get(offload, {})
            if target.get("pin_memory"):
                target["pin_memory"] = False
    return ds


def run_settings(
    ds: dict[str, Any], precision: str, accum: int, path: str | Path = "the DeepSpeed config"
) -> None:
    """swbert's settings on top of the template, in place.

    - The throughput timer off: DeepSpeed's `ThroughputTimer` is on and synchronised by default and
      calls `synchronize()` at the start and end of every micro-batch (engine forward and step);
      swbert measures throughput from its own wall clock at log intervals. A template that turns
      it on explicitly (`"timers": {"throughput": {"enabled": true}}`) keeps it.
    - bf16: gradients accumulated over micro-batches in fp32 at ZeRO stages 2 and 3
      (`data_types.grad_accum_dtype`) and reduced across ranks in bf16 (`communication_data_type`),
      where the template leaves them unset or "auto". bf16 keeps 8 bits of mantissa: a sum over 16
      micro-batches in it loses the low bits of every gradient, while one bf16 rounding of the
      reduced sum costs 2**-9 relative and halves the bytes sent (ours: tests/runtime/
      test_flat_grads.py bounds it against an fp32 reduction). DeepSpeed 0.19.8 refuses
      fp32 accumulation of bf16 gradients without ZeRO, and at stage 1 provides it only through its
      BF16_Optimizer, whose checkpoints its own zero_to_fp32 cannot read (the export would fail):
      stages 0 and 1 accumulate in bf16.
    """
    throughput = ds.setdefault("timers", {}).setdefault("throughput", {})
    if throughput.get("enabled") is not True:
        throughput.update(enabled=False, synchronized=False)
    if precision != "bf16":
        return
    if ds.get("communication_data_type", "auto") == "auto":
        ds["communication_data_type"] = "bf16"
    data_types = ds.setdefault("data_types", {})
    wanted = data_types.get("grad_accum_dtype", "auto")
    stage = zero_stage(ds)
    if stage >= 2:
        if wanted == "auto":
            data_types["grad_accum_dtype"] = "fp32"
    else:
        if wanted not in ("auto", "bf16", "bfloat16"):
            why = (
                "which DeepSpeed refuses without ZeRO"
                if stage == 0
                else "which DeepSpeed provides only through its BF16_Optimizer, whose checkpoints its "
                "zero_to_fp32 cannot read (the run's export would fail)"
            )
            raise ValueError(
                f"{path} sets data_types.grad_accum_dtype={wanted!r} at ZeRO stage {stage} in bf16, {why}; "
                "remove it, or use ZeRO stage 2 (ds_configs/zero2.json), which accumulates bf16 gradients in fp32"
            )
        if wanted == "auto":
            data_types.pop("grad_accum_dtype", None)  # DeepSpeed's default: the model's dtype
        if accum > 1:
            log.info(
                "ZeRO stage %d in bf16 sums the %d micro-batches of each step in bf16; ZeRO stage 2 "
                "(ds_configs/zero2.json) sums them in fp32",
                stage,
                accum,
            )
    if not data_types:
        del ds["data_types"]


def flat_gradients_apply(ds: dict[str, Any], precision: str) -> bool:
    """Whether a filled config gets swbert's flat ZeRO-2 gradients (`swbert.runtime.flat_grads`)."""
    zero = ds.get("zero_optimization", {})
    return (
        precision == "bf16"
        and zero_stage(ds) == 2
        and ds.get("data_types", {}).get("grad_accum_dtype") in ("fp32", "float32")
        and not offloads_optimizer(ds)
        and not zero.get("round_robin_gradients", False)
    )


def host_cost_warnings(ds: dict[str, Any], precision: str, accum: int) -> list[str]:
    """What a filled config brings back of the per-tensor loops and host syncs swbert's configs avoid
    (docs/performance.md): one line per key, naming its cost and the fix."""
    zero, stage, flat = ds.get("zero_optimization", {}), zero_stage(ds), flat_gradients_apply(ds, precision)
    warnings = []
    if precision == "bf16" and str(ds.get("communication_data_type")).lower() in ("fp32", "float32", "float"):
        warnings.append(
            "communication_data_type=fp32 sends every bf16 gradient in fp32: twice the bytes of each "
            'reduction; remove it (swbert reduces in bf16 after fp32 accumulation) or set "bf16"'
        )
    if stage == 2 and precision == "bf16" and zero.get("round_robin_gradients"):
        warnings.append(
            "zero_optimization.round_robin_gradients=true turns off swbert's flat ZeRO-2 gradients: a hook, "
            "a copy and an add per parameter tensor every micro-batch, six host syncs per step; remove it"
        )
    if stage >= 1 and not flat and zero.get("contiguous_gradients") is False:
        warnings.append(
            "zero_optimization.contiguous_gradients=false makes DeepSpeed flatten and copy the gradients "
            "tensor by tensor at every reduction; set it true"
        )
    if stage >= 2 and not flat and accum > 1 and precision != "fp32" and zero.get("overlap_comm"):
        warnings.append(
            f"zero_optimization.overlap_comm=true with {accum} micro-batches a step: on a GPU DeepSpeed "
            f"synchronises the device after every backward ({accum} host syncs a step); set it false, "
            "or use ZeRO stage 2 in bf16 (ds_configs/zero2.json), whose flat gradients have none"
        )
    return warnings


def zero_stage(ds: dict[str, Any]) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def offloads_optimizer(ds: dict[str, Any]) -> bool:
    device = ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    return device not in (None, "none")
