"""Turn any swbert checkpoint (ZeRO stage 0-3) into a Hugging Face folder.

    python -m swbert.training.export runs/mini-shared/checkpoints [--tag step_00001000] --output DIR
    python -m swbert.training.export runs/mini-shared --average 4 --output DIR

`--average K` writes the uniform average, in fp32, of the run's last K complete checkpoints (ours;
each checkpoint's files are checked against their hashes before it is read), with the newest one's
config and tokenizer. A run with `--export-every N` also writes a folder like this one from the
checkpoint of every N-th step, to `exports/step_*/` in the run folder (`export_into_place`).

The folder holds config.json, model.safetensors (fp32), the tokenizer, the model's code and a
README.md on loading it: with swbert installed, `AutoModelForMaskedLM.from_pretrained(DIR)` after
`import swbert`; anywhere else `AutoModelForMaskedLM.from_pretrained(DIR, trust_remote_code=True)` or
`pipeline("fill-mask", model=DIR, trust_remote_code=True)`. A `standard` model also converts to
transformers' own `BertForMaskedLM` (`swbert-convert to-hf DIR OUT`).

Every file of the checkpoint is checked against the hash its marker records before anything reads
it (a damaged one is refused in one line naming the files, exit 2). Nothing in the checkpoint is
unpickled into code: every file (DeepSpeed's zero_to_fp32 included) is read with weights_only=True
(swbert.safe_load), and the weights are written as safetensors.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swbert import cli
from swbert.logs import known_prints_dropped
from swbert.models import SWBertConfig, SWBertForMaskedLM
from swbert.models.attention import attention_class
from swbert.models.remote_code import save_loadable
from swbert.runtime.checkpoint_format import (
    COMPLETE,
    META,
    DamagedCheckpoint,
    OutdatedCheckpoint,
    checkpoint_tags,
    file_hash,
    is_complete,
    require_current,
    require_current_folder,
    require_intact,
)
from swbert.runtime.run_tokenizer import copy_tokenizer, record_tokenizer, tokenizer_for_export
from swbert.safe_load import UnsafeCheckpointError, load, weights_only_loads
from swbert.training.resume import find_checkpoint

log = logging.getLogger("swbert.train")
EXPORTS_DIR = "exports"  # a run folder's exports of --export-every, one step_* folder each
EXPORT_STAMP = "swbert_export.json"  # which checkpoint (and save) an export was written from
AVERAGE_RECORD = "swbert_average.json"  # which checkpoints an --average export averaged


def _full_state_dict(tag_dir: Path) -> dict[str, torch.Tensor]:
    """fp32 weights from the checkpoint: ZeRO shards merged by DeepSpeed's own tool."""
    if list(tag_dir.glob("*optim_states.pt")) and any(
        "zero" in p.name for p in tag_dir.glob("*optim_states.pt")
    ):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with weights_only_loads(), known_prints_dropped(stderr=True):  # its progress (swbert.logs)
            return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    model_file = tag_dir / "mp_rank_00_model_states.pt"
    if not model_file.is_file():
        raise FileNotFoundError(f"{tag_dir} holds no DeepSpeed model states (mp_rank_00_model_states.pt)")
    return load(model_file, map_location="cpu")["module"]


def load_model_from_checkpoint(tag_dir: Path) -> SWBertForMaskedLM:
    meta_file = tag_dir / META
    if not meta_file.is_file():
        raise FileNotFoundError(f"{tag_dir} has no swbert_meta.json: not a complete swbert checkpoint")
    require_current(tag_dir)
    require_intact(
        tag_dir, f"export an earlier checkpoint (--tag step_N of {tag_dir.parent}) or a good copy of it"
    )
    meta = json.loads(meta_file.read_text())
    config = SWBertConfig(**meta["model_config"])
    if meta.get("tensor_parallel", 1) > 1:
        from swbert.parallel.convert import merged_state_dict  # TP shards -> one model

        state = merged_state_dict(tag_dir, config)
    else:
        state = _full_state_dict(tag_dir)
    model = SWBertForMaskedLM(config)
    state = {k: v.float() for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "mlm_head.decoder.weight"]  # tied to the word embedding
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {tag_dir} does not match its config: missing {missing}, unexpected {unexpected}"
        )
    model.tie_weights()
    return model.eval()


