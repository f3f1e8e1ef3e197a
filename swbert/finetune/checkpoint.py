"""Loading pretrained (or fine-tuned) checkpoints, pretraining's exports, with their tokenizer,
checked before any training against the common mix-ups (another run's or vocabulary's tokenizer)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoTokenizer

from swbert import SWBertConfig
from swbert.models.remote_code import add_remote_code
from swbert.runtime.ranks import ParallelDims
from swbert.runtime.run_tokenizer import tokenizer_fingerprint

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint folder (or its tokenizer) that cannot be used as asked."""


class Checkpoint(NamedTuple):
    """A named checkpoint: ``name`` labels the table row (a variant), ``path`` the folder."""

    name: str
    path: Path

    @property
    def config(self) -> SWBertConfig:
        return SWBertConfig.from_pretrained(self.path)


def parse_checkpoints(specs: list[str], unique: bool = True) -> list[Checkpoint]:
    """``PATH`` or ``NAME=PATH`` -> checkpoints, a bare path named by its attention type; with ``unique``
    (not for fine-tuned folders: a name per variant) no two may share a name, the rows and folders of both."""
    out: list[Checkpoint] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = "", spec
        folder = Path(path)
        if not (folder / "config.json").is_file():
            raise CheckpointError(
                f"--checkpoint {spec}: {folder}/config.json not found; pass an exported model folder"
            )
        if not name:
            name = SWBertConfig.from_pretrained(folder).attention_type
        if not re.fullmatch(r"[A-Za-z0-9_.+-]+", name):
            raise CheckpointError(f"--checkpoint {spec}: name {name!r} may only use letters, digits and _.+-")
        if unique and name in {c.name for c in out}:
            raise CheckpointError(
                f"two checkpoints are both named {name!r}: pass them as NAME=PATH with distinct names"
            )
        out.append(Checkpoint(name, folder))
    return out


def load_tokenizer(folder: str | Path, tokenizer_path: str | Path | None = None, allow_change: bool = False):
    """The checkpoint's tokenizer (or ``tokenizer_path``), refused when it cannot be the model's; with
    ``allow_change`` another vocabulary than the recorded one is used, with a warning."""
    folder = Path(folder)
    source = Path(tokenizer_path) if tokenizer_path else folder
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except Exception as e:
        raise CheckpointError(
            f"{source}: no loadable tokenizer ({e}); the export folder should hold the tokenizer files"
        ) from e
    config = SWBertConfig.from_pretrained(folder)
    if len(tok) > config.vocab_size:
        raise CheckpointError(
            f"{source}: the tokenizer has {len(tok)} tokens but the model in {folder} has "
            f"vocab_size={config.vocab_size}; it is the tokenizer of another model"
        )
    if tok.pad_token_id is None or tok.pad_token_id != config.pad_token_id:
        raise CheckpointError(
            f"{source}: the tokenizer's [PAD] id is {tok.pad_token_id} but the model in {folder} uses "
            f"pad_token_id={config.pad_token_id}; it is the tokenizer of another model"
        )
    saved = getattr(config, "tokenizer_sha256", None)
    if saved and saved != tokenizer_fingerprint(tok):
        message = (
            f"{source}: the tokenizer's vocabulary differs from the one recorded in {folder}/config.json "
            "(tokenizer_sha256): the model would read other ids than it was trained on"
        )
        if not allow_change:
            raise CheckpointError(f"{message}; pass the model's own tokenizer, or --allow-tokenizer-change")
        log.warning("%s; used anyway (--allow-tokenizer-change)", message)
    return tok


def save_finetuned(model, tokenizer, folder: str | Path) -> None:
    """A fine-tuned model, its tokenizer and its vocabulary's hash saved by rank 0, awaited by all."""
    if ParallelDims.from_env().is_main:
        model.config.tokenizer_sha256 = tokenizer_fingerprint(tokenizer)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        add_remote_code(folder)  # the heads load without swbert too (trust_remote_code)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def uses_token_types(config: SWBertConfig) -> bool:
    """Whether to feed segment ids: a model with one token type would index past its table."""
    return getattr(config, "type_vocab_size", 2) > 1
