"""What the report's tables and figures share (a trial's timing, the paper's row order of the
variants; a table is `swbert.studies.outputs.Table`), and the paper's figures: Figure 2 (pretraining
loss against steps, from each run's metrics.jsonl), Figure 3 (fine-tuning time per epoch, and what
each variant saves against the baseline) and Table 5's noise curves; docs/finetuning.md, "Tables
and figures"."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from swbert.finetune.tasks import GLUE_TASKS, GlueTask, get_task, split_label
from swbert.studies.outputs import Table, new_axes, pyplot, read_metrics, save_figure, write_csv

FIGURE2 = "figure2_pretrain_loss"
# Figure 3's tasks in the order section 3 of the paper lists them ("Training Time"); others follow
FIGURE3_TASKS = ("cola", "mnli", "mrpc", "qnli", "rte", "qqp")
# Under this many seconds per epoch a time is mostly one-time start-up (the first trial a process runs
# pays for lazy initialisation and warm-up inside its first epoch), not the variant's cost
SHORT_EPOCH_SECONDS = 1.0
VARIANT_ORDER = ("standard", "symmetric", "pairwise", "shared")  # the paper's row order
TRIVIAQA_SUFFIX = "+triviaqa"  # a variant fine-tuned on TriviaQA before SQuAD (swbert.finetune.squad)


@dataclass
class Timing:
    """One trial's training time (Figure 3)."""

    variant: str
    task: str
    batch_size: int
    seconds_per_epoch: float
    batching: str = "padded"  # the trial's `batching` param (--unpad); runs from before it padded


def variant_key(name: str) -> tuple[int, str, str]:
    """The paper's row order; ``NAME+triviaqa`` right after ``NAME``."""
    base, _, suffix = name.partition("+")
    return (VARIANT_ORDER.index(base) if base in VARIANT_ORDER else len(VARIANT_ORDER), base, suffix)


def variant_label(name: str) -> str:
    """``shared+triviaqa`` -> ``shared + TriviaQA`` (Table 2's "single + TriviaQA" rows)."""
    return name[: -len(TRIVIAQA_SUFFIX)] + " + TriviaQA" if name.endswith(TRIVIAQA_SUFFIX) else name


def noise_metric(task: GlueTask) -> str:
    """What Table 5 reports for ``task``: accuracy, or the task's own metric where it has none."""
    return "accuracy" if "accuracy" in task.metrics else task.metrics[0]


# ------------------------------------------------------------------------------------------ Figure 2


