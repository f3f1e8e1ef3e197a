"""Fine-tuning runs in MLflow (and pretraining runs' metrics.jsonl) -> the paper's Tables 1, 2, 5 and 6
(Figures 2 and 3: `swbert.finetune.figures`). How each table reads the paper, and what is ours (the
median over seeds at the best learning-rate setting, Table 1's Avg, the noise definitions), is in
docs/finetuning.md ("Tables and figures"). GLUE numbers are in percent (correlations x 100)."""

from __future__ import annotations

import collections
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from swbert.finetune import figures
from swbert.finetune.cross_domain import CROSS_DOMAIN_TASKS
from swbert.finetune.figures import TRIVIAQA_SUFFIX, Timing, noise_metric, variant_key, variant_label
from swbert.finetune.results import (
    CHANCE_RULE,
    DEFAULT_EXPERIMENT,
    TASK,
    VARIANT,
    Summary,
    Trial,
    chance_metric,
    is_qa,
    nest_metrics,
    task_summaries,
)
from swbert.finetune.tasks import COLUMN_ORDERS, PAPER_AVG_METRIC, get_task, split_label
from swbert.runtime.tracking import STORE_FILE, mlflow_client
from swbert.studies.outputs import Table
from swbert.studies.records import read_json
from swbert.studies.tracking import KIND, PARENT_FILE

log = logging.getLogger(__name__)

METRIC_ABBREV = {"accuracy": "Acc", "f1": "F1", "matthews": "MCC", "pearson": "P", "spearman": "S"}
NOISE_TABLES = {"unit": "table5_noise", "norm": "table5_noise_relative"}
NOISE_TITLES = {
    "norm": "Table 5: dev accuracy under Gaussian embedding noise of RMS norm level x the mean input "
    "embedding norm (the paper's levels, a percentage of the input embedding norm)",
    "unit": "Table 5 (ours, std-1 noise): dev accuracy under Gaussian embedding noise of standard "
    "deviation 1 x level (the level as a multiplier, not a share of the norm)",
}


@dataclass
class ReportConfig:
    """The flags of `launchers/report.py`: where the runs are and where the tables and figures go."""

    out: Path  # folder for the .md/.csv/.png files
    # a sweep's --output-dir (its store, its last sweep only unless --parent-run) or a folder holding
    # mlflow.db (every run in it): swbert.runtime.tracking says where a run's store is
    runs_dir: Path | None = None
    # MLflow store (default: $MLFLOW_TRACKING_URI, else --runs-dir's)
    tracking_uri: str | None = None
    experiment: str = DEFAULT_EXPERIMENT  # MLflow experiment of the sweeps
    parent_run: list[str] | None = None  # only runs under these sweep (parent) run ids
    # Figure 2: pretraining runs as NAME=RUN_DIR (a folder holding metrics.jsonl); NAME labels the curve
    pretrain_runs: list[str] = field(default_factory=list)
    # Table 1's STS-B number (and its share of Avg): the paper's metric is not known to us; Pearson is our reading
    stsb_metric: Literal["pearson", "spearman"] = "pearson"
    # Table 1's columns: the paper's order (MRPC, CoLA, MNLI m/mm, QQP, RTE, STS-B, QNLI, SST-2) or GLUE's
    column_order: Literal["paper", "glue"] = "paper"
    # Figure 3: only trials fine-tuned at this global batch size (the paper's 16); none: every trial
    timing_batch_size: int | None = 16
    baseline: str = "standard"  # Figure 3: the variant whose time the others' savings are relative to

    def check(self) -> None:
        if self.runs_dir is not None and self.tracking_uri is not None:
            raise ValueError("--runs-dir and --tracking-uri name two stores: give one")
        self.pretrain_curves()  # bad NAME=RUN_DIR specs fail before anything is read

    def uri(self) -> str | None:
        """The store to read (None: Figure 2's runs are all there is). --runs-dir: a folder holding
        mlflow.db (a project's shared store, or a run folder's own from before it was shared) is read
        whole; a sweep's folder names its store and its last sweep (`PARENT_FILE`, the --parent-run)."""
        if self.runs_dir is not None:
            db = self.runs_dir / STORE_FILE
            if db.is_file():
                return f"sqlite:///{db.resolve()}"
            sweep = read_json(self.runs_dir / PARENT_FILE)
            if not isinstance(sweep, dict) or not sweep.get("tracking_uri"):
                raise ValueError(
                    f"--runs-dir {self.runs_dir}: neither {STORE_FILE} nor a sweep's {PARENT_FILE} there; "
                    "pass a fine-tuning launcher's --output-dir, or the folder holding the runs' mlflow.db"
                )
            self.parent_run = self.parent_run or [sweep["run_id"]]
            return sweep["tracking_uri"]
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri and not self.pretrain_runs:
            raise ValueError(
                "say where the runs are: --runs-dir, --tracking-uri or MLFLOW_TRACKING_URI "
                "(and/or --pretrain-runs NAME=RUN_DIR for Figure 2)"
            )
        return uri or None

    def pretrain_curves(self) -> dict[str, Path]:
        """``--pretrain-runs`` as {name: run folder}, each checked to hold a metrics.jsonl."""
        out: dict[str, Path] = {}
        for spec in self.pretrain_runs:
            name, sep, path = spec.partition("=")
            if not sep:
                name, path = Path(spec).name, spec
            if not (Path(path) / "metrics.jsonl").is_file():
                raise ValueError(
                    f"--pretrain-runs {spec}: {path}/metrics.jsonl not found; pass a pretraining run folder"
                )
            if name in out:
                raise ValueError(f"--pretrain-runs: two runs named {name!r}; write them as NAME=RUN_DIR")
            out[name] = Path(path)
        return out


