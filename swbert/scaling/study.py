"""The scaling study: closed forms for every grid point, measured runs where the machine allows,
one MLflow run per point under a parent run, a CSV and plots; or the grid as a SLURM job array.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from swbert.models.plugins import load_plugins
from swbert.runtime.tracking import tracking_uri
from swbert.scaling.activations import Checkpointing
from swbert.scaling.grid import (
    BERT_VOCAB,
    GridPoint,
    activation_args,
    build_grid,
    estimate,
    expand_layouts,
    write_ds_config,
)
from swbert.scaling.measure import Hardware, Measurement, parse_metrics, run_point
from swbert.scaling.memory import Layout, Precision
from swbert.scaling.report import plot, write_csv
from swbert.studies.records import Records, check_study, study_options
from swbert.studies.runner import (
    ChildRun,
    PointRunner,
    Settled,
    StudyLog,
    absolute,
    absolute_plugins,
    run_points,
)
from swbert.studies.slurm import array_command, switch_given, write_submit
from swbert.studies.tracking import KIND, Tracker, flat_params

log = logging.getLogger("swbert.scaling")


@dataclass
class StudyConfig:
    """What to sweep and how: the flags of `launchers/scaling_study.py` (see its --help)."""

    output_dir: Path = Path("runs/scaling")  # scaling.csv, plots/, mlflow.db and the measured runs
    # named sizes
    sizes: list[str] = field(default_factory=lambda: ["tiny", "mini", "small", "base", "large", "xl"])
    # attention variants to compare
    attentions: list[str] = field(
        default_factory=lambda: ["standard", "shared"], metadata={"aliases": ("attention",)}
    )
    # parallel layouts: z0..z3, tpN-zK, z3-offload (optimizer), z3-offload-params (both), ...-nvme;
    # a name may fix how activations are kept: tp2-z1-sp, z1-ac-full, tp2-z1-sp-ac-full
    layouts: list[str] = field(default_factory=lambda: ["z0", "z1", "z2", "z3", "z3-offload"])
    # sequence parallelism for every layout not named -sp: false, true or both (true needs a tpN layout)
    sequence_parallel: list[bool] = field(default_factory=lambda: [False])
    # activation checkpointing for every layout not named -ac-MODE: none, full, selective, or several
    # (selective only without tensor parallelism)
    activation_checkpointing: list[Checkpointing] = field(default_factory=lambda: ["none"])
    seq_len: int = 128  # tokens per sequence
    micro_batch: int = 8  # sequences per rank per step
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: fp32 when measuring on CPU, else bf16
    gpus: int | None = None  # devices the closed forms assume (default: --nproc)
    nproc: int = 2  # processes of a measured run on this machine
    measure: bool = True  # run short measured trainings (--no-measure: closed forms only)
    measure_max_params: float = math.inf  # measure only points up to this many parameters
    steps: int = 5  # optimizer steps of a measured run
    data_dir: str | None = None  # shards of measured runs (default: the embedded default corpus)
    # vocabulary of the closed forms (default: the data's when measuring, else BERT's)
    vocab_size: int | None = None
    # seconds per measured run
    point_timeout_s: float = field(default=1800, metadata={"aliases": ("point_timeout",)})
    memory_limit_gib: float | None = None  # host memory measured runs may use (default: what is available)
    # swap folder of *-nvme layouts, on a fast local disk (default: output_dir/nvme)
    nvme_path: Path | None = None
    keep_checkpoints: bool = False  # keep the measured runs' checkpoints
    experiment: str = "swbert-scaling"  # MLflow experiment
    emit_slurm: bool = False  # write the grid as a SLURM job array instead of running it
    nodes: int = 1  # with --emit-slurm: nodes per grid point
    gpus_per_node: int = 8  # with --emit-slurm; 0: CPU nodes with one process each
    collect: Path | None = None  # tabulate a job array's results from this folder (written by --emit-slurm)
    # modules that register attention variants to compare (ours; see swbert.models.plugins): dotted
    # module names or .py files, imported here and passed on to every measured run
    plugins: list[str] = field(default_factory=list)
    # the quality study instead: train a ladder of sizes x variants x seeds to a token budget and fit
    # held-out loss against size and compute (its own flags: --quality --help; docs/scaling.md)
    quality: bool = False
    retry_failed: bool = False  # measure points whose run failed before again (default: keep their reason)
    # run in a folder that holds this study with other options: the new points beside the finished ones
    # (default: refused, naming what differs)
    allow_study_change: bool = False

    def check(self) -> None:
        load_plugins(self.plugins)
        # the layouts the flags make, so a combination the trainer refuses stops here, before any run
        expand_layouts(self.layouts, self.sequence_parallel, self.activation_checkpointing)


def grid_of(cfg: StudyConfig, precision: Precision) -> list[GridPoint]:
    """The study's grid points at `precision`."""
    return build_grid(
        cfg.sizes,
        cfg.attentions,
        cfg.layouts,
        cfg.seq_len,
        cfg.micro_batch,
        precision,
        cfg.sequence_parallel,
        cfg.activation_checkpointing,
    )


