"""The quality scaling study: a ladder of sizes x attention variants x seeds, each trained by the
real trainer (`launchers/pretrain.py` under torchrun, `--resume auto`) to a budget of tokens =
`--tokens-per-param` x non-embedding parameters, at Kaplan et al.'s LR(N) x `--lr-scale`, then
power-law fits per variant (`swbert.scaling.quality_report`). Each point is a point of the study
(`swbert.studies`): finished ones read back, one in flight resumed, failures kept with their
reason (docs/scaling.md, "Quality")."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import shlex
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from swbert.cli import read_recipe
from swbert.data.floors import held_out_floors
from swbert.models.config import SWBertConfig
from swbert.models.flops import masked_lm_flops, masked_lm_params
from swbert.scaling.fit import MIN_POINTS, MIN_SIZES
from swbert.scaling.grid import check_names, write_ds_config
from swbert.scaling.isoflop import PROFILE_SIZES, budget_label, write_isoflop
from swbert.scaling.memory import Layout
from swbert.scaling.quality_report import non_embedding_params, write_outputs
from swbert.studies import jobs
from swbert.studies.options import PointOptions
from swbert.studies.outputs import read_metrics
from swbert.studies.records import (
    DATA,
    check_study,
    jsonable,
    point_key,
    point_records,
    read_json,
    study_options,
    write_json_atomic,
)
from swbert.studies.runner import ChildRun, PointRunner, Settled, run_points, study_run
from swbert.studies.slurm import NOT_RUN, without_switches, write_array
from swbert.studies.tracking import KIND

log = logging.getLogger("swbert.scaling.quality")

# Named or layers x width (64-dim heads) sizes small enough for 2 CPU cores: with the default budget,
# batch and seeds, 12 points, every one past the unigram floor, in under 20 minutes (docs/scaling.md,
# "The default study"). Narrower models (1x64, 2x64) do not leave the floor in that time.
CPU_LADDER = ["1x128", "2x128", "3x128"]
RECIPES = Path(__file__).resolve().parents[1] / "recipes"
DEFAULT_MASKING = 0.15  # pretraining's mlm_probability when no recipe sets it (swbert.training.config)
POSITIVE = "tokens_per_param lr_scale global_batch micro_batch evaluations bootstrap min_steps".split()


@dataclass(kw_only=True)
class QualityConfig(PointOptions):
    """The flags of `launchers/scaling_study.py --quality` (see its --help and docs/scaling.md)."""

    quality: bool = True  # the quality study (train a ladder to a budget and fit held-out loss)
    output_dir: Path = Path("runs/quality")  # points/, fits.json, points.csv, plots/, mlflow.db
    sizes: list[str] = field(default_factory=lambda: list(CPU_LADDER))
    # one run per seed at every size and variant; two, so that the fit's residual can be set against
    # the spread of seeds (ours)
    seeds: list[int] = field(default_factory=lambda: [1234, 1235])
    tokens_per_param: float = 4.0  # budget: tokens = this x non-embedding parameters (Kaplan et al.)
    lr_scale: float = 1.0  # times LR(N) = 0.003239 - 0.0001395 ln N (Kaplan et al.'s fit)
    warmup_fraction: float = 0.05  # warm-up steps as a share of each point's steps (ours)
    # a point whose held-out loss is less than this many nats below the data's unigram floor is "at the
    # floor": marked, and left out of the fits unless --fit-floor-points (ours)
    floor_margin: float = 0.1
    fit_floor_points: bool = False  # keep the points at the floor in the fits and isoFLOP profiles
    # isoFLOP mode: training FLOPs per point, one ladder of --sizes per budget (tokens = budget / the
    # size's training FLOPs per token; --tokens-per-param is then ignored); a size whose point would
    # take fewer than --min-steps optimizer steps at a budget is left out of that budget
    isoflop_budgets: list[float] = field(default_factory=list)
    # an LR sweep: each point at each of these x LR(N) (--lr-scale is then ignored); the analysis takes
    # each point's best held-out loss over the scales and records which scale won (ours)
    lr_scales: list[float] = field(default_factory=list)
    min_steps: int = 100  # fewer optimizer steps than this: a point not expected to leave the floor (ours)
    # a pretraining recipe every point starts from (e.g. modern: its positions, local/global attention,
    # schedule, masking and dropout), the ladder setting size, variant, seed, length, batches, budget,
    # LR and warm-up; default: the pretraining defaults (learned positions) with cosine decay
    recipe: str | None = None
    # sequences per optimizer step: at these sizes 16 reaches a lower loss for the same tokens than 32
    # (more steps), measured on the default corpus (ours)
    global_batch: int = 16
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
        if self.recipe and not (Path(self.recipe).is_file() or (RECIPES / f"{self.recipe}.yaml").is_file()):
            shipped = ", ".join(sorted(p.stem for p in RECIPES.glob("*.yaml")))
            raise ValueError(f"--recipe {self.recipe}: not a recipe file nor one of {shipped}")
        sizes, seeds = len(set(self.sizes)), len(set(self.seeds))
        too_few = sizes * seeds < MIN_POINTS and not self.isoflop_budgets  # (profiles: 3 sizes)
        if sizes < MIN_SIZES or too_few:
            raise ValueError(
                f"--sizes: {sizes} size(s) x {seeds} seed(s) per variant; the fit L = E + A N^-alpha needs "
                f"at least {MIN_SIZES} sizes and {MIN_POINTS} points: add sizes (or --seeds)"
            )
        for name in POSITIVE:
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be positive")
        for name, label in (("isoflop_budgets", budget_label), ("lr_scales", scale_label)):
            values, flag = getattr(self, name), f"--{name.replace('_', '-')}"
            bad = [v for v in values if not (v > 0 and math.isfinite(v))]
            if bad:
                raise ValueError(f"{flag} {bad[0]:g}: must be positive and finite")
            if len({label(v) for v in values}) < len(values):
                spelled = " ".join(f"{v:g}" for v in values)
                labels = ", ".join(label(v) for v in values)
                raise ValueError(
                    f"{flag} {spelled}: two values name the same points ({labels}): give distinct values"
                )
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"--warmup-fraction {self.warmup_fraction}: must be in [0, 1)")
        if not 0 < self.level < 1:
            raise ValueError(f"--level {self.level}: must be between 0 and 1 (e.g. 0.95)")
        if sum((self.emit_slurm, self.point_index is not None, self.collect)) > 1:
            raise ValueError("--emit-slurm, --point-index and --collect are steps of one job array: give one")


@dataclass
class Point:
    """One run of the ladder and the plan it trains to."""

    name: str  # 2x64-shared-s1234, with -c3e13 in isoFLOP mode and -lr0.5 in an LR sweep
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
    budget: float | None = None  # isoFLOP mode: the training FLOPs it is trained to (None: a ladder point)
    lr_scale: float | None = None  # an LR sweep: its scale of LR(N) (None: the study's one --lr-scale)

    @property
    def train_flops(self) -> float:
        return self.train_flops_per_token * self.tokens


def kaplan_lr(n: int) -> float:
    """Kaplan et al. (2020), eq. D.1: LR(N) = 0.003239 - 0.0001395 ln N, floored at 1e-5 (ours) so
    that a very large N still trains."""
    return max(0.003239 - 0.0001395 * math.log(n), 1e-5)


def scale_label(scale: float) -> str:
    return f"{scale:g}"


def plan_point(
    cfg: QualityConfig,
    size: str,
    attention: str,
    seed: int,
    vocab: int,
    budget: float | None = None,
    lr_scale: float | None = None,
) -> Point:
    """The point's plan: tokens = --tokens-per-param x N, or, given a `budget` of training FLOPs,
    budget / the training FLOPs per token; ValueError naming the flag when a ladder's budget is
    smaller than one optimizer step (isoFLOP points too short are left out by `plan`)."""
    config = SWBertConfig.from_size(size, attention_type=attention, vocab_size=vocab)
    n = non_embedding_params(config)
    per_token = masked_lm_flops(config, cfg.seq_len).training
    tokens = int(round(budget / per_token if budget is not None else cfg.tokens_per_param * n))
    per_step = cfg.global_batch * cfg.seq_len
    if budget is None and tokens < per_step:
        raise ValueError(
            f"--tokens-per-param {cfg.tokens_per_param}: {size} {attention} has {n:,} non-embedding "
            f"parameters, a budget of {tokens:,} tokens, less than one optimizer step of {per_step:,} "
            "(--global-batch x --seq-len); raise --tokens-per-param or lower --global-batch"
        )
    steps = math.ceil(tokens / per_step)
    name = f"{size}-{attention}-s{seed}"
    name += "" if budget is None else f"-c{budget_label(budget)}"
    name += "" if lr_scale is None else f"-lr{scale_label(lr_scale)}"
    return Point(
        name=name,
        size=size,
        attention=attention,
        seed=seed,
        params=masked_lm_params(config),
        non_embedding_params=n,
        tokens=tokens,
        steps=steps,
        lr=kaplan_lr(n) * (cfg.lr_scale if lr_scale is None else lr_scale),
        warmup_steps=max(1, round(cfg.warmup_fraction * steps)),
        train_flops_per_token=per_token,
        budget=budget,
        lr_scale=lr_scale,
    )


def plan(cfg: QualityConfig, vocab: int) -> list[Point]:
    """Every point to train, cheapest budget and smallest sizes first (so a study cut short still has
    its cheap end). A ladder: all of them, unless none reaches --min-steps optimizer steps (ValueError
    naming --tokens-per-param). isoFLOP mode: at each budget, the sizes whose every point reaches
    --min-steps (the others left out, logged in one line); ValueError naming the budget when fewer
    than 3 sizes are left (a parabola in log N needs 3)."""
    points = [
        plan_point(cfg, size, attention, seed, vocab, budget, scale)
        for budget in (cfg.isoflop_budgets or [None])
        for size in dict.fromkeys(cfg.sizes)
        for seed in dict.fromkeys(cfg.seeds)
        for attention in dict.fromkeys(cfg.attentions)
        for scale in (cfg.lr_scales or [None])
    ]
    short: dict[tuple[float | None, str], int] = {}  # (budget, size) left out: its fewest steps
    longest = max(points, key=lambda p: p.steps)
    if not cfg.isoflop_budgets and longest.steps < cfg.min_steps:
        raise ValueError(
            f"--tokens-per-param {cfg.tokens_per_param}: no point reaches --min-steps {cfg.min_steps} "
            f"optimizer steps (the longest, {longest.size} {longest.attention}, takes {longest.steps}); "
            "points this short stay at the unigram floor: raise --tokens-per-param (or lower --global-batch)"
        )
    for p in points:
        if cfg.isoflop_budgets and p.steps < cfg.min_steps:
            short[(p.budget, p.size)] = min(p.steps, short.get((p.budget, p.size), p.steps))
    for budget in cfg.isoflop_budgets:
        kept = [s for s in dict.fromkeys(cfg.sizes) if (budget, s) not in short]
        if len(kept) < PROFILE_SIZES:
            steps = ", ".join(f"{s} {n}" for (b, s), n in short.items() if b == budget)
            raise ValueError(
                f"--isoflop-budgets {budget_label(budget)}: only {len(kept)} size(s) of --sizes reach --min-steps "
                f"{cfg.min_steps} optimizer steps at this budget (steps: {steps}); a profile needs "
                f"{PROFILE_SIZES}: raise the budget or add sizes (smaller ones take more steps)"
            )
    if short:
        log.info(
            "isoFLOP plan: left out under --min-steps %d (size at budget: steps): %s",
            cfg.min_steps,
            ", ".join(f"{s} at {budget_label(b)}: {n}" for (b, s), n in short.items()),
        )
    kept_points = [p for p in points if (p.budget, p.size) not in short]
    return sorted(kept_points, key=lambda p: (p.budget or 0.0, p.non_embedding_params))


# ---- one point: the real trainer -----------------------------------------------------------------


@dataclass
class PointResult:
    """What a point's run left: `done` with its held-out loss, or `failed` with the reason."""

    # "done", "failed", "stopped" (on request, checkpointed: resumes on a re-run) or "missing" (--collect)
    status: str
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
    return jobs.pretrain_command(cfg.nproc, args)


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
    end = jobs.run_job(cmd, run_dir / "run.log", cfg.point_timeout_s)
    failure = end.failure(cfg.point_timeout_s)
    if failure is not None:  # stopped: resumes (or runs) on the next run of the study
        return PointResult(*failure, wall_s=end.wall_s)
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
                "level", "floor_margin", "fit_floor_points")  # fmt: skip
