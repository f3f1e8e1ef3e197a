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
from swbert.finetune.figures import TRIVIAQA_SUFFIX, Table, Timing, noise_metric, variant_key, variant_label
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
        """The store to read; None when there is none and Figure 2's runs are all there is to report.
        A ValueError says what to pass when there is nothing at all. --runs-dir: a folder holding
        mlflow.db (a project's shared store, or a run folder's own from before it was shared) is read
        whole; else a sweep's folder names its store and its last sweep (`PARENT_FILE`), which becomes
        --parent-run unless that is given."""
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
    glue: list[Trial] = field(default_factory=list)
    squad: list[Trial] = field(default_factory=list)
    noise: dict[tuple[str, str, str], dict[int, dict[float, float]]] = field(default_factory=dict)
    """(variant, task, noise scale) -> noise seed -> noise level (fraction) -> accuracy (else the task's
    own metric) on the main split."""
    cross: dict[str, dict[tuple[str, str, str], float]] = field(default_factory=dict)
    """variant -> (trained on, evaluated on, split) -> accuracy (own labels on the diagonal)."""
    timings: list[Timing] = field(default_factory=list)


def _pct(value: float | None, digits: int = 1) -> str:
    """``value`` (a fraction) in percent with ``digits`` decimals; '–' for a missing value."""
    return "–" if value is None or math.isnan(value) else f"{100 * value:.{digits}f}"


def _csv(value: float) -> object:
    return "" if value is None or math.isnan(value) else round(100 * value, 4)


CHANCE_MARK = "†"  # after a cell whose median hides a seed at chance level (results.at_chance)


def _seed_count(summaries: list[Summary]) -> int:
    """The table's usual number of seeds per cell of several (the most common); a cell with another
    number says so."""
    counts = collections.Counter(len(s.seeds) for s in summaries if len(s.seeds) > 1)
    return counts.most_common(1)[0][0] if counts else 1


def _median_cell(s: Summary | None, split: str, metric: str, n: int, unit: float = 1.0) -> str:
    """The median over seeds, two decimals in percent, and its spread: ``84.12 [83.50–85.01]``, the
    lowest and highest seed (``, n=2`` inside when the cell has other than the table's `n` seeds);
    '–' when missing. `unit`: 1 for fractions (GLUE), 100 for percent (SQuAD)."""
    value = s.median.get(split, {}).get(metric, float("nan")) if s else float("nan")
    text = _pct(value / unit, 2)
    low, high, k = s.spread.get(split, {}).get(metric, (0.0, 0.0, 1)) if s else (0.0, 0.0, 1)
    if k > 1 and not math.isnan(value):
        text += f" [{_pct(low / unit, 2)}–{_pct(high / unit, 2)}{f', n={k}' if k != n else ''}]"
    return text


def _chance_seeds(summaries: list[Summary | None]) -> str:
    """``rte=1,3 cola=2``: the seeds at chance level of each task (the CSV's seeds_at_chance)."""
    return " ".join(
        f"{s.task}={','.join(map(str, sorted(s.at_chance)))}" for s in summaries if s and s.at_chance
    )


def _spread_csv(s: Summary | None, split: str, metric: str, unit: float = 1.0) -> list[object]:
    """The lowest and highest seed of a CSV column, in percent (`_csv`; `unit` as `_median_cell`)."""
    low, high, _ = s.spread.get(split, {}).get(metric, (float("nan"),) * 3) if s else (float("nan"),) * 3
    return [_csv(low / unit), _csv(high / unit)]


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
    """A trial run's identity (kind, variant, task, rates, seed), its best metrics, and its timing
    when it recorded one."""
    tags, params = run.data.tags, run.data.params
    variant, task = tags.get(VARIANT), tags.get(TASK)
    metrics = nest_metrics({k[5:]: v for k, v in run.data.metrics.items() if k.startswith("best/")})
    lr, seed = float(params["learning_rate"]), int(params["seed"])
    later = tuple(float(x) for x in params.get("later_learning_rates", "").split())
    key = (kind, variant, task, lr, later, seed)
    timing = None
    seconds = run.data.metrics.get("seconds_per_epoch")
    if seconds and "batch_size" in params:
        facts = (params.get("attention_type", ""), params.get("batching", "padded"))
        timing = Timing(variant, task, int(params["batch_size"]), seconds, *facts)
    return key, Trial(variant, task, lr, seed, metrics, later_lrs=later), timing


