"""The scaling study: closed forms for every grid point, measured runs where the machine allows,
one MLflow run per point under a parent run, a CSV and plots; or the grid as a SLURM job array."""

from __future__ import annotations

import functools
import json
import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from swbert.models.plugins import load_plugins
from swbert.runtime.ds_config import resolve_precision
from swbert.scaling.activations import Checkpointing
from swbert.scaling.grid import BERT_VOCAB, GridPoint, build_grid, estimate, expand_layouts, write_ds_config
from swbert.scaling.measure import Hardware, Measurement, parse_metrics, pretrain_args, run_point
from swbert.scaling.report import plot
from swbert.studies.options import PointOptions
from swbert.studies.outputs import write_csv
from swbert.studies.records import check_study, jsonable, point_key, point_records, read_json, study_options
from swbert.studies.runner import ChildRun, PointRunner, Settled, StudyLog, absolute, run_points, study_run
from swbert.studies.slurm import NOT_RUN, write_array
from swbert.studies.tracking import KIND


@dataclass(kw_only=True)
class StudyConfig(PointOptions):
    """What to sweep and how: the flags of `launchers/scaling_study.py` (see its --help)."""

    output_dir: Path = Path("runs/scaling")  # scaling.csv, plots/, mlflow.db and the measured runs
    sizes: list[str] = field(default_factory=lambda: ["tiny", "mini", "small", "base", "large", "xl"])
    # parallel layouts: z0..z3, tpN-zK, z3-offload (optimizer), z3-offload-params (both), ...-nvme;
    # a name may fix how activations are kept: tp2-z1-sp, z1-ac-full, tp2-z1-sp-ac-full
    layouts: list[str] = field(default_factory=lambda: ["z0", "z1", "z2", "z3", "z3-offload"])
    # sequence parallelism for every layout not named -sp: false, true or both (true needs a tpN layout)
    sequence_parallel: list[bool] = field(default_factory=lambda: [False])
    # activation checkpointing for every layout not named -ac-MODE: none, full, selective, or several
    # (selective only without tensor parallelism)
    activation_checkpointing: list[Checkpointing] = field(default_factory=lambda: ["none"])
    micro_batch: int = 8
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: fp32 when measuring on CPU, else bf16
    gpus: int | None = None  # devices the closed forms assume (default: --nproc)
    nproc: int = 2
    measure: bool = True  # run short measured trainings (--no-measure: closed forms only)
    measure_max_params: float = math.inf  # measure only points up to this many parameters
    steps: int = 5  # optimizer steps of a measured run
    # vocabulary of the closed forms (default: the data's when measuring, else BERT's)
    vocab_size: int | None = None
    point_timeout_s: float = field(default=1800, metadata={"aliases": ("point_timeout",)})
    memory_limit_gib: float | None = None  # host memory measured runs may use (default: what is available)
    # swap folder of *-nvme layouts, on a fast local disk (default: output_dir/nvme)
    nvme_path: Path | None = None
    keep_checkpoints: bool = False  # keep the measured runs' checkpoints
    experiment: str = "swbert-scaling"
    nodes: int = 1  # with --emit-slurm: nodes per grid point
    gpus_per_node: int = 8
    # tabulate a job array's results from this folder (written by --emit-slurm); imports only --plugins
    collect: Path | None = None
    # the quality study instead: train a ladder of sizes x variants x seeds to a token budget and fit
    # held-out loss against size and compute (its own flags: --quality --help; docs/scaling.md)
    quality: bool = False

    def check(self) -> None:
        super().check()
        # the layouts the flags make, so a combination the trainer refuses stops here, before any run
        expand_layouts(self.layouts, self.sequence_parallel, self.activation_checkpointing)

    def make_absolute(self) -> None:
        super().make_absolute()
        self.nvme_path = absolute(self.nvme_path)

    def grid(self, precision: str) -> list[GridPoint]:
        """The study's grid points at `precision`."""
        return build_grid(
            self.sizes,
            self.attentions,
            self.layouts,
            self.seq_len,
            self.micro_batch,
            precision,  # type: ignore[arg-type]
            self.sequence_parallel,
            self.activation_checkpointing,
        )

    @property
    def swap(self) -> Path:
        """Where *-nvme layouts swap."""
        return self.nvme_path or self.output_dir / "nvme"


