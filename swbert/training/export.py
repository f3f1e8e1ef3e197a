"""Turn any swbert checkpoint (ZeRO stage 0-3) into a Hugging Face folder.

    python -m swbert.training.export runs/mini-shared/checkpoints [--tag step_00001000] --output DIR

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
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swbert import cli
from swbert.logs import known_prints_dropped
from swbert.models import SWBertConfig, SWBertForMaskedLM
from swbert.models.attention import attention_class
from swbert.models.remote_code import save_loadable
from swbert.runtime.checkpoint_format import (
    META,
    DamagedCheckpoint,
    OutdatedCheckpoint,
    require_current,
    require_current_folder,
    require_intact,
)
from swbert.runtime.run_tokenizer import copy_tokenizer, tokenizer_for_export
from swbert.safe_load import UnsafeCheckpointError, load, weights_only_loads
from swbert.training.resume import find_checkpoint


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


def export(tag_dir: Path, output: Path, tokenizer_dir: Path | None = None) -> Path:
    """Write the HF folder for one checkpoint, with its tokenizer's files (only those): from
    `tokenizer_dir`, else from the run folder's `tokenizer/` (see swbert.runtime.run_tokenizer).

    A vocabulary padded for training (pad_vocab_multiple) is trimmed back to the tokenizer's size:
    the folder loads as a model of vocab_size ids, in swbert and in plain transformers alike."""
    model = load_model_from_checkpoint(tag_dir).trim_vocab_padding()
    meta = json.loads((tag_dir / META).read_text())
    if tokenizer_dir is not None and not tokenizer_dir.is_dir():
        raise FileNotFoundError(f"--tokenizer {tokenizer_dir} is not a folder")
    tokenizer = tokenizer_dir if tokenizer_dir is not None else tokenizer_for_export(tag_dir, meta)
    save_loadable(model, output)
    if tokenizer is not None:
        copy_tokenizer(tokenizer, output, meta.get("model", {}).get("tokenizer_hash"))
    return output


@dataclass
class ExportConfig:
    """The flags of `python -m swbert.training.export`."""

    # a checkpoints/ folder (its newest complete checkpoint) or one step_* folder
    checkpoints: Path = field(metadata={"positional": True})
    output: Path  # Hugging Face folder to write
    tag: str | None = None  # which step_* folder (default: the newest complete one)
    tokenizer: Path | None = None  # tokenizer folder (default: the run folder's tokenizer/)


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
        tag_dir = _tag_dir(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        out = export(tag_dir, args.output, args.tokenizer)
    except (UnsafeCheckpointError, OutdatedCheckpoint, DamagedCheckpoint) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"exported {tag_dir} -> {out}")
    if attention_class(json.loads((out / "config.json").read_text())["attention_type"]).bert_equivalent:
        print(f"as transformers' BertForMaskedLM: swbert-convert to-hf {out} BERT_FOLDER")


if __name__ == "__main__":
    main()