def collect(
    tracking_uri: str, experiment: str, parent_runs: list[str] | None = None, missing_ok: bool = False
) -> Collected:
    """Read finished child runs of ``experiment`` (optionally only those under ``parent_runs``).

    A trial repeated in several sweeps (same variant, task, learning-rate setting and seed) counts once:
    the most recent run wins, so re-running a sweep does not double the seeds.
    """
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


def _columns(summaries: list[Summary], order: str = "paper") -> list[tuple[str, list[str]]]:
    """Table 1's cells in ``order``: (task, its dev splits run); MNLI's two splits share one cell."""
    tasks = {s.task for s in summaries}
    cells: dict[str, list[str]] = {}
    for t, sp in COLUMN_ORDERS[order]:
        if t in tasks:
            cells.setdefault(t, []).append(sp)
    return list(cells.items())


def paper_metric(task: str, split: str, stsb_metric: str = "pearson") -> str:
    """The one metric Table 1 shows (and averages) for a task's dev split."""
    if task == "stsb":
        return stsb_metric
    return PAPER_AVG_METRIC[task][1] if task in PAPER_AVG_METRIC else get_task(task).metrics[0]


def paper_average(by_task: dict[str, Summary], stsb_metric: str = "pearson") -> float:
    """Table 1's Avg: the mean over the paper's eight tasks of one metric each (tasks.PAPER_AVG_METRIC);
    nan unless all eight are there (a mean over fewer tasks is not the paper's number)."""
    values = []
    for task, (split, metric) in PAPER_AVG_METRIC.items():
        s = by_task.get(task)
        metric = stsb_metric if task == "stsb" else metric
        values.append(s.median.get(split, {}).get(metric, float("nan")) if s else float("nan"))
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
    cells = _columns(summaries, order)
    header, csv_header, spread_header = ["Model"], ["variant"], []
    for t, splits in cells:
        extra = " (not in Avg)" if t not in PAPER_AVG_METRIC else ""
        metric = METRIC_ABBREV[paper_metric(t, splits[0], stsb_metric)]
        header.append(f"{_cell_label(t, splits)} ({metric}){extra}")
        names = [f"{split_label(get_task(t), sp)} {m}" for sp in splits for m in get_task(t).metrics]
        csv_header += names
        spread_header += [f"{name} {end}" for name in names for end in ("min", "max")]
    header.append("Avg")
    csv_header += ["avg", "avg_glue_score_ours", "learning_rates", "seeds", *spread_header, "seeds_at_chance"]
    n = _seed_count(summaries)
    rows, csv_rows = [], []
    for variant in sorted({v for v, _ in by}, key=variant_key):
        row, csv_row, spread, scores, lrs, seeds = [variant_label(variant)], [variant], [], [], [], set()
        mine = {t: s for (v, t), s in by.items() if v == variant}
        for t, splits in cells:
            s = mine.get(t)
            meds = [s.median.get(sp, {}) if s else {} for sp in splits]
            metric = paper_metric(t, splits[0], stsb_metric)
            mark = CHANCE_MARK if s and s.at_chance else ""
            row.append("/".join(_median_cell(s, sp, metric, n) for sp in splits) + mark)
            csv_row += [_csv(med.get(m, float("nan"))) for med in meds for m in get_task(t).metrics]
            spread += [x for sp in splits for m in get_task(t).metrics for x in _spread_csv(s, sp, m)]
            scores += [m["score"] for m in meds if not math.isnan(m.get("score", float("nan")))]
            if s:
                lrs.append(f"{t}={s.lr_label}")
                seeds.add(len(s.seeds))
        avg = paper_average(mine, stsb_metric)
        row.append(_pct(avg, 2))
        ours = float(np.mean(scores)) if scores else float("nan")
        csv_row += [_csv(avg), _csv(ours), " ".join(dict.fromkeys(lrs)), "/".join(map(str, sorted(seeds)))]
        rows.append(row)
        csv_rows.append(csv_row + spread + [_chance_seeds([mine.get(t) for t, _ in cells])])
    note = (
        "Avg: the mean over the paper's eight tasks (MRPC, CoLA, MNLI-m, QQP, RTE, STS-B, QNLI, SST-2) "
        f"of the metric shown, MNLI matched only, STS-B as {stsb_metric.capitalize()}; '–' unless all eight "
        "were run. The CSV's avg_glue_score_ours is the mean of GLUE's task scores over every task run "
        "(ours). Each number: the median over seeds at the best learning-rate setting (ours)."
    )
    note = " ".join(filter(None, [note, spread_note(summaries)]))
    return Table(
        "Table 1: GLUE dev (median over seeds, best learning rate)", header, rows, csv_header, csv_rows, note
    )