def exit_status(rows: list[dict[str, Any]]) -> int:
    """0, or 3 when measured runs were started and every one failed: such a study measured nothing."""
    statuses = {row["status"] for row in rows}
    return 3 if "failed" in statuses and "measured" not in statuses else 0


# Flags that choose what this machine may run, not what the points are (besides those of every study,
# `swbert.studies.records.NOT_OPTIONS`): a re-run may change them; any other change is refused.
NOT_IN_STUDY = ("measure_max_params", "memory_limit_gib", "nvme_path", "keep_checkpoints", "nodes", "quality")
CHOOSES = ("sizes", "attentions", "layouts", "sequence_parallel", "activation_checkpointing")  # which points


@dataclass
class PointRow:
    """A grid point's row of scaling.csv, and the steps its measured run logged."""

    status: str  # measured, estimated, skipped, failed; stopped (not recorded: runs again next time)
    reason: str
    row: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, row: dict[str, Any], status: str, reason: str = "", records: Any = ()) -> PointRow:
        """`row` with its status and reason."""
        return cls(status, reason, {**row, "status": status, "reason": reason}, list(records))


def point_runner(out: Path, retry_failed: bool, unrecorded: tuple[str, ...]) -> PointRunner[PointRow]:
    """Settles grid points against their point.json; only measured points stand for good."""
    records, final = point_records(out, "scaling"), frozenset({"measured"})
    return PointRunner(records, lambda d: PointRow(**d), retry_failed, final, frozenset(unrecorded))


def grid_key(options: dict[str, Any], name: str, precision: str, gpus: int) -> dict[str, Any]:
    """What a grid point's record stands for (`point_key`)."""
    return point_key(options, CHOOSES, point=name, precision=precision, gpus=gpus)


POINT_PARAMS = ("size", "attention", "layout", "tp", "zero", "offload", "sequence_parallel",
                "activation_checkpointing", "precision", "seq_len", "micro_batch", "gpus", "dp", "vocab_size")  # fmt: skip


def child_run(point: GridPoint, settled: Settled[PointRow]) -> ChildRun:
    """The point's MLflow child run: its columns as params, status and reason, figures, steps."""
    row = settled.result.row
    params = {k: row[k] for k in POINT_PARAMS if k in row}
    tags = {KIND: "scaling_point", "status": row["status"], "reason": row.get("reason", "")}
    metrics = {k: v for k, v in row.items() if k not in POINT_PARAMS}
    return ChildRun(tags, params, metrics, settled.result.records, ("loss", "tokens_per_s"))


def record_rows(cfg: StudyConfig, study: StudyLog, rows: list[dict[str, Any]]) -> None:
    """scaling.csv and the plots, as artifacts of the study's run."""
    csv_path = write_csv(rows, cfg.output_dir / "scaling.csv")
    study.tracker.log_files(study.parent, [csv_path, *plot(rows, cfg.output_dir / "plots")])


