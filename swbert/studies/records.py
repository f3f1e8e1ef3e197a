"""What a study keeps on disk: one record per finished point, and the options it was run with.

A point's record is written last, atomically, once the point is complete (its model saved, its
result known): a record says the point is done, whatever else the folder holds. A study's
options are kept in `study.json`; a re-run with other options in the same folder is refused in
one line naming what differs (`--allow-study-change` runs the new points beside the finished
ones, which are never retrained and nothing is deleted).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger("swbert.studies")

STUDY_FILE = "study.json"


def write_json_atomic(path: Path, payload: Any) -> None:
    """`payload` as JSON at `path`, whole or not at all (fsynced, then renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as stream:
        json.dump(payload, stream, indent=1, sort_keys=True, default=str)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> Any | None:
    """The JSON at `path`, or None when it is missing or torn."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class Records:
    """A study's point records: `folder/<pattern with the point's name>`, each a JSON object with
    its format, the key it stands for (None: any) and the study's payload."""

    def __init__(self, folder: Path, fmt: str, pattern: str = "{name}.json") -> None:
        self.folder, self.fmt, self.pattern = Path(folder), fmt, pattern

    def path(self, name: str) -> Path:
        return self.folder / self.pattern.format(name=name)

    def load(self, name: str, key: Any = None) -> dict[str, Any] | None:
        """The record of point `name` made for `key` (any key when None), or None: run the point."""
        record = read_json(self.path(name))
        if not isinstance(record, dict) or record.get("format") != self.fmt:
            return None
        if key is not None and record.get("key") != json.loads(json.dumps(key, default=str)):
            return None
        return record

    def save(self, name: str, payload: dict[str, Any], key: Any = None) -> Path:
        """Record point `name` as finished (call last, once what it made is complete)."""
        path = self.path(name)
        write_json_atomic(path, {**payload, "format": self.fmt, "key": key})
        return path


def _spelled(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def study_changes(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """`--flag NOW (was BEFORE)` for every option that differs, in the order of `now`."""
    changes = []
    for key in dict.fromkeys([*now, *before]):
        if before.get(key) != now.get(key):
            flag = "--" + key.replace("_", "-")
            changes.append(
                f"{flag} {_spelled(now.get(key, '(unset)'))} (was {_spelled(before.get(key, '(unset)'))})"
            )
    return changes


def check_study(folder: Path, kind: str, spec: dict[str, Any], allow_change: bool = False) -> None:
    """Keep `spec` (the options that decide a study's points and what each runs) in folder/study.json;
    a ValueError naming what differs when the folder holds a `kind` study run with other options,
    unless `allow_change` (then the file takes the new options)."""
    spec = json.loads(json.dumps(spec, default=str))
    path = Path(folder) / STUDY_FILE
    saved = read_json(path)
    if isinstance(saved, dict) and saved.get("study") == kind and saved.get("options") != spec:
        changes = study_changes(saved.get("options") or {}, spec)
        if not allow_change:
            raise ValueError(
                f"{folder} holds a {kind} study run with other options: {'; '.join(changes)}; use "
                "another --output-dir, the same options, or --allow-study-change (finished points are "
                "kept, never retrained)"
            )
        log.info("%s: the study's options changed (--allow-study-change): %s", folder, "; ".join(changes))
    if saved != {"study": kind, "options": spec}:  # array tasks check at once: only a change writes
        write_json_atomic(path, {"study": kind, "options": spec})


def study_options(config: Any, left_out: Iterable[str]) -> dict[str, Any]:
    """A study config's fields, less `left_out` (those that choose where results go or how the
    study is orchestrated, not what its points are): any field added later counts."""
    import dataclasses

    skip = set(left_out)
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in skip}
