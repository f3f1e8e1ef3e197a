"""The quality scaling study: a ladder of sizes x attention variants x seeds, each trained by the
real trainer (`launchers/pretrain.py` under torchrun, `--resume auto`) to a budget of tokens =
`--tokens-per-param` x non-embedding parameters, at Kaplan et al.'s LR(N) x `--lr-scale`, then
power-law fits per variant (`swbert.scaling.quality_report`). Each point is a point of the study
(`swbert.studies`): finished ones read back, one in flight resumed, failures kept with their
reason (docs/scaling.md, "Quality")."""

from __future__ import annotations

import contextlib
import logging
import math
import shlex
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from swbert.models.config import SWBertConfig
from swbert.models.flops import masked_lm_flops, masked_lm_params
from swbert.runtime.exits import PREEMPTED_EXIT
from swbert.scaling.fit import MIN_POINTS, MIN_SIZES
from swbert.scaling.grid import check_names, write_ds_config
from swbert.scaling.memory import Layout
from swbert.scaling.quality_report import non_embedding_params, write_outputs
from swbert.studies import jobs
from swbert.studies.options import PointOptions
from swbert.studies.outputs import read_metrics
from swbert.studies.records import Records, check_study, point_key, study_options
from swbert.studies.runner import ChildRun, PointRunner, Settled, run_points, study_run
from swbert.studies.slurm import NOT_RUN, array_command, without_switches, write_submit
from swbert.studies.tracking import KIND

log = logging.getLogger("swbert.scaling.quality")

# Named or layers x width (64-dim heads) sizes small enough for 2 CPU cores: with the default budget,
# 4 sizes x 2 variants finish in about 20 minutes (docs/scaling.md).
CPU_LADDER = ["1x64", "2x64", "2x128", "3x128"]