# which points there are: not in a point's record key (each point's own budget and scale are)
CHOOSES = ("sizes", "attentions", "seeds", "isoflop_budgets", "lr_scales", "min_steps")


def settle_point(
    point: Point, cfg: QualityConfig, trainer: Trainer, options: dict[str, Any]
) -> Settled[PointResult]:
    """The point settled by the study's `PointRunner` (one in flight resumes from its checkpoint)."""
    run_dir = cfg.output_dir / "points" / point.name
    records = point_records(cfg.output_dir, "quality")
    runner = PointRunner(records, lambda d: PointResult(**d), cfg.retry_failed)
    return runner.settle(
        point.name,
        lambda: trainer(point, cfg, run_dir, str(cfg.data_dir)),
        lambda: read_run(run_dir, point),
        point_key(options, CHOOSES, point={k: v for k, v in asdict(point).items() if v is not None}),
    )


def prepare(cfg: QualityConfig) -> tuple[list[Point], dict[str, Any]]:
    """Paths made absolute, the data checked, the ladder planned (every budget checked before the
    first point trains), and the study's options and data checked against the folder's."""
    cfg.make_absolute()
    if cfg.data_dir is None:
        raise ValueError("--data-dir: no data folder (the launcher builds the embedded default corpus)")
    _, vocab, data = cfg.read_data(held_out=True)
    points = plan(cfg, vocab)
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    # options the points do not depend on are left out of the study's identity, so that a study from
    # before isoFLOP mode and LR sweeps keeps its own: a ladder ignores the isoFLOP options
    # (--min-steps only checks it), isoFLOP mode --tokens-per-param, a sweep --lr-scale
    ignored = ("tokens_per_param",) if cfg.isoflop_budgets else ("isoflop_budgets", "min_steps")
    ignored += ("lr_scale",) if cfg.lr_scales else ("lr_scales",)
    options = study_options(cfg, NOT_IN_STUDY + ignored, data)
    records = point_records(cfg.output_dir, "quality")
    check_study(cfg.output_dir, "quality", options, cfg.allow_study_change, records)
    return points, options


