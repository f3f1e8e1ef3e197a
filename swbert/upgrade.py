"""Rewrite the checkpoints an older swbert wrote into today's format, once.

    python -m swbert.upgrade PATH [--dry-run] [--tokenizer DIR]

PATH is a run folder (`<run>/checkpoints/step_N`), its checkpoints/ folder or one step folder. Every
step folder in an old form is rewritten; one line per folder says what changed. What is old
(`swbert.runtime.checkpoint_format.outdated` names it; training, conversion and export refuse it,
naming this command):

    checkpoint format 1     no completeness marker: the marker is written, with every file's hash
                            (and the client state's count of skipped steps, 0: format 1 kept none)
    absolute tokenizer      the meta named the data folder's tokenizer by an absolute path: its
                            tokenizer files (the recorded sha256 checked) are copied into
                            <run>/tokenizer and the meta names that, relative to the run; a path that
                            is gone and no --tokenizer DIR: no tokenizer is recorded (say so)
    NumPy RNG files         rng_rank*.pt held NumPy arrays: rewritten as tensors and plain values,
                            which load with weights_only=True and no NumPy types allowed
    converted, no marker    a universal checkpoint `swbert.parallel.convert universal` wrote before
                            conversions recorded hashes (no marker, or its source's): the marker is
                            written, with every file's hash
    separate projections    q_proj, k_proj, v_proj from before their fusion into in_proj: ZeRO keeps
                            the optimizer state in flat buffers in the old parameter order, so the
                            checkpoint becomes a universal one (one folder per parameter) with the
                            fused tensors, weights and Adam moments alike; it resumes at any size

Nothing is lost: a folder is rewritten in a staging copy beside it and swapped in when complete;
the original is kept as <checkpoints>/pre-upgrade/step_N (an earlier copy there is never
overwritten: the upgrade refuses instead). A second run finds nothing to do.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from deepspeed.checkpoint import constants as ds_ckpt

from swbert import cli
from swbert.data.tokenizer import SPM_MODEL_NAME, tokenizer_hash
from swbert.fsutil import fsync_path
from swbert.logs import setup_logging
from swbert.models import SWBertConfig
from swbert.models.attention import attention_class, pack_heads, pack_state_dict
from swbert.runtime.checkpoint_format import (
    COMPLETE,
    TAG_RE,
    checkpoint_tags,
    is_complete,
    is_universal,
    outdated,
    read_meta,
    separate_projections,
)
from swbert.runtime.run_tokenizer import keep_in_run, run_folder
from swbert.safe_load import load
from swbert.training.checkpoint import mark_complete
from swbert.training.compat import MODEL_FIELDS

PRE_UPGRADE = "pre-upgrade"  # where the original of each rewritten step folder is kept


def step_folders(path: Path) -> list[Path]:
    """The step folders PATH names: itself, those of a checkpoints/ folder, or of a run folder's."""
    if TAG_RE.match(path.name) and path.is_dir():
        return [path]
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    tags = checkpoint_tags(root)
    if not tags:
        raise FileNotFoundError(
            f"{path}: no step_* checkpoint folders (pass a run, checkpoints/ or step folder)"
        )
    return [root / tag for tag in tags]


def upgrade(tag_dir: Path, tokenizer: Path | None = None, dry_run: bool = False) -> list[str]:
    """Rewrite one step folder into today's format; returns what changed ([]: nothing to do). With
    `dry_run`, what would change, and nothing is written."""
    found = outdated(tag_dir)
    if not found or dry_run:
        return found
    backup = tag_dir.parent / PRE_UPGRADE / tag_dir.name
    if backup.exists():
        raise ValueError(
            f"{backup} exists (an earlier upgrade's original): move it elsewhere first, the upgrade "
            "never overwrites a kept original"
        )
    with tempfile.TemporaryDirectory(dir=tag_dir.parent, prefix=".upgrade-") as work:
        staged = Path(work) / tag_dir.name
        shutil.copytree(tag_dir, staged, symlinks=True)
        changes = rewrite(staged, run_folder(tag_dir), tokenizer)
        backup.parent.mkdir(exist_ok=True)
        os.replace(tag_dir, backup)
        os.replace(staged, tag_dir)
        fsync_path(tag_dir.parent)
    return changes