def export(
    tag_dir: Path, output: Path, tokenizer_dir: Path | None = None, model: SWBertForMaskedLM | None = None
) -> Path:
    """Write the HF folder for one checkpoint, with its tokenizer's files (only those): from
    `tokenizer_dir`, else from the run folder's `tokenizer/` (see swbert.runtime.run_tokenizer).
    `model` (an average of checkpoints) is written in place of `tag_dir`'s weights.

    A vocabulary padded for training (pad_vocab_multiple) is trimmed back to the tokenizer's size:
    the folder loads as a model of vocab_size ids, in swbert and in plain transformers alike."""
    model = (model if model is not None else load_model_from_checkpoint(tag_dir)).trim_vocab_padding()
    meta = json.loads((tag_dir / META).read_text())
    if tokenizer_dir is not None and not tokenizer_dir.is_dir():
        raise FileNotFoundError(f"--tokenizer {tokenizer_dir} is not a folder")
    tokenizer = tokenizer_dir if tokenizer_dir is not None else tokenizer_for_export(tag_dir, meta)
    save_loadable(model, output)
    if tokenizer is not None:
        copy_tokenizer(tokenizer, output, meta.get("model", {}).get("tokenizer_hash"))
        record_tokenizer(output)  # fine-tuning refuses another vocabulary (swbert.finetune.checkpoint)
    return output