def run_quality(cfg: QualityConfig, trainer: Trainer = train_point) -> list[dict[str, Any]]:
    """Every point (trained, resumed or read back), then fits, table, plots and MLflow; the rows."""
    points, options = prepare(cfg)
    one = functools.partial(
        settle_point, cfg=cfg, trainer=not_run if cfg.collect else trainer, options=options
    )
    if cfg.point_index is not None:  # one task of a job array: its point, recorded; no fits
        if not 0 <= cfg.point_index < len(points):
            raise ValueError(f"--point-index {cfg.point_index}: the ladder has points 0-{len(points) - 1}")
        (settled,) = run_points([points[cfg.point_index]], one)
        return [point_row(points[cfg.point_index], settled.result, settled.trained)]
    tracked = study_run(cfg.output_dir, cfg.store(), cfg.experiment, "quality_study", asdict(cfg))
    with tracked if cfg.mlflow else contextlib.nullcontext() as study:
        done = run_points(points, one, child_run, study)
        rows = [point_row(point, s.result, s.trained) for point, s in zip(points, done)]
        write = write_isoflop if cfg.isoflop_budgets else write_outputs
        write(cfg, rows, study, study_floors(cfg, options[DATA]))
    return rows


def study_floors(cfg: QualityConfig, data: dict[str, str]) -> dict[str, float] | None:
    """The data's held-out unigram and bigram floors (`swbert.data.floors`) over the sequences a
    point's validation reads (--eval-batches x --micro-batch, masked with each seed), computed
    once and kept in OUTPUT_DIR/floors.json for this data and these settings; None (logged) when the
    data cannot give them. Masked at the recipe's final rate when it schedules one (validation
    masks at it), else its rate, else pretraining's default (ours: read from the recipe file alone,
    not resolved through the training config)."""
    recipe = read_recipe(cfg.recipe, RECIPES) if cfg.recipe else {}
    recipe = {str(k).replace("-", "_"): v for k, v in recipe.items()}
    masking = float(recipe.get("mlm_probability_final") or recipe.get("mlm_probability", DEFAULT_MASKING))
    sequences = cfg.eval_batches * cfg.micro_batch
    seeds = list(dict.fromkeys(cfg.seeds))
    key = jsonable({"data": data, "seq_len": cfg.seq_len, "mlm_probability": masking, "seeds": seeds,
                    "sequences": sequences})  # fmt: skip
    path = cfg.output_dir / "floors.json"
    saved = read_json(path)
    if isinstance(saved, dict) and saved.get("key") == key:
        return saved["floors"]
    try:
        floors = held_out_floors(cfg.data_dir, cfg.seq_len, masking, seeds, sequences)
    except (OSError, ValueError) as err:
        log.warning("the held-out floors were not computed (%s): no point is checked against them", err)
        return None
    write_json_atomic(path, {"key": key, "floors": floors})
    return floors