def squad_average(em_f1: list[tuple[float, float]]) -> tuple[float, float]:
    """Table 2's "Average": the mean EM and the mean F1 over the SQuAD versions, nan unless both v1.1
    and v2.0 are there (the paper averages its two columns)."""
    if len(em_f1) < 2:
        return float("nan"), float("nan")
    return float(np.mean([em for em, _ in em_f1])), float(np.mean([f1 for _, f1 in em_f1]))


def squad_table(summaries: list[Summary]) -> Table:
    """Table 2: EM/F1 per SQuAD version and their average over v1.1 and v2.0, two decimals as the paper
    prints it, each median with its spread over seeds and a mark where a seed scored at chance level;
    ``NAME+triviaqa`` rows are the paper's "single + TriviaQA"."""
    by = {(s.variant, s.task): s for s in summaries}
    versions = [v for v in ("1.1", "2.0") if any(t == f"squad{v}" for _, t in by)]
    both = len(versions) == 2
    header = ["Model"] + [f"SQuAD v{v} (EM/F1)" for v in versions] + (["Average (EM/F1)"] if both else [])
    csv_header = (
        ["variant"]
        + [f"v{v} {m}" for v in versions for m in ("exact", "f1")]
        + (["average exact", "average f1"] if both else [])
        + ["learning_rates", "seeds"]
        + [f"v{v} {m} {end}" for v in versions for m in ("exact", "f1") for end in ("min", "max")]
        + ["seeds_at_chance"]
    )
    rows, csv_rows = [], []
    shown = [s for s in summaries if s.task.startswith("squad")]
    n = _seed_count(shown)
    squad_variants = sorted({v for v, t in by if t.startswith("squad")}, key=variant_key)
    for variant in squad_variants:
        row, csv_row, lrs, seeds, pairs, spread = [variant_label(variant)], [variant], [], set(), [], []
        mine = [by.get((variant, f"squad{v}")) for v in versions]
        for v, s in zip(versions, mine):
            med = s.median.get("validation", {}) if s else {}
            em, f1 = med.get("exact", float("nan")), med.get("f1", float("nan"))
            cell = "/".join(_median_cell(s, "validation", m, n, unit=100.0) for m in ("exact", "f1"))
            row.append(cell + (CHANCE_MARK if s and s.at_chance else ""))
            csv_row += [em, f1]
            spread += [x for m in ("exact", "f1") for x in _spread_csv(s, "validation", m, unit=100.0)]
            if s:
                pairs.append((em, f1))
                lrs.append(f"v{v}={s.lr_label}")
                seeds.add(len(s.seeds))
        if both:
            avg = squad_average(pairs)
            row.append(f"{_pct(avg[0] / 100, 2)}/{_pct(avg[1] / 100, 2)}")
            csv_row += list(avg)
        rows.append(row)
        csv_rows.append(
            csv_row + [" ".join(lrs), "/".join(map(str, sorted(seeds)))] + spread + [_chance_seeds(mine)]
        )
    notes = ["Average: the mean of v1.1 and v2.0 (the paper's Average column)."] if both else []
    if any(v.endswith(TRIVIAQA_SUFFIX) for v in squad_variants):
        notes.append(
            "A '+ TriviaQA' row was fine-tuned on TriviaQA reading comprehension first, then on SQuAD."
        )
    notes.append(spread_note(shown))
    title = "Table 2: SQuAD dev (median over seeds, best learning rate)"
    return Table(title, header, rows, csv_header, csv_rows, " ".join(filter(None, notes)))


