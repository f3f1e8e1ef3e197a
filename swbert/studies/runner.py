"""The point runner every study uses: skip the finished points, resume the one in flight, record
failures with their reason, log one MLflow child run per point under the study's parent
(docs/scaling.md, "Long studies are safe"). A study says what running a point does (`attempt`), how
a result is read back from a run the study stopped before recording (`recover`), and its child run."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from swbert.studies.records import Records, read_json, write_json_atomic
from swbert.studies.tracking import Tracker, flat_params

log = logging.getLogger("swbert.studies")


class Result(Protocol):
    """What a study's point result has besides its own figures (a dataclass, recorded as JSON)."""

    status: str
    reason: str


R = TypeVar("R", bound=Result)
P = TypeVar("P")

CHILDREN_FILE = "mlflow_points.json"  # in a study's folder: point name -> its MLflow child run


def absolute(path: str | Path | None) -> Any:
    """`path` made absolute (as the type it came as): a study's runs start in the checkout."""
    if path is None:
        return None
    return str(Path(path).resolve()) if isinstance(path, str) else Path(path).resolve()


def absolute_plugins(plugins: Iterable[str]) -> list[str]:
    """Plugin files by their absolute paths; dotted module names as given."""
    return [str(Path(p).resolve()) if p.endswith(".py") else p for p in plugins]


def stop_on_sigterm() -> None:
    """SIGTERM (a scheduler's stop, `kill`) unwinds like Ctrl-C: the point in flight checkpoints and
    stops before the study exits, so a re-run resumes it."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


@dataclass
class Settled(Generic[R]):
    """A point's result, and whether it ran now (False: read back from its record or its run)."""

    name: str
    result: R
    trained: bool


@dataclass
class PointRunner(Generic[R]):
    """Settles points against a study's records: a recorded point is read back (a failure too, unless
    `retry_failed`); else one whose run ended is recorded from what it left (`recover`); else it runs
    (`attempt`). A status in `unrecorded` (stopped, folder held, not run yet) is not recorded."""

    records: Records
    load: Callable[[dict[str, Any]], R]  # a recorded result (its payload's "result") back
    retry_failed: bool = False
    final: frozenset[str] = frozenset({"done"})  # statuses never run again, even with retry_failed
    unrecorded: frozenset[str] = frozenset({"stopped", "missing"})
    writes: bool = True  # False: read records, write none (a sweep's ranks other than 0)

    def settle(
        self,
        name: str,
        attempt: Callable[[], R],
        recover: Callable[[], R | None] = lambda: None,
        key: Any = None,
    ) -> Settled[R]:
        record = self.records.load(name, key)
        if record is not None:
            previous = self.load(record["result"])
            if previous.status in self.final or not self.retry_failed:
                return Settled(name, previous, False)
        elif self.writes and key is not None and self.records.load(name) is not None:  # other options or data
            aside = self.records.set_aside(name)
            log.info("%s: recorded with other options or data; set aside as %s", name, aside)
        recovered = recover()
        if recovered is not None and recovered.status in self.final:
            result, trained = recovered, False  # the study stopped after the run ended, before recording it
        else:
            result, trained = attempt(), True
        if self.writes and result.status not in self.unrecorded:
            self.records.save(name, {"result": asdict(result)}, key)  # type: ignore[call-overload]
        return Settled(name, result, trained)


@dataclass
class ChildRun:
    """What a point's MLflow child run holds."""

    tags: dict[str, str]
    params: dict[str, Any]
    metrics: dict[str, Any]
    curve: list[dict[str, Any]] = field(default_factory=list)
    curve_keys: tuple[str, ...] = ("loss",)


class StudyLog:
    """Points' child runs under the study's parent: a continued parent gets only the points trained
    since (or never logged); a new one gets every point."""

    def __init__(self, tracker: Tracker, folder: Path, parent: str | None = None) -> None:
        self.tracker, self.path, self.parent = tracker, Path(folder) / CHILDREN_FILE, parent
        saved = read_json(self.path) if tracker.continued else None
        self.children: dict[str, str] = saved if isinstance(saved, dict) else {}

    def point(self, name: str, trained: bool, child: ChildRun) -> None:
        logged = self.children.get(name)
        logged = logged if logged and self.tracker.live(logged) else None
        if logged is not None and not trained:
            return  # logged by an earlier run of the study and unchanged since
        with self.live(name, child.tags, child.params, logged) as run_id:
            self.tracker.log(run_id, child.metrics)
            for record in child.curve:  # `curve_keys` of each record at its step (a loss curve)
                self.tracker.log(run_id, {k: record.get(k) for k in child.curve_keys}, int(record["step"]))

    @contextlib.contextmanager
    def live(
        self, name: str, tags: dict[str, str], params: dict[str, Any], run_id: str | None = None
    ) -> Iterator[str | None]:
        """The point's child run, open while the point runs (a trial logs as it trains)."""
        with self.tracker.run(name, tags, params, run_id=run_id) as run_id:
            yield run_id
        if run_id is not None:
            self.children[name] = run_id
            write_json_atomic(self.path, self.children)


@contextlib.contextmanager
def study_run(
    folder: Path, store: str, experiment: str, kind: str, params: dict[str, Any], **how: Any
) -> Iterator[StudyLog]:
    """The study's MLflow parent run and its points' log; `how`: name, resume, enabled, system_metrics."""
    tracker = Tracker(store, experiment, how.get("enabled", True), how.get("system_metrics", False))
    name = how.get("name") or f"{kind.partition('_')[0]}-{time.strftime('%Y%m%d-%H%M%S')}"
    with tracker.sweep(name, kind, flat_params(params), folder, how.get("resume", True)) as parent:
        yield StudyLog(tracker, folder, parent)


def run_points(
    points: Sequence[P],
    settle: Callable[[P], Settled[R]],
    child: Callable[[P, Settled[R]], ChildRun] | None = None,
    study_log: StudyLog | None = None,
    after: Callable[[list[Settled[R]]], None] | None = None,
) -> list[Settled[R]]:
    """Settle every point in order, logging each; `after` runs on what is settled so far (a table
    written after every point keeps what an interrupted study has)."""
    done: list[Settled[R]] = []
    for i, point in enumerate(points):
        settled = settle(point)
        done.append(settled)
        result = settled.result
        log.info("[%d/%d] %s: %s %s", i + 1, len(points), settled.name, result.status, result.reason)
        if study_log is not None and child is not None:
            study_log.point(settled.name, settled.trained, child(point, settled))
        if after is not None:
            after(done)
    return done