def export_into_place(tag_dir: Path, final: Path, before_replace: Callable[[], None] | None = None) -> Path:
    """`final` exported from `tag_dir`, written next to it and renamed into place, so a kill leaves
    either the previous folder or the new one; skipped when it already holds `tag_dir`: the same
    step saved by the same save (the marker's hash), not a namesake a rewind abandoned.
    `before_replace` runs between the two (a fault drill)."""
    marker = tag_dir / COMPLETE
    source = {"checkpoint": tag_dir.name, "marker": file_hash(marker) if marker.is_file() else None}
    stamp = final / EXPORT_STAMP
    try:
        if json.loads(stamp.read_text()) == source:
            log.info("%s already holds %s", final, tag_dir.name)
            return final
    except (OSError, ValueError):
        pass  # missing, or from an export that did not finish: write it again
    staging, old = final.with_name(f".{final.name}.tmp"), final.with_name(f".{final.name}.old")
    for leftover in (staging, old):
        shutil.rmtree(leftover, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    export(tag_dir, staging)
    (staging / stamp.name).write_text(json.dumps(source))
    if before_replace is not None:
        before_replace()
    if final.exists():
        os.replace(final, old)
    os.replace(staging, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def export_due(step: int, every: int, save_interval: int) -> bool:
    """Whether the checkpoint saved at `step` is exported with --export-every `every` (0: never): the
    first save at or past each multiple of `every` (a save put off by skipped steps lands after it)."""
    return every > 0 and step // every > (step - save_interval) // every


def average_model(tag_dirs: list[Path]) -> SWBertForMaskedLM:
    """The uniform average of the checkpoints' weights, summed and divided in fp32; each checkpoint's
    files are checked against their hashes before it is read (`load_model_from_checkpoint`).
    Checkpoints of different model configs (a change between resumes) are refused."""
    model, total = None, {}
    for tag_dir in tag_dirs:
        current = load_model_from_checkpoint(tag_dir)
        if model is not None and current.config.to_dict() != model.config.to_dict():
            raise ValueError(
                f"{tag_dir} holds another model config than {tag_dirs[0]}: only checkpoints of one model average"
            )
        for name, value in current.state_dict().items():
            if value.is_floating_point():
                total[name] = total[name] + value.float() if name in total else value.float().clone()
        model = current  # the newest (last) keeps its non-float buffers
    assert model is not None, "average_model needs at least one checkpoint"
    model.load_state_dict({name: value / len(tag_dirs) for name, value in total.items()}, strict=False)
    model.tie_weights()
    return model


def last_complete(root: Path, count: int) -> list[Path]:
    """The last `count` complete checkpoints of a run folder or its checkpoints/ folder, oldest
    first; a one-line ValueError naming --average when there are fewer."""
    ckpt_root = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    require_current_folder(ckpt_root)
    complete = [ckpt_root / t for t in checkpoint_tags(ckpt_root) if is_complete(ckpt_root / t)]
    if not 1 <= count <= len(complete):
        raise ValueError(
            f"--average {count}: {ckpt_root} holds {len(complete)} complete checkpoint(s); "
            f"average from 1 to {len(complete)} of them (or save more often with --save-interval)"
        )
    return complete[-count:]


def export_average(tag_dirs: list[Path], output: Path, tokenizer_dir: Path | None = None) -> Path:
    """One Hugging Face folder holding the average of `tag_dirs` (`average_model`), with the newest
    one's config and tokenizer, and a record of which checkpoints it averaged."""
    export(tag_dirs[-1], output, tokenizer_dir, model=average_model(tag_dirs))
    record = {"average": "uniform, fp32", "checkpoints": [t.name for t in tag_dirs]}
    (output / AVERAGE_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return output


@dataclass
class ExportConfig:
    """The flags of `python -m swbert.training.export`."""

    # a checkpoints/ folder (its newest complete checkpoint) or one step_* folder
    checkpoints: Path = field(metadata={"positional": True})
    output: Path  # Hugging Face folder to write
    tag: str | None = None  # which step_* folder (default: the newest complete one)
    tokenizer: Path | None = None  # tokenizer folder (default: the run folder's tokenizer/)
    # write the uniform average of the last K complete checkpoints (fp32; ours) of the run folder or
    # checkpoints/ folder given, in place of one checkpoint
    average: int | None = None


def _tag_dir(args: ExportConfig) -> Path:
    """The step folder to export: --tag's, or the one `--resume` would take from the same path (a
    complete step folder named as is; a checkpoints/ folder's newest complete checkpoint)."""
    if args.tag:
        require_current_folder(args.checkpoints)
        tag_dir = args.checkpoints / args.tag
        if not tag_dir.is_dir():
            raise ValueError(f"{tag_dir} is not a checkpoint folder")
        return tag_dir
    try:
        found = find_checkpoint(str(args.checkpoints), args.checkpoints)
    except FileNotFoundError as err:
        raise ValueError(str(err).replace("--resume ", "", 1)) from None
    if found is None:
        raise ValueError(f"{args.checkpoints} holds no complete checkpoint; pass a step_* folder or --tag")
    return found[0] / found[1]


def main(argv: list[str] | None = None) -> None:
    args = cli.parse_or_exit(ExportConfig, argv, __doc__, recipes=False)
    try:
        if args.average is not None and args.tag:
            raise ValueError(
                f"--average {args.average} and --tag {args.tag}: give one (--average takes the last K)"
            )
        tag_dirs = (
            last_complete(args.checkpoints, args.average) if args.average is not None else [_tag_dir(args)]
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        if args.average is not None:
            out = export_average(tag_dirs, args.output, args.tokenizer)
        else:
            out = export(tag_dirs[0], args.output, args.tokenizer)
    except (UnsafeCheckpointError, OutdatedCheckpoint, DamagedCheckpoint, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    what = (
        tag_dirs[0]
        if len(tag_dirs) == 1
        else f"the average of {', '.join(t.name for t in tag_dirs)} of {tag_dirs[0].parent}"
    )
    print(f"exported {what} -> {out}")
    if attention_class(json.loads((out / "config.json").read_text())["attention_type"]).bert_equivalent:
        print(f"as transformers' BertForMaskedLM: swbert-convert to-hf {out} BERT_FOLDER")


if __name__ == "__main__":
    main()