def _prepare_data(cfg: StudyConfig) -> tuple[str, int]:
    """The shards measured runs read (the entry point builds the default corpus when none is given)
    and their vocabulary."""
    from swbert.data.folder import prepare_data

    path = prepare_data(cfg.data_dir)
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    return str(path), int(manifest["tokenizer"]["vocab_size"])


def absolute_paths(cfg: StudyConfig) -> None:
    """Make the study's paths absolute, relative to the caller's working directory (`absolute`)."""
    cfg.output_dir, cfg.data_dir, cfg.nvme_path = map(absolute, (cfg.output_dir, cfg.data_dir, cfg.nvme_path))
    cfg.plugins = absolute_plugins(cfg.plugins)


def exit_status(rows: list[dict[str, Any]]) -> int:
    """0, or 3 when measured runs were started and every one failed: such a study measured nothing."""
    statuses = {row["status"] for row in rows}
    return 3 if "failed" in statuses and "measured" not in statuses else 0


# Flags that choose where results go or what this machine may run, not what the points are: a re-run
# may change them; any other flag changed is refused (`swbert.studies.records.check_study`).
NOT_IN_STUDY = (
    "output_dir measure_max_params point_timeout_s memory_limit_gib nvme_path keep_checkpoints experiment "
    "emit_slurm nodes gpus_per_node collect plugins quality retry_failed allow_study_change"
).split()


@dataclass
class PointRow:
    """A grid point's row of scaling.csv, and the steps its measured run logged."""

    status: str  # measured, estimated, skipped, failed; stopped (not recorded: runs again next time)
    reason: str
    row: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, row: dict[str, Any]) -> PointRow:
        records = row.pop("_records", [])
        return cls(row["status"], row.get("reason", ""), row, records)


def child_run(point: GridPoint, settled: Settled[PointRow]) -> ChildRun:
    """The point's MLflow child run: its columns as params, status and reason, figures, steps."""
    row = settled.result.row
    params = {k: row[k] for k in POINT_PARAMS if k in row}
    tags = {KIND: "scaling_point", "status": row["status"], "reason": row.get("reason", "")}
    metrics = {k: v for k, v in row.items() if k not in POINT_PARAMS}
    return ChildRun(tags, params, metrics, settled.result.records, ("loss", "tokens_per_s"))


POINT_PARAMS = ("size", "attention", "layout", "tp", "zero", "offload", "sequence_parallel",
                "activation_checkpointing", "precision", "seq_len", "micro_batch", "gpus", "dp", "vocab_size")  # fmt: skip


def record_rows(cfg: StudyConfig, tracker: Tracker, parent: str | None, rows: list[dict[str, Any]]) -> None:
    """scaling.csv and the plots, as artifacts of the study's run."""
    csv_path = write_csv(rows, cfg.output_dir / "scaling.csv")
    tracker.log_files(parent, [csv_path, *plot(rows, cfg.output_dir / "plots")])


def open_tracker(cfg: StudyConfig) -> Tracker:
    return Tracker(tracking_uri(cfg.output_dir), cfg.experiment, system_metrics=False)


def run_study(cfg: StudyConfig) -> list[dict[str, Any]]:
    """Every grid point: closed forms, then a measured run if it fits (a measured point is read back
    on a re-run, a failed one keeps its reason unless --retry-failed); rows as written to the CSV."""
    absolute_paths(cfg)
    out = cfg.output_dir
    out.mkdir(parents=True, exist_ok=True)
    hardware = Hardware.detect(cfg.nproc, cfg.memory_limit_gib, _nvme(cfg))
    on_cpu = hardware.accelerator == "cpu"
    precision = cfg.precision if cfg.precision != "auto" else ("fp32" if cfg.measure and on_cpu else "bf16")
    grid = grid_of(cfg, precision)  # type: ignore[arg-type]
    gpus = cfg.gpus or cfg.nproc
    data_dir, vocab = None, cfg.vocab_size or BERT_VOCAB
    if cfg.measure:
        data_dir, data_vocab = _prepare_data(cfg)
        vocab = cfg.vocab_size or data_vocab
    check_study(out, "scaling", study_options(cfg, NOT_IN_STUDY), cfg.allow_study_change)
    records = Records(out / "points", "swbert-scaling-point/1", "{name}/point.json")
    runner = PointRunner(records, lambda d: PointRow(**d), cfg.retry_failed, frozenset({"measured"}),
                         frozenset({"estimated", "skipped", "stopped"}))  # fmt: skip
    fused = not (cfg.measure and on_cpu)

    def one(point: GridPoint) -> Settled[PointRow]:
        return runner.settle(
            point.name,
            lambda: PointRow.of(evaluate_point(point, cfg, hardware, gpus, vocab, data_dir, fused)),
        )

    def table(done: list[Settled[PointRow]]) -> None:  # after every point: an interrupted sweep keeps it
        write_csv([s.result.row for s in done], out / "scaling.csv")

    tracker = open_tracker(cfg)
    name = f"scaling-{time.strftime('%Y%m%d-%H%M%S')}"
    with tracker.sweep(name, "scaling_study", flat_params(asdict(cfg)), out, resume=True) as parent:
        done = run_points(grid, lambda p: p.name, one, child_run, StudyLog(tracker, out), table)
        rows = [s.result.row for s in done]
        record_rows(cfg, tracker, parent, rows)
    return rows