@dataclass
class Collected:
    """What `collect` read from a store: the trials, Table 5's noise curves and Table 6's accuracies."""

    glue: list[Trial] = field(default_factory=list)
    squad: list[Trial] = field(default_factory=list)
    # (variant, task, noise scale) -> noise seed -> noise level (fraction) -> accuracy (else the task's
    # own metric) on the main split
    noise: dict[tuple[str, str, str], dict[int, dict[float, float]]] = field(default_factory=dict)
    # variant -> (trained on, evaluated on, split) -> accuracy (own labels on the diagonal)
    cross: dict[str, dict[tuple[str, str, str], float]] = field(default_factory=dict)
    timings: list[Timing] = field(default_factory=list)


def _pct(value: float | None, digits: int = 1) -> str:
    """``value`` (a fraction) in percent with ``digits`` decimals; '–' for a missing value."""
    return "–" if value is None or math.isnan(value) else f"{100 * value:.{digits}f}"


def _csv(value: float) -> object:
    return "" if value is None or math.isnan(value) else round(100 * value, 4)


CHANCE_MARK = "†"  # after a cell whose median hides a seed at chance level (results.at_chance)
# a cell of Table 1 or 2: its summary, the (split, metric) pairs shown, and those in the CSV
Cell = tuple[Summary | None, list[tuple[str, str]], list[tuple[str, str]]]


def _seed_count(summaries: list[Summary]) -> int:
    """The most common number of seeds among a table's cells of several (a cell with another says so)."""
    counts = collections.Counter(len(s.seeds) for s in summaries if len(s.seeds) > 1)
    return counts.most_common(1)[0][0] if counts else 1


def _median(s: Summary | None, split: str, metric: str) -> float:
    return s.median.get(split, {}).get(metric, float("nan")) if s else float("nan")


def _spread(s: Summary | None, split: str, metric: str) -> tuple[float, float, int]:
    none = (float("nan"), float("nan"), 0)
    return s.spread.get(split, {}).get(metric, none) if s else none


def _median_cell(s: Summary | None, split: str, metric: str, n: int, unit: float) -> str:
    """The median over seeds, two decimals in percent, and its spread: ``84.12 [83.50–85.01]``, the
    lowest and highest seed (``, n=2`` inside when the cell has other than the table's `n` seeds);
    '–' when missing. `unit`: 1 for fractions (GLUE), 100 for percent (SQuAD)."""
    value = _median(s, split, metric)
    low, high, k = _spread(s, split, metric)
    text = _pct(value / unit, 2)
    if k > 1 and not math.isnan(value):
        text += f" [{_pct(low / unit, 2)}–{_pct(high / unit, 2)}{f', n={k}' if k != n else ''}]"
    return text


