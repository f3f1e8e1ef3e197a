"""A folder of shards as the readers take it: checked before anything opens it."""

from __future__ import annotations

from pathlib import Path

from swbert.data.manifest import TOKENIZER_SUBDIR
from swbert.data.tokenizer import is_tokenizer_folder


def prepare_data(data_dir: str | Path | None, flag: str = "--data-dir") -> Path:
    """A folder of shards to train on (given by `flag`), checked to hold a manifest and the tokenizer.
    Building data is the offline tools' job (`data_prep`; the pretraining entry point builds the
    embedded default corpus)."""
    if data_dir is None:
        raise ValueError(
            "no --data-dir: make shards with `python -m data_prep.preprocess --input FILES --tokenizer "
            "TOK_DIR --output DIR`, or run launchers/pretrain.py, which builds the embedded default corpus"
        )
    path = Path(data_dir)
    if not (path / "manifest.json").is_file():
        raise FileNotFoundError(
            f"{flag} {path} holds no manifest.json: make shards with "
            f"`python -m data_prep.preprocess --input FILES --tokenizer TOK_DIR --output {path}`"
        )
    if not is_tokenizer_folder(path / TOKENIZER_SUBDIR):  # else the export has no tokenizer
        raise FileNotFoundError(
            f"{flag} {path} has no {TOKENIZER_SUBDIR}/ tokenizer (the copy of the tokenizer the "
            f"shards were made with, which checkpoints and exports carry): copy that tokenizer folder to "
            f"{path / TOKENIZER_SUBDIR}, then check it with python -m data_prep.verify {path}"
        )
    return path
