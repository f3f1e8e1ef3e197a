"""The paper's figures: Figure 2 (pretraining loss of each variant against steps), Figure 3 (fine-tuning
time per epoch per task, and what each variant saves against the baseline), and Table 5's noise curves.

Figure 2 reads pretraining runs' ``metrics.jsonl`` (written by every run, MLflow or not); Figure 3 reads
the fine-tuning trials' ``seconds_per_epoch`` (training steps only, evaluations excluded) from MLflow
(:func:`swbert.finetune.report.collect`). Each figure is a PNG plus a CSV of the plotted numbers.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path

import numpy as np

from swbert.finetune.table import Table, Timing, noise_metric, variant_key
from swbert.finetune.tasks import GLUE_TASKS, get_task, split_label

log = logging.getLogger(__name__)

FIGURE2 = "figure2_pretrain_loss"
FIGURE3 = "figure3_finetune_time"
# Figure 3's tasks in the order section 3 of the paper lists them ("Training Time"); others follow
FIGURE3_TASKS = ("cola", "mnli", "mrpc", "qnli", "rte", "qqp")
# Under this many seconds per epoch a time is mostly one-time start-up (the first trial a process runs
# pays for lazy initialisation and warm-up inside its first epoch), not the variant's cost
SHORT_EPOCH_SECONDS = 1.0


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ------------------------------------------------------------------------------------------ Figure 2


def read_loss_curve(run_dir: Path, key: str = "loss") -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` in a run's metrics.jsonl; a step logged twice (before a crash and after
    the resume) keeps its last value, and skipped steps (a null loss) are left out."""
    by_step: dict[int, float] = {}
    path = Path(run_dir) / "metrics.jsonl"
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines) and not text.endswith("\n"):  # torn: a run cut off while writing
                log.warning("%s, line %d: a torn last line, left out (%.60s)", path, n, line)
                continue
            raise ValueError(
                f"{path}, line {n}: not JSON ({e}); is it a pretraining run's metrics.jsonl?"
            ) from e
        value = record.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            by_step[int(record["step"])] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def pretraining_figure(runs: dict[str, Path], out_dir: Path) -> list[Path]:
    """Figure 2: the training loss of every run against its steps (validation loss dashed, when
    logged), as ``figure2_pretrain_loss.png`` and ``.csv`` (variant, step, loss, val_loss)."""
    curves = {name: (read_loss_curve(path), read_loss_curve(path, "val_loss")) for name, path in runs.items()}
    empty = [name for name, ((steps, _), _) in curves.items() if not steps]
    if empty:
        raise ValueError(f"--pretrain-runs {empty[0]}={runs[empty[0]]}: its metrics.jsonl has no loss")
    out_dir.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name in sorted(curves, key=variant_key):
        (steps, loss), (vsteps, vloss) = curves[name]
        (line,) = ax.plot(steps, loss, label=name)
        if vsteps:
            ax.plot(vsteps, vloss, linestyle="--", color=line.get_color(), label=f"{name} (validation)")
    ax.set(xlabel="step", ylabel="masked-LM loss", title="Figure 2: pretraining loss")
    ax.grid(alpha=0.3)
    ax.legend()
    png = _save(fig, out_dir / f"{FIGURE2}.png")
    table = out_dir / f"{FIGURE2}.csv"
    with open(table, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["variant", "step", "loss", "val_loss"])
        for name in sorted(curves, key=variant_key):
            (steps, loss), (vsteps, vloss) = curves[name]
            val = dict(zip(vsteps, vloss))
            for step, value in zip(steps, loss):
                w.writerow([name, step, value, val.get(step, "")])
    return [png, table]


# ------------------------------------------------------------------------------------------ Figure 3


def _task_order(task: str) -> tuple[int, str]:
    order = FIGURE3_TASKS
    return (order.index(task) if task in order else len(order), task)


def _task_label(task: str) -> str:
    return split_label(get_task(task), "validation") if task in GLUE_TASKS else task


def seconds_per_epoch(timings: list[Timing]) -> dict[tuple[str, str], float]:
    """(variant, task) -> median seconds per epoch over its trials (learning rates and seeds)."""
    groups: dict[tuple[str, str], list[float]] = {}
    for t in timings:
        groups.setdefault((t.variant, t.task), []).append(t.seconds_per_epoch)
    return {k: float(np.median(v)) for k, v in groups.items()}


