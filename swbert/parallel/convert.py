"""Convert DeepSpeed checkpoints between tensor-parallel sizes and into Hugging Face folders.

python -m swbert.parallel.convert universal CKPT_DIR OUT_DIR [--tag T] [--config config.json]
    Any TP / DP size and ZeRO stage -> a universal checkpoint, with optimizer state, that resumes at
    any tensor- and data-parallel size (DeepSpeed config: "checkpoint": {"load_universal": true}).
python -m swbert.parallel.convert hf CKPT_DIR OUT_DIR [--tag T] [--config config.json] [--tokenizer DIR]
    A TP=k checkpoint (any ZeRO stage, or a universal one) -> a merged Hugging Face folder, the
    export's: with the model code, a README.md and the run's tokenizer (or --tokenizer DIR).
python -m swbert.parallel.convert reshard CKPT_DIR OUT_DIR --tensor-parallel K [--tag T]
    Weights only, for a checkpoint saved without swbert's client state: TP=k -> TP=K DeepSpeed
    files; load with engine.load_checkpoint(OUT_DIR, load_module_only=True).

CKPT_DIR is the folder given to `engine.save_checkpoint`; the tag defaults to its `latest`. A
checkpoint an older swbert wrote is refused, naming `python -m swbert.upgrade`, which rewrites it.
Every file of a swbert checkpoint is checked against the hash its marker records before anything
reads it (a damaged or incomplete one is refused in one line, exit 2); the checkpoints written here
(universal, reshard) carry a marker with every file's hash, as a save does.
The model config comes from the checkpoint's swbert_meta.json or `--config`. Every file is
read with weights_only=True (swbert.safe_load, DeepSpeed's converter included): nothing pickled runs.
"""

from __future__ import annotations

import argparse  # DeepSpeed's universal-checkpoint converter takes its arguments as a Namespace
import copy
import json
import logging
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from deepspeed.checkpoint import constants as ds_ckpt

from swbert import cli
from swbert.models import SWBertConfig, SWBertForMaskedLM
from swbert.parallel.checkpoint import (
    CONFIG_KEY,
    merge_state_dicts,
    model_state_files,
    resolve_tag,
    shard_state_dict,
    universal_checkpoint_info,
)
from swbert.runtime.checkpoint_format import (
    COMPLETE,
    LATEST,
    META,
    TAG_RE,
    DamagedCheckpoint,
    OutdatedCheckpoint,
    read_meta,
    require_current,
    require_intact,
    write_marker,
)
from swbert.safe_load import UnsafeCheckpointError, load, weights_only_loads

log = logging.getLogger("swbert.convert")
INSTEAD = "convert an earlier checkpoint (--tag) or a good copy of this one"


def _checked(ckpt_dir: str | Path, tag: str | None) -> str:
    """The tag to convert, once its checkpoint is today's form and every file matches its hash."""
    tag = resolve_tag(ckpt_dir, tag)
    require_current(Path(ckpt_dir) / tag)
    require_intact(Path(ckpt_dir) / tag, INSTEAD)
    return tag


def _load(path: Path) -> dict:
    return load(path, map_location="cpu")


def _config(saved: dict, config: SWBertConfig | None, tag_dir: Path) -> SWBertConfig:
    """`config`, else the one recorded in the checkpoint (the trainer's metadata file next to
    DeepSpeed's, or a client state that holds one). A copy: converting never changes the caller's
    (`to_hf` trims the vocabulary padding of the model it builds, and so its config)."""
    if config is not None:
        return copy.deepcopy(config)
    if CONFIG_KEY in saved:
        return SWBertConfig.from_dict(saved[CONFIG_KEY])
    if (tag_dir / META).is_file():
        return SWBertConfig.from_dict(json.loads((tag_dir / META).read_text())[CONFIG_KEY])
    raise ValueError(
        f"{tag_dir} does not record the model config (no {META}: not saved by swbert's trainer); "
        "pass --config path/to/config.json"
    )


