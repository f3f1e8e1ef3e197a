"""Inputs of the preprocessing CLIs: which files (or Hub dataset) to read, and where to cut them.

A corpus is cut into chunks at document boundaries found from fixed byte targets, so the chunks
(and therefore the shards, and the order of the documents in them) depend only on the inputs
and `--shard-size`, never on the number of workers.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

Kind = Literal["txt", "jsonl", "parquet", "hf"]
SUFFIXES: dict[str, Kind] = {".txt": "txt", ".text": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
HF_PREFIX = "hf:"
# A blank (whitespace-only) line separates documents in `--txt-documents blank` mode.
BLANK_LINE = re.compile(rb"\n[ \t\r\f\v]*\n")


class InputError(ValueError):
    """A problem with the inputs that the user can fix; the CLIs print it without a traceback."""


@dataclass(frozen=True)
class Source:
    """One input: a local file, or a split of a Hugging Face dataset (`kind == "hf"`)."""

    kind: Kind
    path: str  # absolute file path, or the dataset name
    size: int  # bytes of the file, or rows of the dataset
    mtime_ns: int = 0
    documents: str = ""  # .txt only: "blank" (blank lines between documents) or "line"
    hf_config: str | None = None
    hf_split: str = "train"
    hf_fingerprint: str = ""  # changes when the Hub dataset's content changes
    hf_files: tuple[str, ...] = ()  # its Arrow cache files, so workers never go online

    def describe(self) -> dict[str, Any]:
        """What the manifest records about this input (no cache paths: they vary by machine)."""
        record = asdict(self)
        record.pop("hf_files")
        if self.kind != "hf" and not self.hf_fingerprint:  # a Hub dataset's parquet file keeps them
            for key in ("hf_config", "hf_split", "hf_fingerprint"):
                record.pop(key)
        if self.kind != "txt":
            record.pop("documents")
        return record


@dataclass(frozen=True)
class Chunk:
    """The part of one source that becomes one shard: bytes, row groups or rows `[start, end)`."""

    source: int
    start: int
    end: int
    weight: int  # approximate raw bytes, for progress


@dataclass(frozen=True)
class ReadOptions:
    """How documents are found in the inputs; part of the manifest, since it changes the shards."""

    txt_documents: Literal["auto", "blank", "line"] = "auto"
    text_field: str = "text"
    invalid_utf8: Literal["replace", "skip"] = "replace"
    max_line_bytes: int = 64 << 20
    # Documents longer than this are read and tokenized in pieces cut at whitespace, which
    # SentencePiece treats as a boundary anyway (so the ids are the same); memory stays bounded
    # by one piece. A piece with no whitespace at all is cut at a character boundary instead.
    piece_bytes: int = 1 << 20


def resolve_inputs(
    inputs: list[str],
    *,
    text_field: str = "text",
    txt_documents: str = "auto",
    hf_config: str | None = None,
    hf_split: str = "train",
) -> tuple[list[Source], list[str]]:
    """Expand files and folders (recursively, sorted) and Hub names into sources.

    Returns the sources and the empty files skipped inside folders. Raises `InputError` for a
    missing path, an unsupported or empty file named explicitly, a folder with nothing to read,
    or a dataset name that cannot be loaded.
    """
    if not inputs:
        raise InputError("no --input given")
    sources: list[Source] = []
    skipped: list[str] = []
    seen: set[str] = set()  # local files, by their resolved path
    for item in inputs:
        path = Path(item)
        if item.startswith(HF_PREFIX) or not (path.is_dir() or path.is_file() or _looks_like_path(item)):
            hub = parse_hub_input(item.removeprefix(HF_PREFIX), hf_config, hf_split)
            sources.extend(_hub_sources(hub.name, hub.config, hub.split, text_field))
            continue
        if path.is_dir():
            files = [(file, False) for file in _folder_files(path)]
        elif path.is_file():
            files = [(path, True)]
        else:
            raise InputError(f"input {item} does not exist")
        for file, explicit in files:
            source = _file_source(file, explicit, txt_documents)
            if source is None:
                skipped.append(str(file))
            elif source.path not in seen:
                seen.add(source.path)
                sources.append(source)
    if not sources:
        raise InputError(f"every input is empty: {', '.join(skipped)}")
    for source in sources:
        if source.kind == "parquet":
            _check_parquet(source, text_field)
        elif source.kind == "jsonl":
            _check_jsonl(source, text_field)
    return sources, skipped


def _folder_files(path: Path) -> list[Path]:
    """The readable files under a folder, recursively and sorted (hidden ones left out)."""
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and p.suffix.lower() in SUFFIXES and not p.name.startswith(".")
    )
    if not files:
        raise InputError(f"folder {path} holds no .txt, .jsonl or .parquet file")
    return files


def _file_source(path: Path, explicit: bool, txt_documents: str) -> Source | None:
    """A local file as a source; None for an empty file found in a folder (one named is an error)."""
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise InputError(f"{path}: unsupported file type {path.suffix!r}; use .txt, .jsonl or .parquet")
    stat = path.stat()
    if stat.st_size == 0:
        if explicit:
            raise InputError(f"{path} is empty; remove it from --input")
        return None
    documents = _txt_documents(path, txt_documents) if kind == "txt" else ""
    return Source(kind, str(path.resolve()), stat.st_size, stat.st_mtime_ns, documents)


ENCODING_SAMPLE_BYTES = 1 << 20
MIN_INVALID = 16  # invalid sequences below which a file is repaired, whatever their share


def encoding_problem(path: str, head: bytes) -> str | None:
    """Why a file's first bytes do not look like UTF-8 text (binary, Latin-1, ...), or None.

    A stray bad byte in UTF-8 text is repaired and counted; a file is refused when at least
    `MIN_INVALID` invalid sequences make up most of its non-ASCII characters (Latin-1 or another
    8-bit encoding; random bytes) or when it holds NUL bytes (binary, UTF-16)."""
    if head.count(0) > len(head) // 100:
        return f"{path} holds NUL bytes: it is binary or UTF-16, not UTF-8 text"
    invalid = valid = 0
    text = head.decode("utf-8", errors="replace")
    if len(head) == ENCODING_SAMPLE_BYTES:  # a character cut at the end of the sample is no error
        text = text.rstrip("\ufffd")
    for char in text:
        if char == "\ufffd":
            invalid += 1
        elif ord(char) > 127:
            valid += 1
    if invalid >= MIN_INVALID and invalid > valid:
        where = "its first MiB" if len(head) == ENCODING_SAMPLE_BYTES else "it"
        return (
            f"{path}: {invalid} byte sequences of {where} are not UTF-8 (and {valid} characters are): "
            "it is in another encoding (Latin-1?) or binary"
        )
    return None


def refuse_non_utf8(sources: list[Source]) -> None:
    """Refuse, naming the file, a local .txt/.jsonl input that is not UTF-8 text (see
    `encoding_problem`); reading would turn it into replacement characters without a word."""
    for source in sources:
        if source.kind not in ("txt", "jsonl") or "://" in source.path:
            continue
        with open(source.path, "rb") as stream:
            problem = encoding_problem(source.path, stream.read(ENCODING_SAMPLE_BYTES))
        if problem:
            raise InputError(
                f"{problem}. Convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8), remove it from --input, "
                "or pass --invalid-utf8 replace (or skip) to read it anyway"
            )


def _txt_documents(path: Path, mode: str) -> str:
    """`auto`: blank-line documents (BERT's format) if the first MiB holds a blank line, else one per line."""
    if mode != "auto":
        return mode
    with open(path, "rb") as stream:
        head = stream.read(1 << 20)
    return "blank" if BLANK_LINE.search(head) else "line"


# A Hub dataset is named `name` or `org/name`, optionally with `@CONFIG` and `:SPLIT` (ours: the
# Hub has no syntax for both in one string); anything else that does not exist is a bad path.
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
HUB_INPUT = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?(@[^@:/\s]+)?(:[^@:/\s]+)?")


@dataclass(frozen=True)
class HubInput:
    """A Hub dataset input: its name (or a local folder in a Hub dataset's layout), configuration
    and split."""

    name: str
    config: str | None
    split: str


def parse_hub_input(text: str, default_config: str | None = None, default_split: str = "train") -> HubInput:
    """`NAME[@CONFIG][:SPLIT]`, e.g. `wikimedia/wikipedia@20231101.en` or `squad:validation`: each
    input names its own configuration and split; `--hf-config` and `--hf-split` are the defaults of
    those that do not. Only the last path component is parsed, so `hf:FOLDER@CONFIG` works too."""
    cut = text.rfind("/") + 1
    head, tail = text[:cut], text[cut:]
    split = config = None
    if ":" in tail:
        tail, split = tail.rsplit(":", 1)
    if "@" in tail:
        tail, config = tail.rsplit("@", 1)
    if not tail or config == "" or split == "":
        raise InputError(
            f"input {text!r}: a Hub dataset is NAME, NAME@CONFIG, NAME:SPLIT or NAME@CONFIG:SPLIT "
            "(e.g. wikimedia/wikipedia@20231101.en), with nothing empty"
        )
    return HubInput(head + tail, config if config is not None else default_config, split or default_split)


def _looks_like_path(item: str) -> bool:
    return not HUB_INPUT.fullmatch(item) or Path(item).suffix.lower() in SUFFIXES


def open_parquet(path: str) -> Any:  # -> pyarrow.parquet.ParquetFile
    """A local Parquet file, or a remote one (`hf://datasets/...`) read by ranges through fsspec:
    only the footer and the row groups asked for are fetched, never the whole file."""
    import pyarrow.parquet as pq

    if "://" not in path:
        return pq.ParquetFile(path)
    import fsspec

    return pq.ParquetFile(fsspec.open(path, "rb").open())


def _check_parquet(source: Source, text_field: str) -> None:
    import pyarrow as pa

    try:
        schema = open_parquet(source.path).schema_arrow
    except (OSError, pa.ArrowException) as err:
        raise InputError(f"{source.path} is not a readable Parquet file: {err}") from err
    if text_field not in schema.names:
        raise InputError(
            f"{source.path} has no column {text_field!r} (columns: {', '.join(schema.names)}); "
            "pass --text-field"
        )
    if not (
        pa.types.is_string(schema.field(text_field).type)
        or pa.types.is_large_string(schema.field(text_field).type)
    ):
        raise InputError(f"{source.path}: column {text_field!r} is {schema.field(text_field).type}, not text")


def _check_jsonl(source: Source, text_field: str) -> None:
    """Fail early on a wrong --text-field rather than skipping every line of a large file."""
    limit = 1 << 20
    with open(source.path, "rb") as stream:
        while line := stream.readline(limit):
            if len(line) == limit and not line.endswith(b"\n"):
                return  # a huge first record: the reader checks it without holding it twice
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                return  # a bad line is counted and skipped by the reader; maybe the rest is fine
            if isinstance(record, dict) and text_field not in record:
                raise InputError(
                    f"{source.path}: the first record has no field {text_field!r} "
                    f"(fields: {', '.join(map(str, record))}); pass --text-field"
                )
            return


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hub answers at all; `datasets` would otherwise retry for half a minute."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def _hub_sources(name: str, config: str | None, split: str, text_field: str) -> list[Source]:
    """The sources of a Hub dataset split (or of a local folder in a Hub dataset's layout).

    A dataset stored as Parquet (today's `wikimedia/wikipedia`, BookCorpus copies) is streamed:
    each of its Parquet files becomes one source, read by row groups straight from the Hub by the
    workers; nothing is downloaded ahead and no Arrow cache is written. Any other dataset is loaded
    with `datasets.load_dataset` (downloaded once into the Hugging Face cache) as before.
    """
    builder = _dataset_builder(name, config)
    files = list((builder.config.data_files or {}).get(split, []))
    if not files and builder.config.data_files:
        raise InputError(
            f"dataset {name!r} (config {config!r}) has no split {split!r}; its splits: "
            f"{', '.join(builder.config.data_files)}. Name one as {name}@CONFIG:SPLIT (or pass --hf-split)"
        )
    if not files or not all(str(f).endswith(".parquet") for f in files):
        return [_hub_source(name, config, split, text_field)]
    from tqdm.auto import tqdm

    bar = tqdm(files, desc=f"reading the Parquet footers of {name}", unit="file", disable=len(files) < 4)
    return [_parquet_source(str(path), name, config, split) for path in bar]


def _parquet_source(path: str, name: str, config: str | None, split: str) -> Source:
    """One Parquet file of a Hub dataset, sized by its footer (no download)."""
    meta = open_parquet(path).metadata
    return Source(
        "parquet",
        path,
        meta.serialized_size + sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)),
        hf_config=config,
        hf_split=split,
        # a Hub path names the revision (hf://datasets/NAME@SHA/...), so it changes with the data
        hf_fingerprint=f"{name}:{meta.num_rows}",
    )


