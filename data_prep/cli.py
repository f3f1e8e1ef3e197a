"""What the data_prep command lines share: the input flags, byte sizes and the error handling.

The tools speak swbert's one command-line convention (`swbert.cli`): each is a config dataclass
whose fields are its `--key value` flags, described by the comment beside each field.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from data_prep.sources import ReadOptions

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMG]?)(?:I?B)?", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def byte_size(text: str | int, flag: str) -> int:
    """Parse `512K`, `16M`, `1G` or a plain number of bytes given to `flag`."""
    match = _SIZE.fullmatch(str(text).strip())
    if not match:
        raise ValueError(f"{flag} {str(text)!r}: not a size such as 65536, 512K, 16M or 1G")
    value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value < 1:
        raise ValueError(f"{flag} {str(text)!r}: must be at least one byte")
    return value


def size_text(value: int) -> str:
    """A number of bytes the way `byte_size` reads it back, in the largest whole unit (`16M`)."""
    for unit in ("G", "M", "K"):
        if value % _UNITS[unit] == 0:
            return f"{value // _UNITS[unit]}{unit}"
    return str(value)


@dataclass(kw_only=True)
class InputOptions:
    """--input and the flags that say how documents are found in it."""

    # files (.txt, .jsonl, .parquet), folders (searched recursively, in sorted order), or Hugging
    # Face datasets as NAME[@CONFIG][:SPLIT] (e.g. wikimedia/wikipedia@20231101.en
    # SamuelYang/bookcorpus; prefix with hf: to force, also for a local folder in a Hub dataset's
    # layout); Parquet datasets are streamed from the Hub, others loaded when online or from the
    # local cache; several values, never split at commas (a file name may hold one)
    input: list[str] = field(metadata={"commas": False})
    # how .txt files delimit documents: blank lines between documents (BERT's format), one document
    # per line, or auto: blank if a file's first MiB holds a blank line, else line
    txt_documents: Literal["auto", "blank", "line"] = ReadOptions.txt_documents
    # field or column holding the text in .jsonl, .parquet and Hub datasets
    text_field: str = ReadOptions.text_field
    # what to do with documents holding bytes that are not UTF-8: replace them with U+FFFD or skip
    # the document; either way they are counted in the summary. Unset: replace, but refuse a file
    # that is mostly not UTF-8 (Latin-1, binary), naming it
    invalid_utf8: Literal["replace", "skip"] | None = None
    # JSON lines longer than this are skipped and counted, never held in memory (text lines of any
    # length are read in pieces)
    max_line_bytes: str = size_text(ReadOptions.max_line_bytes)
    # configuration of the Hub datasets that name none (NAME@CONFIG names its own; e.g. 20231101.en:
    # wikimedia/wikipedia's dump date and language)
    hf_config: str | None = None
    hf_split: str = "train"  # split of the Hub datasets that name none (NAME:SPLIT names its own)

    def check(self) -> None:
        if not self.input:
            raise ValueError("--input needs at least one file, folder or dataset name")
        self.read_options()

    def read_options(self) -> ReadOptions:
        return ReadOptions(
            txt_documents=self.txt_documents,
            text_field=self.text_field,
            invalid_utf8=self.invalid_utf8 or ReadOptions.invalid_utf8,
            max_line_bytes=byte_size(self.max_line_bytes, "--max-line-bytes"),
        )

    def reading(self) -> dict[str, Any]:
        """The reading keywords `preprocess` and `train_tokenizer` share, from these flags."""
        return {
            "options": self.read_options(),
            "hf_config": self.hf_config,
            "hf_split": self.hf_split,
            "check_encoding": self.invalid_utf8 is None,  # an explicit --invalid-utf8 reads any file
        }


def run_main(main: Callable[[], int]) -> None:
    """Run a CLI: user-fixable errors (`ValueError`) print one line and exit 1, not a traceback.

    Bad flags never get here: `swbert.cli.parse_or_exit` prints them and exits with status 2."""
    # Our own messages at INFO; libraries (megatron logs its set-up at INFO) only at WARNING.
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    logging.getLogger("data_prep").setLevel(logging.INFO)
    try:
        code = main()
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


def command(main: Callable[[], int]) -> Callable[[], None]:
    """`main` as a console script (`[project.scripts]`): `run_main(main)`, taking no arguments."""
    return functools.partial(run_main, main)