def merged_state_dict(tag_dir: str | Path, config: SWBertConfig) -> dict[str, torch.Tensor]:
    """The TP=1 weights of one checkpoint folder (`<dir>/<tag>`): any TP size, any ZeRO stage.

    ZeRO 0-2 checkpoints hold each TP rank's weights in its model file; ZeRO-3 ones only in the
    optimizer partitions, which DeepSpeed's universal conversion reassembles (in a temporary
    folder, with the layout derived from `config`).
    """
    tag_dir = Path(tag_dir)
    if (tag_dir / "zero").is_dir():  # universal: full fp32 tensors, one folder per parameter
        folders = sorted(p for p in (tag_dir / "zero").iterdir() if (p / "fp32.pt").is_file())
        return {p.name: _load(p / "fp32.pt")[ds_ckpt.PARAM] for p in folders}
    shards = [_load(f)["module"] for f in model_state_files(tag_dir.parent, tag_dir.name)]
    if any(t.numel() == 0 for t in shards[0].values() if isinstance(t, torch.Tensor)):  # ZeRO-3 placeholders
        with tempfile.TemporaryDirectory() as tmp:
            universal_files(tag_dir.parent, tmp, tag_dir.name, config)
            return merged_state_dict(Path(tmp) / tag_dir.name, config)
    return merge_state_dicts(shards, config)


def full_state_dict(
    ckpt_dir: str | Path, tag: str | None = None, config: SWBertConfig | None = None
) -> tuple[dict[str, torch.Tensor], SWBertConfig]:
    """The merged TP=1 weights and the model config of a DeepSpeed checkpoint (plain or universal)."""
    tag = resolve_tag(ckpt_dir, tag)
    config = _config(_load(model_state_files(ckpt_dir, tag)[0]), config, Path(ckpt_dir) / tag)
    return merged_state_dict(Path(ckpt_dir) / tag, config), config


def to_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    tag: str | None = None,
    config: SWBertConfig | None = None,
    tokenizer: str | Path | None = None,
) -> Path:
    """Write the Hugging Face folder an export writes (config.json, model.safetensors, the model code,
    README.md and the tokenizer: `tokenizer`, else the run's, as `swbert.training.export` finds it)
    with the merged weights."""
    from swbert.models.remote_code import save_loadable
    from swbert.runtime.run_tokenizer import copy_tokenizer, record_tokenizer, tokenizer_for_export

    tag = _checked(ckpt_dir, tag)
    state, config = full_state_dict(ckpt_dir, tag, config)
    model = SWBertForMaskedLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(model._tied_weights_keys)
    if set(missing) - tied or unexpected:
        raise ValueError(f"checkpoint does not match the config: missing {missing}, unexpected {unexpected}")
    model.trim_vocab_padding()  # the folder's tables match the tokenizer (vocab_size rows)
    save_loadable(model, out_dir)  # loadable without swbert too, with trust_remote_code
    meta_file = Path(ckpt_dir) / tag / META
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    if tokenizer is None:
        tokenizer = tokenizer_for_export(Path(ckpt_dir) / tag, meta)
    if tokenizer is None:
        log.warning("%s: no tokenizer found for the checkpoint: pass --tokenizer DIR to add one", out_dir)
    else:
        copy_tokenizer(Path(tokenizer), Path(out_dir), meta.get("model", {}).get("tokenizer_hash"))
        record_tokenizer(Path(out_dir))  # fine-tuning refuses another vocabulary
    return Path(out_dir)


def to_universal(
    ckpt_dir: str | Path, out_dir: str | Path, tag: str | None = None, config: SWBertConfig | None = None
) -> Path:
    """DeepSpeed's `ds_to_universal` on one checkpoint; OUT_DIR/<tag> resumes at any size.

    The parameter layout comes from the checkpoint when DeepSpeed's `universal_checkpoint_info` is
    in it, else is derived from the model config (`config`, or the one recorded in the checkpoint).
    """
    tag = _checked(ckpt_dir, tag)
    return universal_files(ckpt_dir, out_dir, tag, config)


def universal_files(
    ckpt_dir: str | Path, out_dir: str | Path, tag: str, config: SWBertConfig | None = None
) -> Path:
    """`to_universal` on whatever form the checkpoint's files have (swbert.upgrade converts an old
    one with it): DeepSpeed's files are converted as they are, swbert's metadata copied along."""
    from deepspeed.checkpoint import ds_to_universal

    source = Path(ckpt_dir) / tag
    first = _load(model_state_files(ckpt_dir, tag)[0])
    with tempfile.TemporaryDirectory() as staging:
        if ds_ckpt.UNIVERSAL_CHECKPOINT_INFO not in first:
            source = _with_layout(source, Path(staging) / tag, _config(first, config, source))
        args = argparse.Namespace(
            input_folder=str(source),
            output_folder=str(Path(out_dir) / tag),
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=False,
        )
        with weights_only_loads():
            ds_to_universal.main(args)  # also writes OUT_DIR/latest_universal
    for meta in (Path(ckpt_dir) / tag).glob("*.json"):  # the trainer's metadata travels along
        if meta.name != COMPLETE:  # the source's marker: it lists the source's files
            shutil.copy2(meta, Path(out_dir) / tag / meta.name)
    write_marker(Path(out_dir) / tag, _step(Path(ckpt_dir) / tag))  # last: the conversion is complete
    return Path(out_dir)