def read_loss_curve(run_dir: Path, key: str = "loss") -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` in a run's metrics.jsonl (`read_metrics`: a step logged twice keeps
    its last value); skipped steps (a null loss) are left out."""
    curve = {s: r[key] for s, r in read_metrics(run_dir).items() if isinstance(r.get(key), (int, float))}
    steps = [s for s, v in curve.items() if math.isfinite(v)]
    return steps, [float(curve[s]) for s in steps]


def pretraining_figure(runs: dict[str, Path], out_dir: Path) -> list[Path]:
    """Figure 2: the training loss of every run against its steps (validation loss dashed, when
    logged), as ``figure2_pretrain_loss.png`` and ``.csv`` (variant, step, loss, val_loss)."""
    curves = {name: (read_loss_curve(path), read_loss_curve(path, "val_loss")) for name, path in runs.items()}
    empty = [name for name, ((steps, _), _) in curves.items() if not steps]
    if empty:
        raise ValueError(f"--pretrain-runs {empty[0]}={runs[empty[0]]}: its metrics.jsonl has no loss")
    fig, ax = new_axes("Figure 2: pretraining loss", "step", "masked-LM loss", figsize=(6.5, 4))
    rows = []
    for name in sorted(curves, key=variant_key):
        (steps, loss), (vsteps, vloss) = curves[name]
        (line,) = ax.plot(steps, loss, label=name)
        if vsteps:
            ax.plot(vsteps, vloss, linestyle="--", color=line.get_color(), label=f"{name} (validation)")
        val = dict(zip(vsteps, vloss))
        rows += [{"variant": name, "step": s, "loss": v, "val_loss": val.get(s)} for s, v in zip(steps, loss)]
    return [save_figure(fig, out_dir / f"{FIGURE2}.png"), write_csv(rows, out_dir / f"{FIGURE2}.csv")]


# ------------------------------------------------------------------------------------------ Figure 3


def _task_label(task: str) -> str:
    return split_label(get_task(task), "validation") if task in GLUE_TASKS else task


def _timing_grid(timings: list[Timing], baseline: str) -> tuple[dict, dict, list[str], list[str]]:
    """Figure 3's numbers: (variant, task) -> the median seconds per epoch over its trials (learning
    rates and seeds), and -> the percentage of the baseline's time saved (negative: slower); the tasks
    and the variants in their order."""
    groups: dict[tuple[str, str], list[float]] = {}
    for t in timings:
        groups.setdefault((t.variant, t.task), []).append(t.seconds_per_epoch)
    times = {k: float(np.median(v)) for k, v in groups.items()}
    base = {task: sec for (v, task), sec in times.items() if v == baseline and sec > 0}
    saved = {(v, task): 100.0 * (1.0 - sec / base[task]) for (v, task), sec in times.items() if task in base}
    order = FIGURE3_TASKS
    tasks = sorted({t for _, t in times}, key=lambda t: (order.index(t) if t in order else len(order), t))
    return times, saved, tasks, sorted({v for v, _ in times}, key=variant_key)


def timing_table(timings: list[Timing], baseline: str, batch_size: int | None) -> Table:
    """Figure 3 as a table: seconds per epoch, and the percentage saved against ``baseline``."""
    times, saved, tasks, variants = _timing_grid(timings, baseline)
    header = ["Model"] + [_task_label(t) for t in tasks]
    csv_header = ["variant"] + [
        f"{_task_label(t)} {c}" for t in tasks for c in ("seconds_per_epoch", "saved_percent")
    ]
    rows, csv_rows = [], []
    for v in variants:
        cells, raw = [v], [v]
        for t in tasks:
            sec, pct = times.get((v, t)), saved.get((v, t))
            change = f" ({-pct:+.0f}%)" if pct is not None and v != baseline else ""
            # one decimal, or two significant digits under a second: a short epoch never prints "0.0 s"
            seconds = "–" if sec is None else f"{sec:.1f} s" if sec >= 1 else f"{sec:.2g} s"
            cells.append(seconds + change)
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


def plot_timing(timings: list[Timing], baseline: str, path: Path) -> Path:
    """Figure 3: grouped bars, seconds per epoch per task, one bar per variant, labelled with the
    percentage saved against ``baseline``."""
    times, saved, tasks, variants = _timing_grid(timings, baseline)
    title = f"Figure 3: fine-tuning time per epoch (vs {baseline})"
    size = (max(5.0, 1.3 * len(tasks) * max(1, len(variants)) / 2), 4)
    fig, ax = new_axes(title, "", "seconds per epoch", figsize=size, grid="y")
    width = 0.8 / max(1, len(variants))
    for i, v in enumerate(variants):
        xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(tasks))]
        ys = [times.get((v, t), float("nan")) for t in tasks]
        bars = ax.bar(xs, ys, width, label=v)
        if v != baseline:
            labels = [f"{-saved[(v, t)]:+.0f}%" if (v, t) in saved else "" for t in tasks]
            ax.bar_label(bars, labels, fontsize=7)
    ax.set_xticks(range(len(tasks)), [_task_label(t) for t in tasks])
    return save_figure(fig, path)


# ---------------------------------------------------------------------------------------- Table 5


def noise_curves(
    noise: dict[tuple[str, str, str], dict[int, dict[float, float]]], scale: str
) -> dict[tuple[str, str], dict[float, list[float]]]:
    """Table 5's numbers for one noise definition: (variant, task) -> noise level -> the values over
    noise seeds, in the tables' order (variants, then tasks) and each level's."""
    curves: dict[tuple[str, str], dict[float, list[float]]] = {}
    for variant, task, s in sorted(noise, key=lambda k: (variant_key(k[0]), k[1])):
        if s == scale:
            levels = curves.setdefault((variant, task), {})
            for curve in noise[(variant, task, s)].values():
                for level, value in curve.items():
                    levels.setdefault(level, []).append(value)
    return {k: dict(sorted(v.items())) for k, v in curves.items()}


def plot_noise(
    noise: dict[tuple[str, str, str], dict[int, dict[float, float]]], scale: str, path: Path
) -> Path:
    """Table 5's curves for one noise definition: one panel per task, a line per variant, error bars
    over noise seeds."""
    curves = noise_curves(noise, scale)
    tasks = sorted({t for _, t in curves})
    fig, axes = pyplot().subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.5), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for (variant, of), curve in curves.items():
            if of == task:
                means = [100 * np.mean(v) for v in curve.values()]
                stds = [100 * np.std(v) for v in curve.values()]
                ax.errorbar(
                    [100 * lvl for lvl in curve], means, yerr=stds, label=variant, marker="o", capsize=3
                )
        t = get_task(task)
        xlabel = "noise level (% x std-1 noise)" if scale == "unit" else "noise (% of mean embedding norm)"
        ax.set(title=split_label(t, t.main_split), xlabel=xlabel, ylabel=f"dev {noise_metric(t)} (%)")
        ax.grid(alpha=0.3)
    return save_figure(fig, path)