def _variant_row(cells: dict[str, Cell], n: int, unit: float) -> tuple[list[str], list[float], list[object]]:
    """One variant's row of Table 1 or 2 from its cells by name: the markdown cells, the CSV's medians,
    and the CSV's columns after the table's own (`_csv_header`)."""
    md, medians, spread = [], [], []
    for s, shown, columns in cells.values():
        mark = CHANCE_MARK if s and s.at_chance else ""
        md.append("/".join(_median_cell(s, sp, m, n, unit) for sp, m in shown) + mark)
        medians += [_median(s, sp, m) for sp, m in columns]
        spread += [_csv(x / unit) for sp, m in columns for x in _spread(s, sp, m)[:2]]
    run = {name: s for name, (s, _, _) in cells.items() if s}
    lrs = " ".join(f"{name}={s.lr_label}" for name, s in run.items())
    seeds = "/".join(map(str, sorted({len(s.seeds) for s in run.values()})))
    at_chance = [f"{s.task}={','.join(map(str, sorted(s.at_chance)))}" for s in run.values() if s.at_chance]
    return md, medians, [lrs, seeds, *spread, " ".join(at_chance)]


def _csv_header(names: list[str], extra: list[str]) -> list[str]:
    """Table 1's and 2's CSV columns: the medians' `names`, the table's `extra`, then `_variant_row`'s."""
    ends = [f"{name} {end}" for name in names for end in ("min", "max")]
    return ["variant", *names, *extra, "learning_rates", "seeds", *ends, "seeds_at_chance"]


def spread_note(summaries: list[Summary]) -> str:
    """What a table's brackets and its chance mark mean, for the table's note ('' when neither shows)."""
    notes = []
    if any(len(s.seeds) > 1 for s in summaries):
        notes.append(
            f"[a–b]: the lowest and highest of the n = {_seed_count(summaries)} seeds at that setting "
            "(n=K in a cell with another number; none for one seed); the CSV's min/max columns (ours)."
        )
    if any(s.at_chance for s in summaries):
        notes.append(f"{CHANCE_MARK} a seed scored at chance level ({CHANCE_RULE}): the median may hide a "
                     "failed run; the CSV's seeds_at_chance names it.")  # fmt: skip
    return " ".join(notes)


def warn_at_chance(summaries: list[Summary], table: str) -> None:
    """One console warning per (variant, task) whose median hides a seed at chance level."""
    for s in summaries:
        if s.at_chance:
            split, metric = chance_metric(s.task)
            unit = 1.0 if is_qa(s.task) else 100.0
            scores = ", ".join(f"seed {k} {unit * v:.2f}" for k, v in sorted(s.at_chance.items()))
            log.warning(
                "%s: %s %s: %s at chance level (%s %s in percent, chance %.2f): a failed run inside the "
                "median over %d seed(s)", table, s.variant, s.task, scores, split, metric, unit * s.chance,
                len(s.seeds),
            )  # fmt: skip


# ---------------------------------------------------------------------------------------- collecting


def _trial(run: Any, kind: str) -> tuple[tuple, Trial, Timing | None]:
    """A trial run's identity (kind, variant, task, rates, seed), its best metrics, and its timing."""
    tags, params = run.data.tags, run.data.params
    variant, task = tags.get(VARIANT), tags.get(TASK)
    metrics = nest_metrics({k[5:]: v for k, v in run.data.metrics.items() if k.startswith("best/")})
    lr, seed = float(params["learning_rate"]), int(params["seed"])
    later = tuple(float(x) for x in params.get("later_learning_rates", "").split())
    key = (kind, variant, task, lr, later, seed)
    timing = None
    seconds = run.data.metrics.get("seconds_per_epoch")
    if seconds and "batch_size" in params:
        timing = Timing(variant, task, int(params["batch_size"]), seconds, params.get("batching", "padded"))
    return key, Trial(variant, task, lr, seed, metrics, later_lrs=later), timing


