"""Argument helpers shared by the data_prep command lines."""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Callable

from data_prep.sources import ReadOptions

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMG]?)(?:I?B)?", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def byte_size(text: str) -> int:
    """Parse `512K`, `16M`, `1G` or a plain number of bytes (for argparse `type=`)."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 65536, 512K, 16M or 1G")
    value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least one byte")
    return value


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """--input and the flags that say how documents are found in it."""
    defaults = ReadOptions()
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="files (.txt, .jsonl, .parquet), folders (searched recursively, in sorted order), or a "
        "Hugging Face dataset name (e.g. wikimedia/wikipedia with --hf-config 20231101.en; prefix "
        "with hf: to force, also for a local folder in a Hub dataset's layout); Parquet datasets "
        "are streamed from the Hub, others loaded when online or from the local cache",
    )
    parser.add_argument(
        "--txt-documents",
        choices=["auto", "blank", "line"],
        default=defaults.txt_documents,
        help="how .txt files delimit documents: blank lines between documents (BERT's format), one "
        "document per line, or auto: blank if a file's first MiB holds a blank line, else line "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--text-field",
        default=defaults.text_field,
        help="field or column holding the text in .jsonl, .parquet and Hub datasets (default: %(default)s)",
    )
    parser.add_argument(
        "--invalid-utf8",
        choices=["replace", "skip"],
        default=defaults.invalid_utf8,
        help="what to do with documents holding bytes that are not UTF-8: replace them with U+FFFD "
        "or skip the document; either way they are counted in the summary (default: %(default)s)",
    )
    parser.add_argument(
        "--max-line-bytes",
        type=byte_size,
        default=defaults.max_line_bytes,
        help="JSON lines longer than this are skipped and counted, never held in memory "
        "(text lines of any length are read in pieces) (default: 64M)",
    )
    parser.add_argument(
        "--hf-config",
        default=None,
        help="configuration of a Hub dataset (e.g. 20231101.en: wikimedia/wikipedia's dump date and language)",
    )
    parser.add_argument("--hf-split", default="train", help="split of a Hub dataset (default: %(default)s)")


def read_options(args: argparse.Namespace) -> ReadOptions:
    return ReadOptions(
        txt_documents=args.txt_documents,
        text_field=args.text_field,
        invalid_utf8=args.invalid_utf8,
        max_line_bytes=args.max_line_bytes,
    )


def run_main(main: Callable[[], int]) -> None:
    """Run a CLI: user-fixable errors (`ValueError`) print one line and exit 1, not a traceback."""
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