def _dataset_builder(name: str, config: str | None) -> Any:  # -> datasets.DatasetBuilder
    """The dataset's builder, from a local folder, the Hub or (offline) the local cache; an
    InputError saying where it looked otherwise."""
    local = Path(name).is_dir()
    online = local or _hub_reachable()
    if not online:
        os.environ["HF_HUB_OFFLINE"] = "1"  # set before the import, which reads it
    import datasets

    if not online:
        datasets.config.HF_HUB_OFFLINE = True  # in case it was imported earlier
    try:
        builder = datasets.load_dataset_builder(str(Path(name).resolve()) if local else name, config)
    except Exception as err:  # datasets raises many types (ConnectionError, FileNotFoundError, ...)
        where = (
            "a local folder"
            if local
            else "the Hub"
            if online
            else "the local cache (the Hub is unreachable: offline?)"
        )
        raise InputError(
            f"input {name!r} is not a local file or folder, and reading it as a Hugging Face dataset "
            f"(config {config!r}) from {where} failed: {type(err).__name__}: {err}. Pass local "
            ".txt/.jsonl/.parquet files, or check the name and its configuration (e.g. "
            "wikimedia/wikipedia@20231101.en, or --hf-config for every input that names none)."
        ) from err
    return builder


def _hub_source(name: str, config: str | None, split: str, text_field: str) -> Source:
    """Load (downloading when online, else from the local cache) a Hub dataset split."""
    online = _hub_reachable()
    if not online:
        # Use the local cache if it has the dataset, and fail at once if not, instead of letting
        # `datasets` retry the network for half a minute. Set before the import, which reads it.
        os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets

    if not online:
        datasets.config.HF_HUB_OFFLINE = True  # in case it was imported earlier
    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except Exception as err:  # datasets raises many types (ConnectionError, FileNotFoundError, ...)
        where = "the Hub" if online else "the local cache (the Hub is unreachable: offline?)"
        raise InputError(
            f"input {name!r} is not a local file or folder, and loading it as a Hugging Face dataset "
            f"(config {config!r}, split {split!r}) from {where} failed: {type(err).__name__}: {err}. "
            "Pass local .txt/.jsonl/.parquet files, or check the name, --hf-config and --hf-split."
        ) from err
    if text_field not in dataset.column_names:
        raise InputError(
            f"dataset {name!r} has no column {text_field!r} (columns: {', '.join(dataset.column_names)}); "
            "pass --text-field"
        )
    files = tuple(f["filename"] for f in dataset.cache_files)
    if not files:
        raise InputError(
            f"dataset {name!r} is held in memory, not in Arrow cache files; save it to disk first"
        )
    return Source(
        "hf",
        name,
        len(dataset),
        hf_config=config,
        hf_split=split,
        hf_fingerprint=dataset._fingerprint,
        hf_files=files,
    )