CHILD_PARAMS = ("size", "attention", "seed", "tokens", "steps", "lr", "warmup_steps", "budget", "lr_scale")


def child_run(point: Point, settled: Any) -> ChildRun:
    """The point's MLflow child run: its plan, status, figures and held-out loss curve."""
    row = point_row(point, settled.result, settled.trained)
    return ChildRun(
        tags={KIND: "quality_point", "status": row["status"], "reason": str(row["reason"])[:5000]},
        params={k: row[k] for k in CHILD_PARAMS if row[k] is not None},
        metrics={k: row[k] for k in ("params", "non_embedding_params", "train_flops", "val_loss", "wall_s")},
        curve=settled.result.curve,
        curve_keys=("loss", "val_loss"),
    )


def not_run(point: Point, cfg: QualityConfig, run_dir: Path, data_dir: str) -> PointResult:
    """--collect's stand-in for training: a point no array task has finished is reported, not run."""
    return PointResult("missing", NOT_RUN)


def emit_slurm(cfg: QualityConfig, argv: list[str], vocab: int) -> tuple[Path, str, str]:
    """OUTPUT_DIR/submit.sh: one array task per point (launchers/slurm/quality.sbatch runs `--point-index
    $SLURM_ARRAY_TASK_ID` with the same flags); returns it, its command and the --collect to run after."""
    points = plan(cfg, vocab)
    flags = without_switches(argv, ("--quality", "--emit-slurm"))
    if not any(a.startswith(("--data-dir", "--data_dir")) for a in flags):  # the tasks read one folder
        flags += ["--data-dir", str(cfg.data_dir)]
    nproc = ["--nproc", str(cfg.gpus_per_node)] if cfg.gpus_per_node else []
    collect = shlex.join(["python", "launchers/scaling_study.py", "--quality", "--collect", *flags])
    note = f"{len(points)} point(s); afterwards: {collect}"
    script = "launchers/slurm/quality.sbatch"
    submit, command = write_array(
        cfg.output_dir, len(points), script, [*flags, *nproc], note, None, cfg.gpus_per_node
    )
    return submit, command, collect


def point_row(point: Point, result: PointResult, trained: bool) -> dict[str, Any]:
    """The point's row of points.csv (and of fits.json's points)."""
    figures = {k: v for k, v in asdict(result).items() if k != "curve"}  # status, reason, losses, wall_s
    return {**asdict(point), "train_flops": point.train_flops, **figures, "trained_now": trained}