def collect(
    tracking_uri: str, experiment: str, parent_runs: list[str] | None = None, missing_ok: bool = False
) -> Collected:
    """Finished child runs of ``experiment`` (only those under ``parent_runs`` when given). A trial
    repeated in several sweeps (same variant, task, learning-rate setting and seed) counts once: the
    most recent run wins, so re-running a sweep does not double the seeds."""
    client = mlflow_client(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        if missing_ok:
            return Collected()
        raise ValueError(f"no MLflow experiment {experiment!r} at {tracking_uri}")
    runs = client.search_runs(
        [exp.experiment_id],
        filter_string="attributes.status = 'FINISHED'",
        max_results=50000,
        order_by=["attributes.start_time ASC"],
    )
    if parent_runs:
        runs = [r for r in runs if r.data.tags.get("mlflow.parentRunId") in set(parent_runs)]
    out = Collected()
    trials: dict[tuple, Trial] = {}
    timings: dict[tuple, Timing] = {}
    for r in runs:
        tags, params, kind = r.data.tags, r.data.params, r.data.tags.get(KIND)
        variant, task = tags.get(VARIANT), tags.get(TASK)
        if kind in ("glue_trial", "squad_trial"):
            key, trial, timing = _trial(r, kind)
            trials[key] = trial
            if timing is not None:
                timings[key] = timing
        elif kind == "noise":
            t = get_task(task)
            seed = int(params.get("noise_seed", 0))
            scale = params.get("noise_scale", "norm")  # runs from before both definitions: relative
            history = client.get_metric_history(r.info.run_id, f"{t.main_split}/{noise_metric(t)}")
            out.noise.setdefault((variant, task, scale), {})[seed] = {m.step / 100: m.value for m in history}
        elif kind == "cross_domain":
            own_labels = params.get("diagonal") == "own_labels"
            for key, value in r.data.metrics.items():
                target, split, metric = key.split("/")
                # an older run scored its diagonal in the binary mapping: left out, not mislabelled
                if metric == "accuracy" and (target != task or own_labels):
                    out.cross.setdefault(variant, {})[(task, target, split)] = value
    for (kind, *_), t in trials.items():
        (out.glue if kind == "glue_trial" else out.squad).append(t)
    out.timings = list(timings.values())
    return out


# ------------------------------------------------------------------------------------------- tables


def paper_metric(task: str, stsb_metric: str = "pearson") -> str:
    """The one metric Table 1 shows (and averages) for a task."""
    if task == "stsb":
        return stsb_metric
    return PAPER_AVG_METRIC[task][1] if task in PAPER_AVG_METRIC else get_task(task).metrics[0]


def paper_average(by_task: dict[str, Summary], stsb_metric: str = "pearson") -> float:
    """Table 1's Avg: the mean over the paper's eight tasks of one metric each (tasks.PAPER_AVG_METRIC);
    nan unless all eight are there (a mean over fewer tasks is not the paper's number)."""
    values = [
        _median(by_task.get(t), split, paper_metric(t, stsb_metric))
        for t, (split, _) in PAPER_AVG_METRIC.items()
    ]
    return float("nan") if any(math.isnan(v) for v in values) else float(np.mean(values))


def _cell_label(task: str, splits: list[str]) -> str:
    """``MNLI m/mm`` for MNLI's one cell of two splits (Table 1's "MNLI (m/mm)"), else the split's label."""
    t = get_task(task)
    if len(splits) == 1:
        return split_label(t, splits[0])
    short = "/".join(split_label(t, sp).rpartition("-")[2] for sp in splits)  # m/mm
    return f"{split_label(t, 'validation')} {short}"


def glue_table(summaries: list[Summary], stsb_metric: str = "pearson", order: str = "paper") -> Table:
    """Table 1 from GLUE summaries (`swbert.finetune.results.task_summaries`), two decimals as
    the paper prints it, columns in the paper's order (or GLUE's: ``order="glue"``); each median with
    its spread over seeds, and a mark where a seed scored at chance level."""
    by = {(s.variant, s.task): s for s in summaries}
    columns: dict[str, list[str]] = {}  # task -> its dev splits run, in `order`; MNLI's two share a cell
    for t, sp in COLUMN_ORDERS[order]:
        if any(task == t for _, task in by):
            columns.setdefault(t, []).append(sp)
    header, names, pairs = ["Model"], [], {}
    for t, splits in columns.items():
        task, metric = get_task(t), paper_metric(t, stsb_metric)
        extra = " (not in Avg)" if t not in PAPER_AVG_METRIC else ""
        header.append(f"{_cell_label(t, splits)} ({METRIC_ABBREV[metric]}){extra}")
        pairs[t] = ([(sp, metric) for sp in splits], [(sp, m) for sp in splits for m in task.metrics])
        names += [f"{split_label(task, sp)} {m}" for sp, m in pairs[t][1]]
    n = _seed_count(summaries)
    rows, csv_rows = [], []
    for variant in sorted({v for v, _ in by}, key=variant_key):
        mine = {t: by.get((variant, t)) for t in pairs}
        md, medians, tail = _variant_row({t: (mine[t], *pairs[t]) for t in pairs}, n, 1.0)
        avg = paper_average(mine, stsb_metric)
        scores = [_median(mine[t], sp, "score") for t, (shown, _) in pairs.items() for sp, _ in shown]
        ours = float(np.mean([v for v in scores if not math.isnan(v)] or [float("nan")]))
        rows.append([variant_label(variant), *md, _pct(avg, 2)])
        csv_rows.append([variant, *map(_csv, medians), _csv(avg), _csv(ours), *tail])
    note = (
        "Avg: the mean over the paper's eight tasks (MRPC, CoLA, MNLI-m, QQP, RTE, STS-B, QNLI, SST-2) "
        f"of the metric shown, MNLI matched only, STS-B as {stsb_metric.capitalize()}; '–' unless all eight "
        "were run. The CSV's avg_glue_score_ours is the mean of GLUE's task scores over every task run "
        "(ours). Each number: the median over seeds at the best learning-rate setting (ours)."
    )
    title = "Table 1: GLUE dev (median over seeds, best learning rate)"
    csv_header = _csv_header(names, ["avg", "avg_glue_score_ours"])
    note = " ".join(filter(None, [note, spread_note(summaries)]))
    return Table(title, [*header, "Avg"], rows, csv_header, csv_rows, note)


def squad_average(em_f1: list[tuple[float, float]]) -> tuple[float, float]:
    """Table 2's "Average": the mean EM and the mean F1 over the SQuAD versions, nan unless both v1.1
    and v2.0 are there (the paper averages its two columns)."""
    if len(em_f1) < 2:
        return float("nan"), float("nan")
    return float(np.mean([em for em, _ in em_f1])), float(np.mean([f1 for _, f1 in em_f1]))


def squad_table(summaries: list[Summary]) -> Table:
    """Table 2 from SQuAD summaries: EM/F1 per version and their average over v1.1 and v2.0, two
    decimals as the paper prints it, each median with its spread over seeds and a mark where a seed
    scored at chance level; ``NAME+triviaqa`` rows are the paper's "single + TriviaQA"."""
    by = {(s.variant, s.task): s for s in summaries}
    versions = [v for v in ("1.1", "2.0") if any(t == f"squad{v}" for _, t in by)]
    both = len(versions) == 2
    header = ["Model"] + [f"SQuAD v{v} (EM/F1)" for v in versions] + (["Average (EM/F1)"] if both else [])
    em, f1 = ("validation", "exact"), ("validation", "f1")
    n = _seed_count(summaries)
    variants = sorted({v for v, _ in by}, key=variant_key)
    rows, csv_rows = [], []
    for variant in variants:
        mine = {f"v{v}": by.get((variant, f"squad{v}")) for v in versions}
        md, medians, tail = _variant_row({k: (s, [em, f1], [em, f1]) for k, s in mine.items()}, n, 100.0)
        row, csv_row = [variant_label(variant), *md], [variant, *medians]
        if both:
            avg = squad_average([(_median(s, *em), _median(s, *f1)) for s in mine.values() if s])
            row.append(f"{_pct(avg[0] / 100, 2)}/{_pct(avg[1] / 100, 2)}")
            csv_row += avg
        rows.append(row)
        csv_rows.append(csv_row + tail)
    notes = ["Average: the mean of v1.1 and v2.0 (the paper's Average column)."] if both else []
    if any(v.endswith(TRIVIAQA_SUFFIX) for v in variants):
        notes.append(
            "A '+ TriviaQA' row was fine-tuned on TriviaQA reading comprehension first, then on SQuAD."
        )
    notes.append(spread_note(summaries))
    title = "Table 2: SQuAD dev (median over seeds, best learning rate)"
    names = [f"v{v} {m}" for v in versions for m in ("exact", "f1")]
    csv_header = _csv_header(names, ["average exact", "average f1"] if both else [])
    return Table(title, header, rows, csv_header, csv_rows, " ".join(filter(None, notes)))


def noise_table(noise: dict[tuple[str, str, str], dict[int, dict[float, float]]], scale: str) -> Table:
    """Table 5 for one noise definition: mean (over noise seeds) accuracy at each noise level."""
    curves = figures.noise_curves(noise, scale)
    levels = sorted({lvl for curve in curves.values() for lvl in curve})
    several = len({t for _, t in curves}) > 1
    header = ["Model"] + (["Task"] if several else []) + [f"{round(100 * lvl)}%" for lvl in levels]
    csv_header = ["variant", "task", "metric"]
    csv_header += [f"{round(100 * lvl)}% {s}" for lvl in levels for s in ("mean", "std")] + ["noise_seeds"]
    rows, csv_rows = [], []
    for (variant, task), curve in curves.items():
        t = get_task(task)
        metric = noise_metric(t)
        label = split_label(t, t.main_split) + ("" if metric == "accuracy" else f" ({METRIC_ABBREV[metric]})")
        row = [variant_label(variant)] + ([label] if several else [])
        csv_row: list[object] = [variant, task, metric]
        for vals in (curve.get(lvl, []) for lvl in levels):
            mean = float(np.mean(vals)) if vals else float("nan")
            row.append(_pct(mean))
            csv_row += [round(100 * mean, 4), round(100 * float(np.std(vals)), 4)] if vals else ["", ""]
        rows.append(row)
        csv_rows.append(csv_row + [len(noise[(variant, task, scale)])])
    return Table(NOISE_TITLES[scale], header, rows, csv_header, csv_rows)


def cross_domain_table(cross: dict[str, dict[tuple[str, str, str], float]]) -> Table:
    """Table 6: per variant, rows trained on, columns evaluated on (each task's main dev split)."""
    order = {t: i for i, t in enumerate(CROSS_DOMAIN_TASKS)}
    tasks = sorted(
        {t for pairs in cross.values() for k in pairs for t in k[:2]}, key=lambda t: (order.get(t, 9), t)
    )
    main = {t: get_task(t).main_split for t in tasks}
    names = [split_label(get_task(t), main[t]) for t in tasks]
    rows, csv_rows = [], []
    for variant in sorted(cross, key=variant_key):
        for source in [t for t in tasks if any(k[0] == t for k in cross[variant])]:
            vals = [cross[variant].get((source, t, main[t]), float("nan")) for t in tasks]
            cells = [f"**{_pct(v)}**" if t == source else _pct(v) for t, v in zip(tasks, vals)]
            rows.append([variant_label(variant), split_label(get_task(source), main[source]), *cells])
            csv_rows.append([variant, source, *map(_csv, vals)])
    return Table(
        "Table 6: cross-domain accuracy (rows: fine-tuned on; columns: evaluated on)",
        ["Model", "Trained on", *names],
        rows,
        ["variant", "trained_on", *(f"{n} accuracy" for n in names)],
        csv_rows,
        "Diagonal (bold): the task's own labels (MNLI 3-way). Off the diagonal, the model's classes and the "
        "target's labels are mapped to one binary question, entailment/duplicate/equivalent or not (ours).",
    )


def build_report(
    collected: Collected,
    out_dir: Path,
    stsb_metric: str = "pearson",
    pretrain_runs: dict[str, Path] | None = None,
    timing_batch_size: int | None = 16,
    baseline: str = "standard",
    column_order: str = "paper",
) -> dict[str, Table]:
    """Write every table and figure that has data: ``table1_glue``, ``table2_squad``, ``table5_noise``
    (+ ``_relative``, with their plots), ``table6_cross_domain``, ``figure2_pretrain_loss`` (from
    ``pretrain_runs``: name -> run folder) and ``figure3_finetune_time``."""
    tables: dict[str, Table] = {}
    if collected.glue:
        glue = task_summaries(collected.glue)
        tables["table1_glue"] = glue_table(glue, stsb_metric, column_order)
        warn_at_chance(glue, "Table 1")
    if any(t.task.startswith("squad") for t in collected.squad):
        squad = [s for s in task_summaries(collected.squad) if s.task.startswith("squad")]
        tables["table2_squad"] = squad_table(squad)
        warn_at_chance(squad, "Table 2")
    for scale, stem in NOISE_TABLES.items():
        if any(k[2] == scale for k in collected.noise):
            tables[stem] = noise_table(collected.noise, scale)
            figures.plot_noise(collected.noise, scale, out_dir / f"{stem}.png")
    if collected.cross:
        tables["table6_cross_domain"] = cross_domain_table(collected.cross)
    timings = [t for t in collected.timings if timing_batch_size is None or t.batch_size == timing_batch_size]
    if timings:
        tables["figure3_finetune_time"] = figures.timing_table(timings, baseline, timing_batch_size)
        figures.plot_timing(timings, baseline, out_dir / "figure3_finetune_time.png")
    elif collected.timings:
        log.info("no trial at batch size %s: Figure 3 left out (--timing-batch-size)", timing_batch_size)
    if pretrain_runs:
        figures.pretraining_figure(pretrain_runs, out_dir)
    for stem, table in tables.items():
        table.write(out_dir, stem)
    return tables