def noise_table(noise: dict[tuple[str, str, str], dict[int, dict[float, float]]], scale: str) -> Table:
    """Table 5 for one noise definition: mean (over noise seeds) accuracy at each noise level."""
    noise = {k: v for k, v in noise.items() if k[2] == scale}
    levels = sorted({lvl for seeds in noise.values() for curve in seeds.values() for lvl in curve})
    tasks = sorted({t for _, t, _ in noise})
    header = ["Model"] + (["Task"] if len(tasks) > 1 else []) + [f"{round(100 * lvl)}%" for lvl in levels]
    csv_header = (
        ["variant", "task", "metric"]
        + [f"{round(100 * lvl)}% {s}" for lvl in levels for s in ("mean", "std")]
        + ["noise_seeds"]
    )
    rows, csv_rows = [], []
    for variant, task, _ in sorted(noise, key=lambda k: (variant_key(k[0]), k[1])):
        seeds = noise[(variant, task, scale)]
        t = get_task(task)
        metric = noise_metric(t)
        label = split_label(t, t.main_split) + ("" if metric == "accuracy" else f" ({METRIC_ABBREV[metric]})")
        row = [variant_label(variant)] + ([label] if len(tasks) > 1 else [])
        csv_row: list[object] = [variant, task, metric]
        for lvl in levels:
            vals = [c[lvl] for c in seeds.values() if lvl in c]
            mean = float(np.mean(vals)) if vals else float("nan")
            row.append(_pct(mean))
            csv_row += [round(100 * mean, 4), round(100 * float(np.std(vals)), 4)] if vals else ["", ""]
        rows.append(row)
        csv_rows.append(csv_row + [len(seeds)])
    return Table(NOISE_TITLES.get(scale, f"Table 5 ({scale} noise)"), header, rows, csv_header, csv_rows)


def cross_domain_table(cross: dict[str, dict[tuple[str, str, str], float]]) -> Table:
    """Table 6: per variant, rows trained on, columns evaluated on (each task's main dev split)."""
    order = {t: i for i, t in enumerate(CROSS_DOMAIN_TASKS)}
    tasks = sorted({k[0] for v in cross.values() for k in v} | {k[1] for v in cross.values() for k in v},
                   key=lambda t: (order.get(t, 9), t))  # fmt: skip
    main = {t: get_task(t).main_split for t in tasks}
    names = [split_label(get_task(t), main[t]) for t in tasks]
    header = ["Model", "Trained on"] + names
    csv_header = ["variant", "trained_on"] + [f"{n} accuracy" for n in names]
    rows, csv_rows = [], []
    for variant in sorted(cross, key=variant_key):
        sources = sorted({k[0] for k in cross[variant]}, key=lambda t: (order.get(t, 9), t))
        for source in sources:
            vals = [cross[variant].get((source, t, main[t]), float("nan")) for t in tasks]
            cells = [f"**{_pct(v)}**" if t == source else _pct(v) for t, v in zip(tasks, vals)]
            rows.append([variant_label(variant), split_label(get_task(source), main[source]), *cells])
            csv_rows.append([variant, source, *[_csv(v) for v in vals]])
    return Table(
        "Table 6: cross-domain accuracy (rows: fine-tuned on; columns: evaluated on)",
        header,
        rows,
        csv_header,
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