def rewrite(staged: Path, run: Path, tokenizer: Path | None) -> list[str]:
    """Today's format in the staging copy `staged` of a step folder of `run`; returns what changed."""
    meta = read_meta(staged)
    if meta is None:
        raise ValueError(
            f"{staged.name}: no readable swbert_meta.json, so not a swbert checkpoint to upgrade"
        )
    changes = []
    format1 = (
        "checkpoint_format" not in meta and not (staged / COMPLETE).is_file()
    )  # before a conversion adds one
    if is_universal(staged) and "checkpoint_format" in meta and not is_complete(staged):
        changes.append("converted checkpoint: completeness marker written, with every file's hash")
    if _rng_as_tensors(staged):
        changes.append("RNG files: NumPy arrays -> tensors")
    tokenizer_dir = meta.get("tokenizer_dir")
    if isinstance(tokenizer_dir, str) and Path(tokenizer_dir).is_absolute():
        meta["tokenizer_dir"], note = _tokenizer_in_run(tokenizer_dir, meta, run, tokenizer)
        changes.append(note)
    config = SWBertConfig.from_dict(meta["model_config"])
    separate = separate_projections(staged, meta)
    if separate:
        staged = _fused_universal(staged, config)
        changes.append(f"{', '.join(separate)} -> in_proj (now a universal checkpoint, optimizer state too)")
    for key, value in MODEL_FIELDS.items():  # what a checkpoint that did not record them was made with
        meta["model_config"].setdefault(key, value)
    if format1:
        _count_skipped_steps(staged)
        changes.append("format 1 -> 2: skipped-step count and completeness marker written")
    (staged / COMPLETE).unlink(missing_ok=True)  # rewritten below: the files and hashes changed
    mark_complete(staged, int(meta.get("step", 0)), meta)
    return changes


def _count_skipped_steps(tag_dir: Path) -> None:
    """Format 2's client state counts the steps skipped for non-finite losses; format 1 did not."""
    for path in sorted(tag_dir.glob("*model_states.pt")):
        state = load(path, map_location="cpu")
        if "skipped_total" not in state:
            torch.save({**state, "skipped_total": 0}, path)


def _rng_as_tensors(tag_dir: Path) -> bool:
    """Rewrite RNG files that hold NumPy arrays (before the states were stored as tensors)."""
    numpy_core = getattr(np, "_core", None) or np.core  # renamed in NumPy 2
    legacy = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), numpy_core.multiarray._reconstruct]
    changed = False
    for path in sorted(tag_dir.glob("rng_rank*.pt")):
        with torch.serialization.safe_globals(legacy):  # the arrays only: weights_only still
            state = torch.load(path, weights_only=True)
        name, keys, *rest = state["numpy"]
        if isinstance(keys, np.ndarray):
            state["numpy"] = (name, torch.from_numpy(keys.astype(np.int64)), *rest)
            torch.save(state, path)
            changed = True
    return changed


def _tokenizer_in_run(recorded: str, meta: dict[str, Any], run: Path, given: Path | None) -> tuple[Any, str]:
    """(the meta's new tokenizer_dir, what was done): the recorded folder's tokenizer (or `given`),
    if it is the one the checkpoint was trained with, copied into the run folder."""
    expected = meta.get("model", {}).get("tokenizer_hash")
    for folder in (Path(recorded), given):
        if folder is not None and (folder / SPM_MODEL_NAME).is_file() and tokenizer_hash(folder) == expected:
            kept = keep_in_run(folder, run, write=True)
            return kept, f"tokenizer: {folder} copied into {run / str(kept)}, recorded relative to the run"
    return None, (
        f"tokenizer: {recorded} no longer holds the run's tokenizer, none recorded (pass --tokenizer DIR "
        "to keep it in the run; an export takes --tokenizer DIR too)"
    )


def _fused_universal(staged: Path, config: SWBertConfig) -> Path:
    """A universal checkpoint of `staged` with the separate projections fused (`pack_heads`), put
    in its place; its RNG files and metadata travel along."""
    from swbert.parallel.convert import universal_files  # megatron-core: imported once logging is set

    out = staged.parent / "universal"
    universal_files(staged.parent, out, staged.name, config)
    converted = out / staged.name
    fuse_universal(converted, config)
    fuse_model_states(converted, config)
    for item in staged.iterdir():
        # the RNG files; not the old optimizer partitions (their flat buffers are in zero/ now)
        if (
            item.is_file()
            and not (converted / item.name).exists()
            and not item.name.endswith("optim_states.pt")
        ):
            shutil.copy2(item, converted / item.name)
    shutil.rmtree(staged)
    os.replace(converted, staged)
    return staged


