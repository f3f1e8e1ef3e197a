"""Whether a checkpoint can resume this run: the same model, tensor-parallel size and the settings
exact resume depends on, each difference refused in one line naming the flag or command that fixes
it (part of `swbert.training.resume.resolve_resume`'s decision)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch

from swbert.runtime.checkpoint_format import META, is_universal


def check_compatible(
    tag_dir: Path, meta: dict[str, Any], allow: list[str] | tuple[str, ...] = (), tensors: bool = True
) -> list[str]:
    """Refuse a checkpoint of another model shape, parallel layout or training setting, naming what
    differs. Returns the changes `allow` let through ("key: saved -> now"), for the run's records.
    Reads the meta file, and with `tensors` the model file's tensor names: call it once their hashes
    are checked (`swbert.training.resume`)."""
    saved_path = tag_dir / META
    if not saved_path.is_file():
        raise FileNotFoundError(f"{tag_dir} has no swbert_meta.json: not a complete swbert checkpoint")
    saved = json.loads(saved_path.read_text())
    diffs = [
        f"{key}: checkpoint {saved['model'].get(key)!r} vs this run {value!r}"
        for key, value in meta["model"].items()
        if saved["model"].get(key) != value
    ]
    if diffs:
        raise ValueError(
            f"checkpoint {tag_dir} is of a different model ({'; '.join(diffs)}); resume with the same "
            "--size/--attention-type/data, or start a new --output-dir"
        )
    if "model_config" in meta:
        _check_model_fields(tag_dir, saved.get("model_config", {}), meta["model_config"])
    if saved.get("tensor_parallel", 1) != meta.get("tensor_parallel", 1) and not is_universal(tag_dir):
        raise ValueError(
            f"checkpoint {tag_dir} was saved with --tensor-parallel {saved.get('tensor_parallel', 1)} but this run "
            f"uses {meta.get('tensor_parallel', 1)}; convert it first: python -m swbert.parallel.convert universal "
            f"{tag_dir.parent} NEW_DIR --tag {tag_dir.name}, then pass --resume NEW_DIR"
        )
    if "model_config" in meta and tensors:
        check_parameter_names(tag_dir, meta["model_config"])
    return _check_run_settings(tag_dir, saved.get("run"), meta.get("run"), allow)


# Model-config fields the training config sets that change the model's tensors or what attends to
# what, with the value a checkpoint that does not record them was made with.
MODEL_FIELDS = {
    "shared_bias": True,
    "pad_vocab_multiple": 1,
    "position_embedding": "learned",
    "local_attention_window": None,
    "global_attention_every": 3,
}


def _check_model_fields(tag_dir: Path, saved: dict[str, Any], now: dict[str, Any]) -> None:
    diffs = {
        k: (saved.get(k, default), now.get(k, default))
        for k, default in MODEL_FIELDS.items()
        if saved.get(k, default) != now.get(k, default)
    }
    if diffs:
        flags = " ".join(f"--{k.replace('_', '-')} {str(a).lower()}" for k, (a, _) in diffs.items())
        raise ValueError(
            f"checkpoint {tag_dir} is of a different model ("
            + "; ".join(f"{k}: checkpoint {a!r} vs this run {b!r}" for k, (a, b) in diffs.items())
            + f"); resume it with {flags}, or start a new --output-dir"
        )


def _saved_parameter_names(tag_dir: Path) -> set[str] | None:
    """Names of the tensors a DeepSpeed checkpoint holds (None if it holds no model file)."""
    if is_universal(tag_dir):
        return {p.name for p in (tag_dir / "zero").iterdir() if (p / "fp32.pt").is_file()}
    files = sorted(tag_dir.glob("*mp_rank_00_model_states.pt"))
    if not files:
        return None
    try:  # memory-mapped: only the names are read, not the weights; no pickled code runs
        module = torch.load(files[0], map_location="cpu", weights_only=True, mmap=True).get("module")
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, AttributeError):
        return None  # a file this check cannot read safely, or a damaged one: the hash check decides
    return {k for k, v in module.items() if isinstance(v, torch.Tensor)} if isinstance(module, dict) else None


def check_parameter_names(tag_dir: Path, model_config: dict[str, Any]) -> None:
    """Refuse a checkpoint holding tensors the model has not (another model's): DeepSpeed would load
    its ZeRO optimizer state, flat buffers in that model's parameter order, onto the wrong entries.
    (One of an older swbert is refused before this, naming the upgrade command: `require_current`.)"""
    from swbert.models import SWBertConfig, SWBertForMaskedLM

    saved = _saved_parameter_names(tag_dir)
    if saved is None:
        return
    with torch.device("meta"):
        model = SWBertForMaskedLM(SWBertConfig.from_dict(model_config))
    unknown = sorted(saved - set(model.state_dict()))
    if unknown:
        raise ValueError(
            f"checkpoint {tag_dir} holds tensors this model has not ({', '.join(unknown[:3])}"
            f"{', ...' if len(unknown) > 3 else ''}): it is another model's. Resume it with the "
            "--size/--attention-type it was trained with, or start a new --output-dir"
        )


def _check_run_settings(
    tag_dir: Path,
    saved: dict[str, Any] | None,
    now: dict[str, Any] | None,
    allow: list[str] | tuple[str, ...],
) -> list[str]:
    """The settings exact resume depends on (recorded since checkpoint format 2)."""
    if saved is None or now is None:
        return []
    changed = {k: (saved[k], now.get(k)) for k in saved if k in now and saved[k] != now[k]}
    layout = [k for k in ("zero_stage", "data_parallel") if k in changed]
    if layout and not is_universal(tag_dir):
        what = "; ".join(f"{k} {changed[k][0]} -> {changed[k][1]}" for k in layout)
        raise ValueError(
            f"checkpoint {tag_dir} was saved with another ZeRO stage or data-parallel size ({what}); DeepSpeed "
            f"cannot reshard it as it is. Convert it first: python -m swbert.parallel.convert universal "
            f"{tag_dir.parent} NEW_DIR --tag {tag_dir.name}, then pass --resume NEW_DIR"
        )
    if "optimizer" in changed:  # its state has another form: no flag can carry it over
        saved_kind, kind = changed["optimizer"]
        raise ValueError(
            f"checkpoint {tag_dir} holds the state of --optimizer {saved_kind}, which --optimizer {kind} "
            f"cannot load; resume with --optimizer {saved_kind}, or start a new --output-dir"
        )
    refused = {k: v for k, v in changed.items() if k not in layout and k not in allow}
    if refused:
        what = "; ".join(f"{k}: checkpoint {a!r} vs this run {b!r}" for k, (a, b) in refused.items())
        raise ValueError(
            f"resuming {tag_dir} would change what exact resume depends on ({what}). Run with the "
            f"checkpoint's settings, or pass --allow-resume-change {','.join(refused)} to change them on purpose"
        )
    return [f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items() if k not in layout]
