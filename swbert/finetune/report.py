"""Collect fine-tuning runs from MLflow into the paper's table layouts (markdown and CSV) and plots.

* Table 1 (GLUE): variants as rows, the GLUE dev columns (MNLI-m, MNLI-mm, QQP, QNLI, SST-2, CoLA,
  STS-B, MRPC, RTE, WNLI) and their average; median over seeds at the best learning rate.
* Table 2 (SQuAD): EM/F1 for v1.1 and v2.0, same aggregation (selection by F1).
* Table 5 (robustness): variants (x task) as rows, noise levels 0-40% as columns; the mean over noise
  seeds of the task score. ``noise.png`` plots the curves.
* Table 6 (cross-domain): variants as rows, one column per (fine-tuned on -> evaluated on) pair.

GLUE numbers are printed in percent (correlations x 100), as papers do.
"""

from __future__ import annotations

import csv
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from swbert.finetune.cross_domain import CROSS_DOMAIN_TASKS
from swbert.finetune.results import Summary, Trial, summarize
from swbert.finetune.tasks import TABLE1_COLUMNS, get_task, split_label
from swbert.finetune.tracking import DEFAULT_EXPERIMENT, KIND, TASK, VARIANT

VARIANT_ORDER = ("standard", "symmetric", "pairwise", "shared")  # the paper's row order
METRIC_ABBREV = {"accuracy": "Acc", "f1": "F1", "matthews": "MCC", "pearson": "P", "spearman": "S"}


@dataclass
class ReportConfig:
    """The flags of `launchers/report.py`: where the runs are and where the tables go."""

    out: Path  # folder for the .md/.csv/.png files
    runs_dir: Path | None = None  # a launcher's --output-dir holding mlflow.db
    tracking_uri: str | None = (
        None  # MLflow store (default: $MLFLOW_TRACKING_URI, else --runs-dir's mlflow.db)
    )
    experiment: str = DEFAULT_EXPERIMENT  # MLflow experiment of the sweeps
    parent_run: list[str] | None = None  # only runs under these sweep (parent) run ids

    def check(self) -> None:
        if self.runs_dir is not None and self.tracking_uri is not None:
            raise ValueError("--runs-dir and --tracking-uri name two stores: give one")

    def uri(self) -> str:
        """The store to read; a ValueError says what to pass when there is none."""
        if self.runs_dir is not None:
            db = self.runs_dir / "mlflow.db"
            if not db.is_file():
                raise ValueError(f"--runs-dir {self.runs_dir}: no mlflow.db there")
            return f"sqlite:///{db.resolve()}"
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            raise ValueError("say where the runs are: --runs-dir, --tracking-uri or MLFLOW_TRACKING_URI")
        return uri