def _with_layout(tag_dir: Path, staging: Path, config: SWBertConfig) -> Path:
    """A view of `tag_dir` (links) whose model files also carry the universal-checkpoint layout."""
    staging.mkdir(parents=True)
    layout = universal_checkpoint_info(config)
    for f in tag_dir.iterdir():
        if f.name.endswith("model_states.pt"):
            torch.save({**_load(f), ds_ckpt.UNIVERSAL_CHECKPOINT_INFO: layout}, staging / f.name)
        else:
            (staging / f.name).symlink_to(f.resolve())
    return staging


# Per-file metadata that describes the saved shapes; it would be wrong for the new size.
_SHAPE_KEYS = ("module", "param_shapes", "frozen_param_shapes", "frozen_param_fragments", "shared_params")


def reshard(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    tp_size: int,
    tag: str | None = None,
    config: SWBertConfig | None = None,
) -> Path:
    """Weights-only DeepSpeed files for TP=`tp_size` (no optimizer state)."""
    tag = _checked(ckpt_dir, tag)
    state, config = full_state_dict(ckpt_dir, tag, config)
    meta = {k: v for k, v in _load(model_state_files(ckpt_dir, tag)[0]).items() if k not in _SHAPE_KEYS}
    folder = Path(out_dir) / tag
    folder.mkdir(parents=True, exist_ok=True)
    for rank in range(tp_size):
        shard = shard_state_dict(state, rank, tp_size, config)
        torch.save(
            {**meta, "module": shard, "mp_world_size": tp_size},
            folder / f"mp_rank_{rank:02d}_model_states.pt",
        )
    write_marker(folder, _step(Path(ckpt_dir) / tag))
    (Path(out_dir) / LATEST).write_text(tag)
    return Path(out_dir)


def _step(tag_dir: Path) -> int:
    """The step a checkpoint was saved at (its meta file's, else its tag's; 0 when neither says)."""
    step = (read_meta(tag_dir) or {}).get("step")
    if isinstance(step, int):
        return step
    named = TAG_RE.match(tag_dir.name)
    return int(named.group(1)) if named else 0


@dataclass
class CheckpointConvertConfig:
    """The flags of `python -m swbert.parallel.convert`."""

    # universal: resumable at any TP/DP size, with optimizer state; hf: a merged Hugging Face folder;
    # reshard: weights-only DeepSpeed files for another TP size
    command: Literal["universal", "hf", "reshard"] = field(metadata={"positional": True})
    ckpt_dir: str = field(metadata={"positional": True})  # folder given to engine.save_checkpoint
    out_dir: str = field(metadata={"positional": True})  # folder to write
    tag: str | None = None  # checkpoint tag (default: the one in CKPT_DIR/latest)
    config: str | None = None  # config.json, if the checkpoint lacks it
    tensor_parallel: int | None = None  # reshard (required there): the tensor-parallel size to write
    tokenizer: str | None = None  # hf: the tokenizer folder to add (default: the run's tokenizer/)

    def check(self) -> None:
        if (self.command == "reshard") != (self.tensor_parallel is not None):
            raise ValueError("--tensor-parallel K goes with reshard, and only with it")
        if self.tokenizer is not None and self.command != "hf":
            raise ValueError("--tokenizer DIR goes with hf, and only with it")


def main(argv: list[str] | None = None) -> None:
    args = cli.parse_or_exit(CheckpointConvertConfig, argv, __doc__, recipes=False)
    config = SWBertConfig.from_json_file(args.config) if args.config else None
    try:
        out = _convert(args, config)
    except (UnsafeCheckpointError, OutdatedCheckpoint, DamagedCheckpoint) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {out}")


def _convert(args: CheckpointConvertConfig, config: SWBertConfig | None) -> Path:
    if args.command == "universal":
        return to_universal(args.ckpt_dir, args.out_dir, args.tag, config)
    if args.command == "hf":
        return to_hf(args.ckpt_dir, args.out_dir, args.tag, config, args.tokenizer)
    assert args.tensor_parallel is not None  # check()
    return reshard(args.ckpt_dir, args.out_dir, args.tensor_parallel, args.tag, config)


if __name__ == "__main__":
    main()
