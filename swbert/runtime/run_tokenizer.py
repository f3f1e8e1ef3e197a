"""The tokenizer a run trains with, kept in its run folder: tokenizer files only.

At start, rank 0 copies the data's tokenizer files into `<output_dir>/tokenizer/` and checkpoints
record `tokenizer_dir: "tokenizer"`, relative to the run folder (`<run>/checkpoints/step_N` ->
`<run>`). An export takes the tokenizer from there, and only from there: a recorded path that
leaves the run folder, or a folder that holds anything but tokenizer files, is refused. Before,
the checkpoint recorded the data folder's absolute path and the export copied whatever that folder
held into the model folder and MLflow (`swbert_tokenizer.json` with the corpus paths of the machine
that trained the tokenizer, for one). A checkpoint from before, with an absolute path, is refused
naming `python -m swbert.upgrade`, which copies that tokenizer into the run folder.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from swbert.data.tokenizer import HF_TOKENIZER_FILES, SPM_MODEL_NAME, tokenizer_hash
from swbert.runtime.checkpoint_format import OutdatedCheckpoint, newest_complete, upgrade_command

log = logging.getLogger(__name__)

RUN_TOKENIZER_DIR = "tokenizer"
TOKENIZER_NAMES = frozenset(HF_TOKENIZER_FILES)
TOKENIZER_PATTERNS = ("*.model", "*.vocab")  # SentencePiece: spm.model, and its piece list


def is_tokenizer_file(name: str) -> bool:
    return name in TOKENIZER_NAMES or any(fnmatch.fnmatchcase(name, p) for p in TOKENIZER_PATTERNS)


def tokenizer_files(folder: Path) -> tuple[list[Path], list[str]]:
    """(the tokenizer files of `folder`, the names of everything else in it). A link counts as
    something else: its target could be anywhere."""
    files, others = [], []
    for item in sorted(folder.iterdir()):
        if item.is_file() and not item.is_symlink() and is_tokenizer_file(item.name):
            files.append(item)
        else:
            others.append(item.name)
    return files, others


def _same_files(a: Path, b: Path) -> bool:
    names_a = [p.name for p in tokenizer_files(a)[0]]
    names_b = [p.name for p in tokenizer_files(b)[0]]
    return names_a == names_b and all((a / n).read_bytes() == (b / n).read_bytes() for n in names_a)


def keep_in_run(source: Path | None, output_dir: Path, write: bool) -> str | None:
    """The tokenizer path to record in checkpoints, relative to the run folder (None without a
    tokenizer). With `write` (rank 0), copy `source`'s tokenizer files to `<output_dir>/tokenizer/`
    first, atomically; a run folder that already holds another tokenizer is refused once it has
    checkpoints that were trained with that one."""
    if source is None:
        return None
    if not write:
        return RUN_TOKENIZER_DIR
    files, skipped = tokenizer_files(source)
    if not files:
        raise ValueError(f"{source} holds no tokenizer files ({', '.join(sorted(TOKENIZER_NAMES))}, *.model)")
    target = output_dir / RUN_TOKENIZER_DIR
    staging = output_dir / f".{RUN_TOKENIZER_DIR}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for item in files:
        shutil.copyfile(item, staging / item.name)
    if target.exists():
        if _same_files(staging, target):
            shutil.rmtree(staging)
            return RUN_TOKENIZER_DIR
        trained = newest_complete(output_dir / "checkpoints")
        if trained is not None:
            shutil.rmtree(staging)
            raise ValueError(
                f"{target} holds another tokenizer than the data's ({source}), and {trained} was trained "
                "with it: resume with the --data-dir the run was started with, or choose a new --output-dir"
            )
        shutil.rmtree(target)  # left by a start that saved no checkpoint: nothing depends on it
    os.replace(staging, target)
    if skipped:
        log.info("tokenizer files copied to %s; not copied: %s", target, ", ".join(skipped))
    return RUN_TOKENIZER_DIR


def run_folder(tag_dir: Path) -> Path:
    """The run folder of a checkpoint: `<run>/checkpoints/step_N` -> `<run>`."""
    return tag_dir.resolve().parent.parent


def tokenizer_for_export(tag_dir: Path, meta: dict[str, Any]) -> Path | None:
    """The folder whose tokenizer files go into an export of `tag_dir`, or None (with a warning)."""
    recorded = meta.get("tokenizer_dir")
    if not recorded:
        return None
    if Path(recorded).is_absolute():  # written before the run kept its tokenizer
        raise OutdatedCheckpoint(
            f"{tag_dir} names its tokenizer by the absolute path {recorded}, as an older swbert wrote: "
            f"rewrite it once with {upgrade_command(tag_dir)}, then run this again"
        )
    run = run_folder(tag_dir)
    folder = (run / recorded).resolve()
    if not folder.is_relative_to(run):
        raise ValueError(
            f"{tag_dir}: its tokenizer_dir {recorded!r} leads out of the run folder {run}; a run's "
            "tokenizer lives in <run>/tokenizer. Pass the tokenizer with --tokenizer DIR"
        )
    if not folder.is_dir():
        log.warning(
            "%s: the run's tokenizer folder %s is missing (checkpoints copied without it?); "
            "exporting without a tokenizer: pass --tokenizer DIR to add one",
            tag_dir,
            folder,
        )
        return None
    others = tokenizer_files(folder)[1]
    if others:
        raise ValueError(
            f"{folder} holds files that are not a tokenizer's ({', '.join(others)}); an export copies "
            f"tokenizer files only ({', '.join(sorted(TOKENIZER_NAMES))}, *.model, *.vocab). "
            "Move the others out of it"
        )
    return folder


def copy_tokenizer(folder: Path, output: Path, expected_hash: str | None = None) -> list[str]:
    """Copy `folder`'s tokenizer files (nothing else) into `output`; returns their names. With
    `expected_hash`, a folder whose spm.model is another tokenizer is refused."""
    if expected_hash and (folder / SPM_MODEL_NAME).is_file() and tokenizer_hash(folder) != expected_hash:
        raise ValueError(
            f"{folder} is not the tokenizer the checkpoint was trained with (its {SPM_MODEL_NAME} has "
            f"another sha256 than the recorded {expected_hash[:12]}...); pass the run's tokenizer"
        )
    files, _ = tokenizer_files(folder)
    for item in files:
        shutil.copyfile(item, output / item.name)
    return [item.name for item in files]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of a Hugging Face tokenizer's vocabulary (token -> id): what a model's ids mean."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256("\n".join(f"{i}\t{t}" for t, i in vocab).encode()).hexdigest()


def record_tokenizer(folder: Path) -> str:
    """Write the fingerprint of `folder`'s tokenizer into its config.json (`tokenizer_sha256`), so that
    fine-tuning refuses another tokenizer (swbert.finetune.checkpoint); returns it."""
    from transformers import AutoTokenizer

    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(folder)))
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_sha256"] = fingerprint
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return fingerprint