@dataclass
class Table:
    """One table: markdown header/rows (formatted) and CSV header/rows (raw numbers)."""

    title: str
    header: list[str]
    rows: list[list[str]]
    csv_header: list[str]
    csv_rows: list[list[object]]

    def markdown(self) -> str:
        lines = [f"### {self.title}", "", "| " + " | ".join(self.header) + " |"]
        lines.append("|" + "|".join(["---"] + ["---:"] * (len(self.header) - 1)) + "|")
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines) + "\n"

    def write(self, out_dir: Path, stem: str) -> list[Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        md, cs = out_dir / f"{stem}.md", out_dir / f"{stem}.csv"
        md.write_text(self.markdown(), encoding="utf-8")
        with open(cs, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(self.csv_header)
            w.writerows(self.csv_rows)
        return [md, cs]


@dataclass
class Collected:
    glue: list[Trial] = field(default_factory=list)
    squad: list[Trial] = field(default_factory=list)
    noise: dict[tuple[str, str], dict[int, dict[float, float]]] = field(default_factory=dict)
    """(variant, task) -> noise seed -> noise level (fraction) -> task score on the main split."""
    cross: dict[str, dict[tuple[str, str, str], float]] = field(default_factory=dict)
    """variant -> (source task, target task, target split) -> binary accuracy."""


def variant_key(name: str) -> tuple[int, str]:
    return (VARIANT_ORDER.index(name) if name in VARIANT_ORDER else len(VARIANT_ORDER), name)


def _pct(value: float | None, digits: int = 1) -> str:
    return "–" if value is None or math.isnan(value) else f"{100 * value:.{digits}f}"


# ---------------------------------------------------------------------------------------- collecting


def collect(tracking_uri: str, experiment: str, parent_runs: list[str] | None = None) -> Collected:
    """Read finished child runs of ``experiment`` (optionally only those under ``parent_runs``).

    A trial repeated in several sweeps (same variant, task, learning rate and seed) counts once: the
    most recent run wins, so re-running a sweep does not double the seeds.
    """
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
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
    for r in runs:
        tags, kind = r.data.tags, r.data.tags.get(KIND)
        variant, task = tags.get(VARIANT), tags.get(TASK)
        if kind in ("glue_trial", "squad_trial"):
            metrics: dict[str, dict[str, float]] = defaultdict(dict)
            for key, value in r.data.metrics.items():
                if key.startswith("best/"):
                    split, _, metric = key[5:].rpartition("/")
                    metrics[split][metric] = value
            lr, seed = float(r.data.params["learning_rate"]), int(r.data.params["seed"])
            trials[(kind, variant, task, lr, seed)] = Trial(variant, task, lr, seed, dict(metrics))
        elif kind == "noise":
            main = get_task(task).main_split
            seed = int(r.data.params.get("noise_seed", 0))
            history = client.get_metric_history(r.info.run_id, f"{main}/score")
            out.noise.setdefault((variant, task), {})[seed] = {m.step / 100: m.value for m in history}
        elif kind == "cross_domain":
            for key, value in r.data.metrics.items():
                target, split, _ = key.split("/")
                out.cross.setdefault(variant, {})[(task, target, split)] = value
    for (kind, *_), t in trials.items():
        (out.glue if kind == "glue_trial" else out.squad).append(t)
    return out


# ------------------------------------------------------------------------------------------- tables


def glue_table(summaries: list[Summary]) -> Table:
    """Table 1 from GLUE summaries (see :func:`swbert.finetune.glue.glue_summaries`)."""
    by = {(s.variant, s.task): s for s in summaries}
    present = [(t, sp) for t, sp in TABLE1_COLUMNS if any(task == t for _, task in by)]
    header, csv_header = ["Model"], ["variant"]
    for t, sp in present:
        task = get_task(t)
        header.append(f"{split_label(task, sp)} ({'/'.join(METRIC_ABBREV[m] for m in task.metrics)})")
        csv_header += [f"{split_label(task, sp)} {m}" for m in task.metrics]
    header.append("Avg")
    csv_header += ["avg", "learning_rates", "seeds"]
    rows, csv_rows = [], []
    for variant in sorted({v for v, _ in by}, key=variant_key):
        row, csv_row, scores, lrs, seeds = [variant], [variant], [], [], set()
        for t, sp in present:
            task, s = get_task(t), by.get((variant, t))
            values = [s.median.get(sp, {}).get(m, float("nan")) if s else float("nan") for m in task.metrics]
            row.append("/".join(_pct(v) for v in values))
            csv_row += [round(100 * v, 4) if not math.isnan(v) else "" for v in values]
            if s:
                score = s.median.get(sp, {}).get("score", float("nan"))
                if not math.isnan(score):
                    scores.append(score)
                lrs.append(f"{t}={s.learning_rate:g}")
                seeds.add(len(s.seeds))
        avg = float(np.mean(scores)) if scores else float("nan")
        row.append(_pct(avg))
        csv_row += [
            round(100 * avg, 4) if scores else "",
            " ".join(dict.fromkeys(lrs)),
            "/".join(map(str, sorted(seeds))),
        ]
        rows.append(row)
        csv_rows.append(csv_row)
    return Table(
        "Table 1: GLUE dev (median over seeds, best learning rate)", header, rows, csv_header, csv_rows
    )


def squad_table(summaries: list[Summary]) -> Table:
    """Table 2: EM/F1 per SQuAD version."""
    by = {(s.variant, s.task): s for s in summaries}
    versions = [v for v in ("1.1", "2.0") if any(t == f"squad{v}" for _, t in by)]
    header = ["Model"] + [f"SQuAD v{v} (EM/F1)" for v in versions]
    csv_header = (
        ["variant"] + [f"v{v} {m}" for v in versions for m in ("exact", "f1")] + ["learning_rates", "seeds"]
    )
    rows, csv_rows = [], []
    for variant in sorted({v for v, _ in by}, key=variant_key):
        row, csv_row, lrs, seeds = [variant], [variant], [], set()
        for v in versions:
            s = by.get((variant, f"squad{v}"))
            med = s.median.get("validation", {}) if s else {}
            em, f1 = med.get("exact", float("nan")), med.get("f1", float("nan"))
            row.append(f"{_pct(em / 100)}/{_pct(f1 / 100)}")
            csv_row += [em, f1]
            if s:
                lrs.append(f"v{v}={s.learning_rate:g}")
                seeds.add(len(s.seeds))
        rows.append(row)
        csv_rows.append(csv_row + [" ".join(lrs), "/".join(map(str, sorted(seeds)))])
    return Table(
        "Table 2: SQuAD dev (median over seeds, best learning rate)", header, rows, csv_header, csv_rows
    )


def noise_table(noise: dict[tuple[str, str], dict[int, dict[float, float]]]) -> Table:
    """Table 5: mean (over noise seeds) task score at each noise level."""
    levels = sorted({lvl for seeds in noise.values() for curve in seeds.values() for lvl in curve})
    tasks = sorted({t for _, t in noise})
    header = ["Model"] + (["Task"] if len(tasks) > 1 else []) + [f"{round(100 * lvl)}%" for lvl in levels]
    csv_header = (
        ["variant", "task"]
        + [f"{round(100 * lvl)}% {s}" for lvl in levels for s in ("mean", "std")]
        + ["noise_seeds"]
    )
    rows, csv_rows = [], []
    for variant, task in sorted(noise, key=lambda k: (variant_key(k[0]), k[1])):
        seeds = noise[(variant, task)]
        row = [variant] + ([split_label(get_task(task), get_task(task).main_split)] if len(tasks) > 1 else [])
        csv_row: list[object] = [variant, task]
        for lvl in levels:
            vals = [c[lvl] for c in seeds.values() if lvl in c]
            mean = float(np.mean(vals)) if vals else float("nan")
            row.append(_pct(mean))
            csv_row += [round(100 * mean, 4), round(100 * float(np.std(vals)), 4)] if vals else ["", ""]
        rows.append(row)
        csv_rows.append(csv_row + [len(seeds)])
    return Table(
        "Table 5: dev score under Gaussian embedding noise (fraction of the mean embedding norm)",
        header,
        rows,
        csv_header,
        csv_rows,
    )


def cross_domain_table(cross: dict[str, dict[tuple[str, str, str], float]]) -> Table:
    """Table 6: binary accuracy of each source task's model on each target dev set."""
    order = {t: i for i, t in enumerate(CROSS_DOMAIN_TASKS)}
    pairs = sorted(
        {k for v in cross.values() for k in v}, key=lambda k: (order.get(k[0], 9), order.get(k[1], 9), k[2])
    )
    names = [f"{get_task(s).name.upper()}→{split_label(get_task(t), sp)}" for s, t, sp in pairs]
    header, csv_header = ["Model"] + names, ["variant"] + names
    rows, csv_rows = [], []
    for variant in sorted(cross, key=variant_key):
        vals = [cross[variant].get(p, float("nan")) for p in pairs]
        rows.append([variant] + [_pct(v) for v in vals])
        csv_rows.append([variant] + [round(100 * v, 4) if not math.isnan(v) else "" for v in vals])
    return Table(
        "Table 6: cross-domain accuracy (fine-tuned on → evaluated on; binary label mapping)",
        header,
        rows,
        csv_header,
        csv_rows,
    )


def plot_noise(noise: dict[tuple[str, str], dict[int, dict[float, float]]], path: Path) -> Path:
    """One panel per task: score vs noise level, a line per variant, error bars over noise seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({t for _, t in noise})
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.5), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for variant in sorted({v for v, t in noise if t == task}, key=variant_key):
            seeds = noise[(variant, task)]
            levels = sorted({lvl for c in seeds.values() for lvl in c})
            vals = [[c[lvl] for c in seeds.values() if lvl in c] for lvl in levels]
            ax.errorbar(
                [100 * lvl for lvl in levels],
                [100 * np.mean(v) for v in vals],
                yerr=[100 * np.std(v) for v in vals],
                label=variant,
                marker="o",
                capsize=3,
            )
        t = get_task(task)
        ax.set(
            title=split_label(t, t.main_split),
            xlabel="noise (% of mean embedding norm)",
            ylabel="dev score (%)",
        )
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def build_report(collected: Collected, out_dir: Path) -> dict[str, Table]:
    """Write every table that has data (``table1_glue``, ``table2_squad``, ``table5_noise``, ``table6_cross_domain``)."""
    tables: dict[str, Table] = {}
    if collected.glue:
        tasks = {t.task for t in collected.glue}
        tables["table1_glue"] = glue_table(
            summarize(
                collected.glue, {n: get_task(n).main_split for n in tasks}, dict.fromkeys(tasks, "score")
            )
        )
    if collected.squad:
        tasks = {t.task for t in collected.squad}
        tables["table2_squad"] = squad_table(
            summarize(collected.squad, dict.fromkeys(tasks, "validation"), dict.fromkeys(tasks, "f1"))
        )
    if collected.noise:
        tables["table5_noise"] = noise_table(collected.noise)
        plot_noise(collected.noise, out_dir / "table5_noise.png")
    if collected.cross:
        tables["table6_cross_domain"] = cross_domain_table(collected.cross)
    for stem, table in tables.items():
        table.write(out_dir, stem)
    return tables
