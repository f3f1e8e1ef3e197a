"""Read the documents of one chunk, in bounded memory, counting what is skipped or repaired."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from data_prep.sources import Chunk, InputError, ReadOptions, Source, open_hub_dataset, open_parquet

BLOCK_BYTES = 1 << 20
BOM = b"\xef\xbb\xbf"
ROWS_PER_READ = 256


@dataclass(frozen=True)
class Piece:
    """A document, or a part of a long one (cut at whitespace, so tokenizing parts is lossless)."""

    text: str
    first: bool  # first piece of its document: the train/valid split is decided here
    last: bool  # last piece: the document ends after it


def cut_bytes(data: bytes, limit: int) -> int:
    """Where to cut `data` (longer than `limit`): after the last space, else on a UTF-8 boundary."""
    cut = max(data.rfind(b" ", 0, limit), data.rfind(b"\n", 0, limit), data.rfind(b"\t", 0, limit)) + 1
    if cut > 0:
        return cut
    cut = limit
    while cut > 0 and (data[cut] & 0xC0) == 0x80:  # a UTF-8 continuation byte: step back
        cut -= 1
    return cut or limit


def split_text(text: str, limit: int) -> list[str]:
    """Cut a long string into parts of at most `limit` characters, at whitespace where possible."""
    parts = []
    while len(text) > limit:
        cut = max(text.rfind(" ", 0, limit), text.rfind("\n", 0, limit)) + 1 or limit
        parts.append(text[:cut])
        text = text[cut:]
    parts.append(text)
    return parts


class DocumentReader:
    """Iterate the pieces of the documents in one chunk of a source.

    Memory is bounded by `options.piece_bytes` plus one read block (and by
    `options.max_line_bytes` for a JSON line). `stats` receives the counts of skipped and
    repaired input; `progress` tells how much of the chunk's `weight` has been read.
    """

    def __init__(self, source: Source, chunk: Chunk, options: ReadOptions, stats: Counter) -> None:
        self.source = source
        self.chunk = chunk
        self.options = options
        self.stats = stats
        self.progress = 0
        self._invalid = False  # the current document held invalid UTF-8

    def __iter__(self) -> Iterator[Piece]:
        kind = self.source.kind
        if kind == "jsonl":
            return self._jsonl()
        if kind == "txt":
            return self._txt_lines() if self.source.documents == "line" else self._txt_blocks()
        return self._records()

    # -- bytes to text ---------------------------------------------------------------------
    def _decode(self, data: bytes) -> str | None:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            self._invalid = True
            if self.options.invalid_utf8 == "skip":
                return None
            return data.decode("utf-8", errors="replace")

    def _end_document(self) -> None:
        if self._invalid:
            key = "invalid_utf8_skipped" if self.options.invalid_utf8 == "skip" else "invalid_utf8_replaced"
            self.stats[key] += 1
        self._invalid = False

    def _segments(self, split_long: bool) -> Iterator[tuple[bytes, bool]]:
        """Lines of the chunk without their newline, as `(bytes, ends_line)`.

        A line longer than a piece comes in parts when `split_long` (text); otherwise (JSON) a
        line longer than `max_line_bytes` is skipped without ever being held whole.
        """
        start, end = self.chunk.start, self.chunk.end
        remaining, carry, dropping = end - start, b"", False
        with open(self.source.path, "rb") as stream:
            stream.seek(start)
            while remaining > 0:
                block = stream.read(min(BLOCK_BYTES, remaining))
                if not block:
                    raise InputError(
                        f"{self.source.path} shrank while being read; re-run when it is complete"
                    )
                if start == 0 and remaining == end and block.startswith(BOM):
                    block = block[len(BOM) :]  # a byte-order mark is not text
                    remaining -= len(BOM)
                remaining -= len(block)
                self.progress = end - start - remaining
                buf = carry + block if carry else block
                pos = 0
                while (newline := buf.find(b"\n", pos)) >= 0:
                    if not dropping:
                        yield from self._parts(buf[pos:newline].rstrip(b"\r"), split_long)
                    dropping = False
                    pos = newline + 1
                carry = b"" if dropping else buf[pos:]
                if split_long:
                    while len(carry) > self.options.piece_bytes:
                        cut = cut_bytes(carry, self.options.piece_bytes)
                        yield carry[:cut], False
                        carry = carry[cut:]
                elif len(carry) > self.options.max_line_bytes:
                    self.stats["oversized_lines"] += 1
                    carry, dropping = b"", True
        if carry:
            yield from self._parts(carry.rstrip(b"\r"), split_long)

    def _parts(self, line: bytes, split_long: bool) -> Iterator[tuple[bytes, bool]]:
        """A complete line: in parts of at most a piece when `split_long`, else whole or skipped."""
        if not split_long and len(line) > self.options.max_line_bytes:
            self.stats["oversized_lines"] += 1
            return
        while split_long and len(line) > self.options.piece_bytes:
            cut = cut_bytes(line, self.options.piece_bytes)
            yield line[:cut], False
            line = line[cut:]
        yield line, True

    def _piece(self, data: bytes, first: bool, last: bool) -> Piece | None:
        """Decode one piece; None when nothing is to be emitted (empty or skipped document)."""
        text = self._decode(data)
        if last:
            self._end_document()
        if text is None:  # invalid UTF-8, skipped; a started document still needs its end
            return None if first else Piece("", False, last)
        if first and last and not text.strip():
            self.stats["empty_documents"] += 1
            return None
        return Piece(text, first, last)

    # -- formats ---------------------------------------------------------------------------
    def _txt_lines(self) -> Iterator[Piece]:
        """One document per line; a very long line is one document in several pieces."""
        first = True
        for segment, ends_line in self._segments(split_long=True):
            piece = self._piece(segment, first, ends_line)
            if piece is not None:
                yield piece
                first = False
            if ends_line:
                first = True

    def _txt_blocks(self) -> Iterator[Piece]:
        """Documents separated by blank lines (BERT's format); a line break inside stays a newline."""
        parts: list[bytes] = []
        size, first, mid_line = 0, True, False
        for segment, ends_line in self._segments(split_long=True):
            if not mid_line and ends_line and not segment.strip():  # a blank line ends the document
                if parts or not first:
                    piece = self._piece(b"".join(parts), first, last=True)
                    if piece is not None:
                        yield piece
                parts, size, first = [], 0, True
                continue
            parts.append(segment + b"\n" if ends_line else segment)
            size += len(parts[-1])
            mid_line = not ends_line
            while size > self.options.piece_bytes:
                data = b"".join(parts)
                cut = cut_bytes(data, self.options.piece_bytes)
                piece = self._piece(data[:cut], first, last=False)
                if piece is not None:
                    yield piece
                    first = False
                parts, size = [data[cut:]], len(data) - cut
        if parts or not first:
            piece = self._piece(b"".join(parts), first, last=True)
            if piece is not None:
                yield piece

    def _jsonl(self) -> Iterator[Piece]:
        for segment, _ in self._segments(split_long=False):
            if not segment.strip():
                continue
            line = self._decode(segment)
            self._end_document()  # count a repaired or skipped line once
            if line is None:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                self.stats["invalid_json_lines"] += 1
                continue
            text = record.get(self.options.text_field) if isinstance(record, dict) else None
            yield from self._text_document(text)

    def _records(self) -> Iterator[Piece]:
        """Parquet row groups or Hub dataset rows `[start, end)`, a few hundred rows at a time."""
        field, chunk = self.options.text_field, self.chunk
        if self.source.kind == "parquet":
            parquet = open_parquet(self.source.path)
            total = sum(parquet.metadata.row_group(g).num_rows for g in range(chunk.start, chunk.end))
            groups = list(range(chunk.start, chunk.end))
            batches = (
                b.column(0).to_pylist()
                for b in parquet.iter_batches(ROWS_PER_READ, row_groups=groups, columns=[field])
            )
        else:
            dataset = open_hub_dataset(self.source)
            total = chunk.end - chunk.start
            batches = (
                dataset[i : min(i + ROWS_PER_READ, chunk.end)][field]
                for i in range(chunk.start, chunk.end, ROWS_PER_READ)
            )
        done = 0
        for values in batches:
            for text in values:
                yield from self._text_document(text)
            done += len(values)
            self.progress = chunk.weight * done // max(total, 1)

    def _text_document(self, text: object) -> Iterator[Piece]:
        if not isinstance(text, str):
            self.stats["missing_text_field"] += 1
        elif not text.strip():
            self.stats["empty_documents"] += 1
        else:
            parts = split_text(text, self.options.piece_bytes)
            for i, part in enumerate(parts):
                yield Piece(part, i == 0, i == len(parts) - 1)