def evaluate_point(
    point: GridPoint,
    cfg: StudyConfig,
    hardware: Hardware,
    gpus: int,
    vocab: int,
    data_dir: str | None,
    fused: bool,
) -> dict[str, Any]:
    """Closed forms for `point`, and a measured run unless it cannot or should not run here."""
    try:
        row = estimate(point, gpus, vocab, fused_attention=fused)
    except ValueError as err:
        return {"name": point.name, "size": point.size, "attention": point.attention,
                "layout": point.layout.name, "status": "skipped", "reason": str(err)}  # fmt: skip
    row.update(status="estimated", reason="")
    if not cfg.measure:
        return row
    if row["params"] > cfg.measure_max_params:
        row["reason"] = f"not measured: {row['params']:,} parameters > --measure-max-params"
        return row
    local = point.layout.tp
    if hardware.ranks % local:
        row.update(
            status="skipped", reason=f"tensor-parallel size {local} does not divide --nproc {hardware.ranks}"
        )
        return row
    local_row = estimate(point, hardware.ranks, vocab, fused_attention=fused)
    reason = hardware.fits(local_row)
    if reason:
        row.update(status="skipped", reason=f"does not fit this machine: {reason}")
        return row
    point_dir = cfg.output_dir / "points" / point.name
    ds_config = write_ds_config(point.layout, cfg.output_dir / "ds_configs", _nvme(cfg))
    m = run_point(
        point, ds_config, point_dir, hardware, cfg.steps, data_dir, cfg.point_timeout_s, plugins=cfg.plugins
    )
    if not cfg.keep_checkpoints:
        _remove_tree(point_dir / "checkpoints")
    if point.layout.device == "nvme":
        _remove_tree(_nvme(cfg))  # the run's swap files
    row.update(m.row())
    row["measured_ranks"] = hardware.ranks
    row["estimated_local_gib"] = local_row["mem_device_gib"] + local_row["mem_host_gib"]
    row["_records"] = m.records
    return row


def _data_vocab(data_dir: str | None) -> int | None:
    manifest = Path(data_dir or "") / "manifest.json"
    if data_dir and manifest.is_file():
        return int(json.loads(manifest.read_text())["tokenizer"]["vocab_size"])
    return None


def _nvme(cfg: StudyConfig) -> Path:
    return Path(cfg.nvme_path) if cfg.nvme_path else cfg.output_dir / "nvme"


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# ---- SLURM job array -----------------------------------------------------------------------------


def _sweep_line(cfg: StudyConfig, point: GridPoint, world: int, precision: str) -> tuple[str, bool]:
    """A sweep file's line for `point` on `world` ranks: its launcher flags (True), or a comment
    saying why it is skipped (False)."""
    if world % point.layout.tp:
        return f"# skipped {point.name}: tensor-parallel size does not divide {world} GPUs", False
    if point.layout.sequence_parallel and point.seq_len % point.layout.tp:
        return (
            f"# skipped {point.name}: tensor-parallel size does not divide --seq-len {point.seq_len}",
            False,
        )
    out = cfg.output_dir
    ds_config = write_ds_config(point.layout, out / "ds_configs", _nvme(cfg))
    dp = world // point.layout.tp
    args = [
        "--size", point.size, "--attention-type", point.attention,
        "--tensor-parallel", str(point.layout.tp), "--deepspeed-config", str(ds_config),
        "--seq-len", str(point.seq_len), "--micro-batch-size", str(point.micro_batch),
        "--global-batch-size", str(point.micro_batch * dp), "--precision", precision,
        "--output-dir", str(out / "points" / point.name), *activation_args(point.layout),
    ]  # fmt: skip
    if any(ch.isspace() for arg in args for ch in arg):
        raise ValueError(
            f"{point.name}: a path with spaces cannot go in a sweep file ({args}); use another --output-dir"
        )
    return " ".join(args), True