def fuse_universal(tag_dir: Path, config: SWBertConfig) -> list[str]:
    """Fuse the per-parameter folders of the separate projections (q_proj, k_proj, v_proj) of a
    universal checkpoint into the fused one's (`in_proj`). Returns the fused names.

    Every file packs alike: the fp32 weights and Adam's moments are elementwise, so the moments of a
    fused entry are those of the separate entry it came from (`pack_heads`); the step is shared."""
    zero = tag_dir / "zero"
    done = []
    for fused, parts in attention_class(config.attention_type).packed.items():
        for first in sorted(zero.glob(f"*.attn.{parts[0]}.*")):
            prefix, kind = first.name.rsplit(f".{parts[0]}.", 1)
            folders = [zero / f"{prefix}.{part}.{kind}" for part in parts]
            if not all(f.is_dir() for f in folders):
                continue
            target = zero / f"{prefix}.{fused}.{kind}"
            target.mkdir()
            for file in sorted(p.name for p in first.iterdir()):
                states = [load(f / file, map_location="cpu") for f in folders]
                packed = states[0]
                if isinstance(packed, dict) and isinstance(packed.get(ds_ckpt.PARAM), torch.Tensor):
                    tensors = [st[ds_ckpt.PARAM] for st in states]
                    packed = {**packed, ds_ckpt.PARAM: pack_heads(tensors, config.head_dim)}
                torch.save(packed, target / file)
            for f in folders:
                shutil.rmtree(f)
            done.append(target.name)
    return done


def fuse_model_states(tag_dir: Path, config: SWBertConfig) -> None:
    """The model files' weights and parameter shapes with the fused projections (DeepSpeed loads the
    weights strictly, and zero_to_fp32 reads the shapes)."""
    packed = attention_class(config.attention_type).packed
    prefixes = [f"bert.encoder.layers.{i}.attn." for i in range(config.num_hidden_layers)]
    for path in sorted(tag_dir.glob("*model_states.pt")):
        state = load(path, map_location="cpu")
        for prefix in prefixes:
            pack_state_dict(state["module"], prefix, packed, config.head_dim)
        state["param_shapes"] = [
            _fused_shapes(group, prefixes, packed) for group in state.get("param_shapes") or []
        ]
        torch.save(state, path)


def _fused_shapes(shapes: dict[str, Any], prefixes: list[str], packed: dict[str, Any]) -> dict[str, Any]:
    """One group's {name: shape}, the separate projections replaced by the fused one where the
    first of them stood (rows add up: the fused matrix stacks them)."""
    out: dict[str, Any] = {}
    for name, shape in shapes.items():
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        module, _, kind = name[len(prefix) :].partition(".") if prefix else ("", "", "")
        fused = next((f for f, parts in packed.items() if module in parts), None)
        if fused is None:
            out[name] = shape
            continue
        key = f"{prefix}{fused}.{kind}"
        rows = out[key][0] + shape[0] if key in out else shape[0]
        out[key] = torch.Size([rows, *shape[1:]])
    return out


@dataclass
class UpgradeConfig:
    """The flags of `python -m swbert.upgrade`."""

    path: str = field(metadata={"positional": True})  # a run folder, its checkpoints/ or a step folder
    dry_run: bool = False  # say what would change, write nothing
    tokenizer: str | None = None  # the run's tokenizer, when the absolute path a checkpoint records is gone


def main(argv: list[str] | None = None) -> None:
    setup_logging()  # first: the known noise of DeepSpeed's and megatron-core's imports dropped
    args = cli.parse_or_exit(UpgradeConfig, argv, __doc__, recipes=False)
    tokenizer = Path(args.tokenizer) if args.tokenizer else None
    cli.exit_on_bad_input(lambda: _upgrade_all(Path(args.path), tokenizer, args.dry_run))


def _upgrade_all(path: Path, tokenizer: Path | None, dry_run: bool) -> None:
    for tag_dir in step_folders(path):
        changes = upgrade(tag_dir, tokenizer, dry_run)
        if not changes:
            print(f"{tag_dir}: today's format, nothing to do")
        else:
            print(f"{tag_dir}: {'would change' if dry_run else 'upgraded'}: {'; '.join(changes)}")


if __name__ == "__main__":
    main()