def open_hub_dataset(source: Source) -> Any:
    """The dataset of a `hf` source, memory-mapped from its Arrow cache files (no network)."""
    import datasets

    parts = [datasets.Dataset.from_file(path) for path in source.hf_files]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def plan_chunks(sources: list[Source], shard_bytes: int, options: ReadOptions) -> list[Chunk]:
    """Cut every source into chunks of about `shard_bytes`, each starting at a document boundary."""
    chunks: list[Chunk] = []
    for index, source in enumerate(sources):
        if source.kind in ("txt", "jsonl"):
            line_mode = source.kind == "jsonl" or source.documents == "line"
            chunks.extend(_byte_chunks(index, source, shard_bytes, line_mode))
        elif source.kind == "parquet":
            chunks.extend(_row_group_chunks(index, source, shard_bytes))
        else:
            dataset = open_hub_dataset(source)
            bytes_per_row = max(1, dataset.data.nbytes // max(1, len(dataset)))
            rows = max(1, shard_bytes // bytes_per_row)
            for start in range(0, len(dataset), rows):
                end = min(start + rows, len(dataset))
                chunks.append(Chunk(index, start, end, (end - start) * bytes_per_row))
    return chunks


def _byte_chunks(index: int, source: Source, shard_bytes: int, line_mode: bool) -> list[Chunk]:
    chunks = []
    with open(source.path, "rb") as stream, mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as data:
        start = 0
        while start < source.size:
            target = start + shard_bytes
            if target >= source.size:
                end = source.size
            elif line_mode:
                newline = data.find(b"\n", target)
                end = source.size if newline < 0 else newline + 1
            else:
                match = BLANK_LINE.search(data, target)
                end = source.size if match is None else match.end()
            chunks.append(Chunk(index, start, end, end - start))
            start = end
    return chunks


def _row_group_chunks(index: int, source: Source, shard_bytes: int) -> list[Chunk]:
    meta = open_parquet(source.path).metadata
    chunks, start, size = [], 0, 0
    for group in range(meta.num_row_groups):
        size += meta.row_group(group).total_byte_size
        if size >= shard_bytes or group == meta.num_row_groups - 1:
            chunks.append(Chunk(index, start, group + 1, size))
            start, size = group + 1, 0
    return chunks