def emit_slurm(
    cfg: StudyConfig, nodes: int, gpus_per_node: int, extra: list[str] | None = None
) -> tuple[Path, str]:
    """Write the grid as a sweep file for `pretrain.sbatch --sweep` and return (file, sbatch command).

    Each array task runs one grid point for `cfg.steps` steps into output_dir/points/NAME; collect the
    results afterwards with `launchers/scaling_study.py --collect output_dir`. `gpus_per_node=0`
    means CPU nodes: one process per node and no GPU request.
    """
    out = cfg.output_dir
    out.mkdir(parents=True, exist_ok=True)
    precision = cfg.precision if cfg.precision != "auto" else ("bf16" if gpus_per_node else "fp32")
    grid = grid_of(cfg, precision)  # type: ignore[arg-type]
    world = nodes * max(gpus_per_node, 1)
    lines, names = [f"# scaling grid: {nodes} node(s) x {gpus_per_node} GPU(s); one line per array task"], []
    for point in grid:
        line, ok = _sweep_line(cfg, point, world, precision)
        lines.append(line)
        if ok:
            names.append(point.name)
    sweep = out / "sweep.txt"
    sweep.write_text("\n".join(lines) + "\n")
    (out / "grid.json").write_text(
        json.dumps({"study": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()
                              if k != "measure_max_params"},
                    "nodes": nodes, "gpus_per_node": gpus_per_node, "precision": precision, "points": names},
                   indent=2)
    )  # fmt: skip
    common = [
        "--train-steps", str(cfg.steps), "--warmup-steps", "1", "--log-interval", "1",
        "--eval-interval", str(cfg.steps + 1), "--eval-batches", "1", "--save-interval", str(cfg.steps + 1),
        "--export", "false", "--mlflow", "false", "--progress-bar", "false",
    ]  # fmt: skip
    if cfg.data_dir:
        common += ["--data-dir", cfg.data_dir]
    if cfg.plugins:
        common += ["--plugins", *cfg.plugins]
    args = ["--sweep", str(sweep), *common, *(extra or [])]
    command = array_command(
        len(names), "launchers/slurm/pretrain.sbatch", args, nodes, gpus_per_node, "swbert-scaling"
    )
    write_submit(out, command)
    return sweep, command


def collect(output_dir: Path) -> list[dict[str, Any]]:
    """Rows for a grid run as a job array (see `emit_slurm`): closed forms plus each point's metrics.

    The CSV, plots and MLflow runs are written only when at least one point was measured."""
    spec = json.loads((output_dir / "grid.json").read_text())
    study = spec["study"]
    cfg = StudyConfig(**{**study, "output_dir": output_dir})
    cfg.check()  # the plugins the grid was written with
    world = spec["nodes"] * max(spec["gpus_per_node"], 1)
    grid = {p.name: p for p in grid_of(cfg, spec["precision"])}
    vocab = cfg.vocab_size or _data_vocab(cfg.data_dir) or BERT_VOCAB
    found = {
        name: parse_metrics(output_dir / "points" / name, grid[name], Measurement(status="failed"),
                            world // grid[name].layout.tp)
        for name in spec["points"]
    }  # fmt: skip
    if not any(m.status == "measured" for m in found.values()):
        # the array has not run yet: no table, no MLflow runs of nothing (nor the closed forms' imports)
        return [{"name": name, **m.row()} for name, m in found.items()]
    tracker = open_tracker(cfg)
    with tracker.sweep(f"scaling-{time.strftime('%Y%m%d-%H%M%S')}", "scaling_study", flat_params(study),
                       output_dir, resume=True) as parent:  # fmt: skip
        study_log, rows = StudyLog(tracker, output_dir), []
        for name, m in found.items():
            row = estimate(grid[name], world, vocab)
            row.update(m.row())
            rows.append(row)
            settled = Settled(name, PointRow(row["status"], row.get("reason", ""), row, m.records), False)
            study_log.point(name, False, child_run(grid[name], settled))
        record_rows(cfg, tracker, parent, rows)
    return rows


def quality_requested(argv: list[str]) -> bool:
    """Whether a command line asks for the quality study (`--quality`, `--quality true`), whose flags
    are its own (`swbert.scaling.quality.QualityConfig`)."""
    return switch_given(argv, "--quality")


__all__ = [
    "Layout",
    "quality_requested",
    "StudyConfig",
    "absolute_paths",
    "collect",
    "emit_slurm",
    "exit_status",
    "run_study",
]