def run_study(cfg: StudyConfig) -> list[dict[str, Any]]:
    """Every grid point: closed forms, then a measured run if it fits (a measured point is read back
    on a re-run, a failed one keeps its reason unless --retry-failed); rows as written to the CSV."""
    cfg.make_absolute()
    out = cfg.output_dir
    out.mkdir(parents=True, exist_ok=True)
    hardware = Hardware.detect(cfg.nproc, cfg.memory_limit_gib, cfg.swap)
    fused = not (cfg.measure and hardware.accelerator == "cpu")  # closed forms for a GPU's kernels
    precision = resolve_precision(cfg.precision, on_gpu=fused)
    grid = cfg.grid(precision)
    gpus = cfg.gpus or cfg.nproc
    data_dir, vocab, data = cfg.read_data() if cfg.measure else (None, BERT_VOCAB, {})
    vocab = cfg.vocab_size or vocab
    options = study_options(cfg, NOT_IN_STUDY, data)
    check_study(out, "scaling", options, cfg.allow_study_change, point_records(out, "scaling"))
    runner = point_runner(out, cfg.retry_failed, ("estimated", "skipped", "stopped"))

    def one(point: GridPoint) -> Settled[PointRow]:
        evaluate = functools.partial(evaluate_point, point, cfg, hardware, gpus, vocab, data_dir, fused)
        return runner.settle(point.name, evaluate, key=grid_key(options, point.name, precision, gpus))

    def table(done: list[Settled[PointRow]]) -> None:  # after every point: an interrupted sweep keeps it
        write_csv([s.result.row for s in done], out / "scaling.csv")

    with study_run(out, cfg.store(), cfg.experiment, "scaling_study", asdict(cfg)) as study:
        rows = [s.result.row for s in run_points(grid, one, child_run, study, table)]
        record_rows(cfg, study, rows)
    return rows


def evaluate_point(
    point: GridPoint,
    cfg: StudyConfig,
    hardware: Hardware,
    gpus: int,
    vocab: int,
    data_dir: str | None,
    fused: bool,
) -> PointRow:
    """Closed forms for `point`, and a measured run unless it cannot or should not run here."""
    try:
        row = estimate(point, gpus, vocab, fused_attention=fused)
    except ValueError as err:
        names = {"name": point.name, "size": point.size, "attention": point.attention}
        return PointRow.of({**names, "layout": point.layout.name}, "skipped", str(err))
    if not cfg.measure:
        return PointRow.of(row, "estimated")
    if row["params"] > cfg.measure_max_params:
        reason = f"not measured: {row['params']:,} parameters > --measure-max-params"
        return PointRow.of(row, "estimated", reason)
    if hardware.ranks % point.layout.tp:
        reason = f"tensor-parallel size {point.layout.tp} does not divide --nproc {hardware.ranks}"
        return PointRow.of(row, "skipped", reason)
    local_row = estimate(point, hardware.ranks, vocab, fused_attention=fused)
    reason = hardware.fits(local_row)
    if reason:
        return PointRow.of(row, "skipped", f"does not fit this machine: {reason}")
    point_dir = cfg.output_dir / "points" / point.name
    ds_config = write_ds_config(point.layout, cfg.output_dir / "ds_configs", cfg.swap)
    m = run_point(
        point, ds_config, point_dir, hardware, cfg.steps, data_dir, cfg.point_timeout_s, plugins=cfg.plugins
    )
    if not cfg.keep_checkpoints:
        shutil.rmtree(point_dir / "checkpoints", ignore_errors=True)
    if point.layout.device == "nvme":
        shutil.rmtree(cfg.swap, ignore_errors=True)  # the run's swap files
    local_gib = local_row["mem_device_gib"] + local_row["mem_host_gib"]
    row = {**row, **m.row(), "measured_ranks": hardware.ranks, "estimated_local_gib": local_gib}
    return PointRow.of(row, m.status, m.reason, m.records)


# ---- SLURM job array -----------------------------------------------------------------------------