def saved_percent(times: dict[tuple[str, str], float], baseline: str) -> dict[tuple[str, str], float]:
    """(variant, task) -> percent of the baseline's time per epoch saved (negative: slower)."""
    return {
        (v, task): 100.0 * (1.0 - sec / times[(baseline, task)])
        for (v, task), sec in times.items()
        if (baseline, task) in times and times[(baseline, task)] > 0
    }


def timing_table(timings: list[Timing], baseline: str, batch_size: int | None) -> Table:
    """Figure 3 as a table: seconds per epoch, and the percentage saved against ``baseline``."""
    times = seconds_per_epoch(timings)
    saved = saved_percent(times, baseline)
    tasks = sorted({t for _, t in times}, key=_task_order)
    variants = sorted({v for v, _ in times}, key=variant_key)
    header = ["Model"] + [_task_label(t) for t in tasks]
    csv_header = ["variant"] + [
        f"{_task_label(t)} {c}" for t in tasks for c in ("seconds_per_epoch", "saved_percent")
    ]
    rows, csv_rows = [], []
    for v in variants:
        cells, raw = [v], [v]
        for t in tasks:
            sec = times.get((v, t))
            pct = saved.get((v, t))
            cell = "–" if sec is None else _seconds(sec)
            if pct is not None and v != baseline:
                cell += f" ({-pct:+.0f}%)"
            cells.append(cell)
            raw += ["" if sec is None else round(sec, 4), "" if pct is None else round(pct, 2)]
        rows.append(cells)
        csv_rows.append(raw)
    batch = f"batch {batch_size}" if batch_size else "every batch size"
    batching = ", ".join(sorted({t.batching for t in timings}))
    short = sorted(_task_label(t) for (_, t), sec in times.items() if sec < SHORT_EPOCH_SECONDS)
    caution = (
        f" Under {SHORT_EPOCH_SECONDS:g} s per epoch ({', '.join(dict.fromkeys(short))}) a time is mostly "
        "start-up that the first trial of a process pays, so its change measures run order, not the "
        "variant: time full epochs."
        if short
        else ""
    )
    return Table(
        f"Figure 3: fine-tuning seconds per epoch ({batch}; change against {baseline})",
        header,
        rows,
        csv_header,
        csv_rows,
        "Training steps only (dev evaluations excluded); the median over a variant's trials of the task. "
        f"Batches timed: {batching} (--unpad: unpadded token streams, or grouped padded batches).{caution}",
    )


def _seconds(sec: float) -> str:
    """One decimal, or two significant digits under a second, so a short epoch never prints "0.0 s"."""
    return f"{sec:.1f} s" if sec >= 1 else f"{sec:.2g} s"


def plot_timing(timings: list[Timing], baseline: str, path: Path) -> Path:
    """Figure 3: grouped bars, seconds per epoch per task, one bar per variant, labelled with the
    percentage saved against ``baseline``."""
    times = seconds_per_epoch(timings)
    saved = saved_percent(times, baseline)
    tasks = sorted({t for _, t in times}, key=_task_order)
    variants = sorted({v for v, _ in times}, key=variant_key)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(tasks) * max(1, len(variants)) / 2), 4))
    width = 0.8 / max(1, len(variants))
    for i, v in enumerate(variants):
        xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(tasks))]
        ys = [times.get((v, t), float("nan")) for t in tasks]
        bars = ax.bar(xs, ys, width, label=v)
        if v != baseline:
            labels = [f"{-saved[(v, t)]:+.0f}%" if (v, t) in saved else "" for t in tasks]
            ax.bar_label(bars, labels, fontsize=7)
    ax.set_xticks(range(len(tasks)), [_task_label(t) for t in tasks])
    ax.set(ylabel="seconds per epoch", title=f"Figure 3: fine-tuning time per epoch (vs {baseline})")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    return _save(fig, path)


# ---------------------------------------------------------------------------------------- Table 5


def plot_noise(
    noise: dict[tuple[str, str, str], dict[int, dict[float, float]]], scale: str, path: Path
) -> Path:
    """Table 5's curves for one noise definition: one panel per task, a line per variant, error bars
    over noise seeds."""
    noise = {k: v for k, v in noise.items() if k[2] == scale}
    tasks = sorted({t for _, t, _ in noise})
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.5), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for variant in sorted({v for v, t, _ in noise if t == task}, key=variant_key):
            seeds = noise[(variant, task, scale)]
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
        xlabel = "noise level (% x std-1 noise)" if scale == "unit" else "noise (% of mean embedding norm)"
        ax.set(title=split_label(t, t.main_split), xlabel=xlabel, ylabel=f"dev {noise_metric(t)} (%)")
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    """Write a figure as a PNG (its folder made) and free it."""
    plt = _pyplot()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path