@dataclass(kw_only=True)
class QualityConfig(PointOptions):
    """The flags of `launchers/scaling_study.py --quality` (see its --help and docs/scaling.md)."""

    quality: bool = True  # the quality study (train a ladder to a budget and fit held-out loss)
    output_dir: Path = Path("runs/quality")  # points/, fits.json, points.csv, plots/, mlflow.db
    sizes: list[str] = field(default_factory=lambda: list(CPU_LADDER))
    seeds: list[int] = field(default_factory=lambda: [1234])  # one run per seed at every size and variant
    tokens_per_param: float = 1.0  # budget: tokens = this x non-embedding parameters (Kaplan et al.)
    lr_scale: float = 1.0  # times LR(N) = 0.003239 - 0.0001395 ln N (Kaplan et al.'s fit)
    warmup_fraction: float = 0.05  # warm-up steps as a share of each point's steps (ours)
    # a pretraining recipe every point starts from (e.g. modern: its positions, local/global attention,
    # schedule, masking and dropout), the ladder setting size, variant, seed, length, batches, budget,
    # LR and warm-up; default: the pretraining defaults (learned positions) with cosine decay
    recipe: str | None = None
    global_batch: int = 32  # sequences per optimizer step
    micro_batch: int = 16
    evaluations: int = 4  # held-out evaluations along each run (the last at its final step)
    eval_batches: int = 8  # validation micro-batches per evaluation (always the same ones)
    nproc: int = 1  # on 2 CPU cores one is fastest
    zero: int = 1  # ZeRO stage of the runs
    reference: str = "standard"  # the variant the others' parameter efficiency is measured against
    # sizes (named or LxW, or a parameter count) the efficiency ratio is extrapolated to
    extrapolate_to: list[str] = field(default_factory=lambda: ["base"])
    bootstrap: int = 1000  # bootstrap replicates of each fit
    level: float = 0.95  # confidence level of the intervals
    point_timeout_s: float = field(default=7200, metadata={"aliases": ("point_timeout",)})
    mlflow: bool = True  # a parent MLflow run with a nested run per point
    # a job array: --emit-slurm writes OUTPUT_DIR/submit.sh (one array task per point, each running
    # --point-index I: that point alone, no fits); --collect then fits what the tasks left, training nothing
    point_index: int | None = None
    collect: bool = False
    gpus_per_node: int = 0  # sets --nproc on the array's tasks
    experiment: str = "swbert-quality"

    def check(self) -> None:
        """Bad input stops here, one line naming the flag, before anything trains."""
        super().check()
        check_names(self.sizes, self.attentions)
        recipes = Path(__file__).resolve().parents[1] / "recipes"
        if self.recipe and not (Path(self.recipe).is_file() or (recipes / f"{self.recipe}.yaml").is_file()):
            shipped = ", ".join(sorted(p.stem for p in recipes.glob("*.yaml")))
            raise ValueError(f"--recipe {self.recipe}: not a recipe file nor one of {shipped}")
        distinct = len(set(self.sizes))
        if distinct < MIN_SIZES or distinct * len(set(self.seeds)) < MIN_POINTS:
            raise ValueError(
                f"--sizes: {distinct} size(s) x {len(set(self.seeds))} seed(s) per variant; the fit "
                f"L = E + A N^-alpha needs at least {MIN_SIZES} sizes and {MIN_POINTS} points: add sizes "
                "(or --seeds)"
            )
        for name in (
            "tokens_per_param",
            "lr_scale",
            "global_batch",
            "micro_batch",
            "evaluations",
            "bootstrap",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be positive")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"--warmup-fraction {self.warmup_fraction}: must be in [0, 1)")
        if not 0 < self.level < 1:
            raise ValueError(f"--level {self.level}: must be between 0 and 1 (e.g. 0.95)")
        if sum((self.emit_slurm, self.point_index is not None, self.collect)) > 1:
            raise ValueError("--emit-slurm, --point-index and --collect are steps of one job array: give one")


@dataclass
class Point:
    """One run of the ladder and the plan it trains to."""

    name: str
    size: str
    attention: str
    seed: int
    params: int  # all parameters of the masked-LM model
    non_embedding_params: int  # what the budget and the fits count
    tokens: int  # the budget
    steps: int
    lr: float
    warmup_steps: int
    train_flops_per_token: float

    @property
    def train_flops(self) -> float:
        return self.train_flops_per_token * self.tokens


def kaplan_lr(n: int) -> float:
    """Kaplan et al. (2020), eq. D.1: LR(N) = 0.003239 - 0.0001395 ln N, floored at 1e-5 (ours) so
    that a very large N still trains."""
    return max(0.003239 - 0.0001395 * math.log(n), 1e-5)


def plan_point(cfg: QualityConfig, size: str, attention: str, seed: int, vocab: int) -> Point:
    """The point's parameters, budget, steps and schedule; ValueError naming the flag when the
    budget is smaller than one optimizer step."""
    config = SWBertConfig.from_size(size, attention_type=attention, vocab_size=vocab)
    n = non_embedding_params(config)
    tokens = int(round(cfg.tokens_per_param * n))
    per_step = cfg.global_batch * cfg.seq_len
    if tokens < per_step:
        raise ValueError(
            f"--tokens-per-param {cfg.tokens_per_param}: {size} {attention} has {n:,} non-embedding "
            f"parameters, a budget of {tokens:,} tokens, less than one optimizer step of {per_step:,} "
            "(--global-batch x --seq-len); raise --tokens-per-param or lower --global-batch"
        )
    steps = math.ceil(tokens / per_step)
    return Point(
        name=f"{size}-{attention}-s{seed}",
        size=size,
        attention=attention,
        seed=seed,
        params=masked_lm_params(config),
        non_embedding_params=n,
        tokens=tokens,
        steps=steps,
        lr=kaplan_lr(n) * cfg.lr_scale,
        warmup_steps=max(1, round(cfg.warmup_fraction * steps)),
        train_flops_per_token=masked_lm_flops(config, cfg.seq_len).training,
    )


def plan(cfg: QualityConfig, vocab: int) -> list[Point]:
    """Every point, smallest sizes first (so a study cut short still has its cheap end)."""
    points = [
        plan_point(cfg, size, attention, seed, vocab)
        for size in dict.fromkeys(cfg.sizes)
        for seed in dict.fromkeys(cfg.seeds)
        for attention in dict.fromkeys(cfg.attentions)
    ]
    return sorted(points, key=lambda p: p.non_embedding_params)


def check_data(cfg: QualityConfig) -> tuple[int, dict[str, str]]:
    """The data's vocabulary and identity; a ValueError naming --data-dir unless it has a validation split."""
    path, manifest, identity = cfg.read_data()
    valid = sum(int(s.get("valid", {}).get("documents", 0)) for s in manifest.get("shards", []))
    if valid == 0:
        raise ValueError(
            f"--data-dir {path}: no validation split (its manifest.json counts 0 validation documents); "
            "the study's held-out loss needs one: preprocess with a validation share (data_prep.preprocess)"
        )
    return int(manifest["tokenizer"]["vocab_size"]), identity


# ---- one point: the real trainer -----------------------------------------------------------------


@dataclass
class PointResult:
    """What a point's run left: `done` with its held-out loss, or `failed` with the reason."""

    status: str  # "done", "failed", or "stopped" (on request, checkpointed: resumes on a re-run)
    reason: str = ""
    val_loss: float | None = None  # held-out MLM loss at the final step
    train_loss: float | None = None  # training loss of the last logged window
    curve: list[dict[str, float]] = field(default_factory=list)  # step, tokens, loss, val_loss
    wall_s: float = 0.0


def pretrain_command(
    point: Point, cfg: QualityConfig, run_dir: Path, data_dir: str, ds_config: Path
) -> list[str]:
    """The torchrun command of `point`: the real launcher, `--resume auto` so a point in flight
    continues from its newest checkpoint, a validation (and a checkpoint) every 1/evaluations."""
    interval = max(1, point.steps // cfg.evaluations)
    args = [
        "--size", point.size, "--attention-type", point.attention, "--seed", str(point.seed),
        "--seq-len", str(cfg.seq_len), "--micro-batch-size", str(cfg.micro_batch),
        "--global-batch-size", str(cfg.global_batch), "--train-tokens", str(point.tokens),
        "--lr", f"{point.lr:.6g}", "--min-lr", f"{point.lr / 10:.6g}", "--lr-schedule", "cosine",
        "--warmup-steps", str(point.warmup_steps), "--log-interval", str(interval),
        "--eval-interval", str(interval), "--eval-batches", str(cfg.eval_batches),
        "--save-interval", str(interval), "--keep-checkpoints", "1", "--deepspeed-config", str(ds_config),
        "--export", "false", "--mlflow", "false", "--progress-bar", "false", "--resume", "auto",
        "--output-dir", str(run_dir), "--data-dir", data_dir,
    ]  # fmt: skip
    if cfg.plugins:
        args += ["--plugins", *cfg.plugins]
    if cfg.recipe:  # the recipe's own schedule, positions, attention pattern, masking and dropout
        schedule = args.index("--lr-schedule")
        args = ["--config", cfg.recipe, *args[:schedule], *args[schedule + 2 :]]
    return jobs.pretrain_command(cfg.nproc, args)[0]


def read_run(run_dir: Path, point: Point) -> PointResult | None:
    """The finished run's result from its metrics.jsonl, or None when it has not reached the end."""
    if not (run_dir / "metrics.jsonl").is_file():
        return None
    by_step = read_metrics(run_dir)
    curve = [
        {k: float(r[k]) for k in ("step", "tokens_seen", "loss", "val_loss") if r.get(k) is not None}
        for r in by_step.values()
    ]
    last = by_step.get(point.steps)
    if last is None or last.get("val_loss") is None:
        return None
    val = float(last["val_loss"])
    if not math.isfinite(val):
        return PointResult("failed", f"diverged: held-out loss {val} at step {point.steps}", curve=curve)
    return PointResult("done", val_loss=val, train_loss=float(last["loss"]), curve=curve)


def train_point(point: Point, cfg: QualityConfig, run_dir: Path, data_dir: str) -> PointResult:
    """Run (or continue) `point` with the real trainer; a failure becomes a result with its reason
    (a folder still held by another job after the wait: `stopped`, not the point's failure)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ds_config = write_ds_config(Layout(zero=cfg.zero), cfg.output_dir / "ds_configs")
    cmd = pretrain_command(point, cfg, run_dir, data_dir, ds_config)
    end = jobs.run_job(
        cmd, jobs.pretrain_command(1, [])[1], jobs.job_env(), run_dir / "run.log", cfg.point_timeout_s
    )
    reason = end.reason(cfg.point_timeout_s)
    if reason is not None:
        stopped = end.rc == PREEMPTED_EXIT or end.busy  # resumes (or runs) on the next run of the study
        return PointResult("stopped" if stopped else "failed", reason, wall_s=end.wall_s)
    result = read_run(run_dir, point) or PointResult(
        "failed", f"the run ended without a held-out loss at step {point.steps}; log: {end.log}"
    )
    result.wall_s = end.wall_s
    return result


# ---- the study -----------------------------------------------------------------------------------

Trainer = Callable[[Point, QualityConfig, Path, str], PointResult]

# Flags that say how the study is run or fitted, not what its points train (besides those of every
# study, `swbert.studies.records.NOT_OPTIONS`): a re-run may change them; any other change is refused.
NOT_IN_STUDY = ("quality", "nproc", "zero", "mlflow", "point_index", "reference", "extrapolate_to", "bootstrap",
                "level")  # fmt: skip
CHOOSES = ("sizes", "attentions", "seeds")  # which points there are: not in a point's record key


def point_records(cfg: QualityConfig) -> Records:
    return Records(cfg.output_dir / "points", "swbert-quality-point/1", "{name}/point.json")


def settle_point(
    point: Point, cfg: QualityConfig, trainer: Trainer, options: dict[str, Any]
) -> Settled[PointResult]:
    """The point settled by the study's `PointRunner` (a point in flight resumes from its newest
    checkpoint)."""
    run_dir = cfg.output_dir / "points" / point.name
    runner = PointRunner(point_records(cfg), lambda d: PointResult(**d), cfg.retry_failed)
    return runner.settle(
        point.name,
        lambda: trainer(point, cfg, run_dir, str(cfg.data_dir)),
        lambda: read_run(run_dir, point),
        point_key(options, CHOOSES, point=asdict(point)),
    )


def prepare(cfg: QualityConfig) -> tuple[list[Point], dict[str, Any]]:
    """Paths made absolute, the data checked, the ladder planned (every budget checked before the
    first point trains), and the study's options and data checked against the folder's."""
    cfg.make_absolute()
    if cfg.data_dir is None:
        raise ValueError("--data-dir: no data folder (the launcher builds the embedded default corpus)")
    vocab, data = check_data(cfg)
    points = plan(cfg, vocab)
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    options = study_options(cfg, NOT_IN_STUDY, data)
    check_study(cfg.output_dir, "quality", options, cfg.allow_study_change, point_records(cfg))
    return points, options


def run_quality(cfg: QualityConfig, trainer: Trainer = train_point) -> list[dict[str, Any]]:
    """Every point of the ladder (trained, resumed or read back), then fits, table, plots and
    MLflow; returns the points' rows."""
    points, options = prepare(cfg)
    if cfg.point_index is not None:  # one task of a job array: its point, recorded; no fits
        if not 0 <= cfg.point_index < len(points):
            raise ValueError(f"--point-index {cfg.point_index}: the ladder has points 0-{len(points) - 1}")
        point = points[cfg.point_index]
        settled = settle_point(point, cfg, trainer, options)
        log.info("%s: %s %s", point.name, settled.result.status, settled.result.reason)
        return [point_row(point, settled.result, settled.trained)]
    if cfg.collect:
        trainer = not_run
    by_name = {p.name: p for p in points}

    def one(point: Point) -> Settled[PointResult]:
        return settle_point(point, cfg, trainer, options)

    tracked = study_run(cfg.output_dir, cfg.store(), cfg.experiment, "quality_study", asdict(cfg))
    with tracked if cfg.mlflow else contextlib.nullcontext() as study:
        done = run_points(points, lambda p: p.name, one, child_run, study)
        rows = [point_row(by_name[s.name], s.result, s.trained) for s in done]
        write_outputs(cfg, rows, study)
    return rows


def child_run(point: Point, settled: Any) -> ChildRun:
    """The point's MLflow child run: its plan, status, figures and held-out loss curve."""
    row = point_row(point, settled.result, settled.trained)
    return ChildRun(
        tags={KIND: "quality_point", "status": row["status"], "reason": str(row["reason"])[:5000]},
        params={k: row[k] for k in ("size", "attention", "seed", "tokens", "steps", "lr", "warmup_steps")},
        metrics={k: row[k] for k in ("params", "non_embedding_params", "train_flops", "val_loss", "wall_s")},
        curve=settled.result.curve,
        curve_keys=("loss", "val_loss"),
    )


def not_run(point: Point, cfg: QualityConfig, run_dir: Path, data_dir: str) -> PointResult:
    """--collect's stand-in for training: a point no array task has finished is reported, not run."""
    return PointResult("missing", NOT_RUN)


def emit_slurm(cfg: QualityConfig, argv: list[str], vocab: int) -> tuple[Path, str, str]:
    """OUTPUT_DIR/submit.sh: one array task per point of the ladder (launchers/slurm/quality.sbatch
    runs `--point-index $SLURM_ARRAY_TASK_ID` with the same flags); returns it, its command and the
    --collect command to run after it."""
    points = plan(cfg, vocab)
    flags = without_switches(argv, ("--quality", "--emit-slurm"))
    if not any(a.startswith(("--data-dir", "--data_dir")) for a in flags):  # the tasks read one folder
        flags += ["--data-dir", str(cfg.data_dir)]
    nproc = ["--nproc", str(cfg.gpus_per_node)] if cfg.gpus_per_node else []
    command = array_command(
        len(points), "launchers/slurm/quality.sbatch", [*flags, *nproc], None, cfg.gpus_per_node
    )
    collect = shlex.join(["python", "launchers/scaling_study.py", "--quality", "--collect", *flags])
    submit = write_submit(cfg.output_dir, command, f"{len(points)} point(s); afterwards: {collect}")
    return submit, command, collect


def point_row(point: Point, result: PointResult, trained: bool) -> dict[str, Any]:
    """The point's row of points.csv (and of fits.json's points)."""
    return {
        **{k: v for k, v in asdict(point).items()},
        "train_flops": point.train_flops,
        "status": result.status,
        "reason": result.reason,
        "val_loss": result.val_loss,
        "train_loss": result.train_loss,
        "wall_s": result.wall_s,
        "trained_now": trained,
    }