def _sweep_line(cfg: StudyConfig, point: GridPoint, world: int) -> tuple[str, bool]:
    """A sweep file's line for `point` on `world` ranks: its flags (True), or why it is skipped."""
    if world % point.layout.tp:
        return f"# skipped {point.name}: tensor-parallel size does not divide {world} GPUs", False
    if point.layout.sequence_parallel and point.seq_len % point.layout.tp:
        why = f"tensor-parallel size does not divide --seq-len {point.seq_len}"
        return f"# skipped {point.name}: {why}", False
    ds_config = write_ds_config(point.layout, cfg.output_dir / "ds_configs", cfg.swap)
    run_dir = cfg.output_dir / "points" / point.name
    args = pretrain_args(point, ds_config, run_dir, cfg.steps, world // point.layout.tp)
    if any(ch.isspace() for arg in args for ch in arg):
        raise ValueError(
            f"{point.name}: a path with spaces cannot go in a sweep file ({args}); use another --output-dir"
        )
    return " ".join(args), True


def emit_slurm(
    cfg: StudyConfig, nodes: int, gpus_per_node: int, extra: list[str] | None = None
) -> tuple[Path, str]:
    """The grid as a sweep file for `pretrain.sbatch --sweep` (a point per array task, into points/NAME,
    read back by `--collect`), and its sbatch command; `gpus_per_node=0`: CPU nodes, one process each."""
    out = cfg.output_dir
    out.mkdir(parents=True, exist_ok=True)
    precision = resolve_precision(cfg.precision, on_gpu=gpus_per_node > 0)
    world = nodes * max(gpus_per_node, 1)
    lines = {point.name: _sweep_line(cfg, point, world) for point in cfg.grid(precision)}
    names = [name for name, (_, ok) in lines.items() if ok]
    sweep = out / "sweep.txt"
    head = f"# scaling grid: {nodes} node(s) x {gpus_per_node} GPU(s); one line per array task"
    sweep.write_text("\n".join([head, *(line for line, _ in lines.values())]) + "\n")
    study = {k: v for k, v in jsonable(asdict(cfg)).items() if k != "measure_max_params"}  # inf: no JSON
    spec = {"study": study, "nodes": nodes, "gpus_per_node": gpus_per_node, "precision": precision}
    (out / "grid.json").write_text(json.dumps({**spec, "points": names}, indent=2))
    common = ["--data-dir", cfg.data_dir] if cfg.data_dir else []
    common += ["--plugins", *cfg.plugins] if cfg.plugins else []
    args = ["--sweep", str(sweep), *common, *(extra or [])]
    script = "launchers/slurm/pretrain.sbatch"
    return sweep, write_array(out, len(names), script, args, "", nodes, gpus_per_node, "swbert-scaling")[1]


def collect(output_dir: Path, plugins: list[str] | tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Rows of a grid run as a job array: closed forms and each point's metrics (a point no task has
    measured is `missing`). Imports only `plugins` (the caller's), never those grid.json names; the
    CSV, plots and MLflow runs are written once a point was measured."""
    spec = json.loads((output_dir / "grid.json").read_text())
    cfg = StudyConfig(**{**spec["study"], "output_dir": output_dir, "plugins": list(plugins)})
    load_plugins(cfg.plugins)
    world = spec["nodes"] * max(spec["gpus_per_node"], 1)
    try:
        grid = {p.name: p for p in cfg.grid(spec["precision"])}
    except ValueError as err:
        named = " ".join(spec["study"].get("plugins") or []) or "FILE"
        raise ValueError(f"{err}: pass the grid's plugins to --collect (--plugins {named})") from None
    manifest = read_json(Path(cfg.data_dir) / "manifest.json") if cfg.data_dir else None  # if it is here
    vocab = cfg.vocab_size or (int(manifest["tokenizer"]["vocab_size"]) if manifest else BERT_VOCAB)
    options = study_options(cfg, NOT_IN_STUDY)
    runner = point_runner(output_dir, False, ("missing", "failed"))

    def read_back(name: str) -> PointRow:
        point, run = grid[name], output_dir / "points" / name
        row = estimate(point, world, vocab)
        if not (run / "metrics.jsonl").is_file():
            return PointRow.of(row, "missing", NOT_RUN)
        m = parse_metrics(run, point, Measurement(status="failed"), world // point.layout.tp)
        return PointRow.of({**row, **m.row()}, m.status, m.reason, m.records)

    settled = [
        runner.settle(
            name, functools.partial(read_back, name), key=grid_key(options, name, spec["precision"], world)
        )
        for name in spec["points"]
    ]
    rows = [s.result.row for s in settled]
    if not any(s.result.status == "measured" for s in settled):
        return rows  # the array has not run yet: no table, no MLflow runs of nothing
    with study_run(output_dir, cfg.store(), cfg.experiment, "scaling_study", spec["study"]) as study:
        for s in settled:
            study.point(s.name, s.trained, child_run(grid[s.name], s))
        record_rows(cfg, study, rows)
    return rows
