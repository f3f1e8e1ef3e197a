"""The first hour on a GPU machine, as one script: the CUDA tests, then the checks and benchmarks
only a GPU answers, each step with its own timeout, written up as one Markdown table.

    python benchmarks/gpu_hour.py                      # every step; the report in runs/gpu-report.md
    python benchmarks/gpu_hour.py --only mfu,finetune  # some of them (names: --dry-run lists them)
    python benchmarks/gpu_hour.py --dry-run            # the steps and their commands, nothing run
    python benchmarks/gpu_hour.py --smoke              # each step's CPU-capable part, tiny sizes

`make test-gpu` runs the first form. The steps, in order:

    cuda_tests       pytest tests/e2e/test_cuda.py
    zero3_compile    a short pretraining run: ZeRO-3, torch.compile per block, bf16; it must finish
                     and its loss must fall
    fp32_accum       that run's ds_config.json accumulates the bf16 gradients in fp32
                     (`data_types.grad_accum_dtype`)
    host_syncs       host syncs per optimizer step of a bf16 ZeRO-2 run, counted by
                     tests/scripts/count_syncs.py with CUDA's own device, stream and event
                     synchronisations added (`torch.cuda._gpu_trace`); "n/a" without that script
    mfu_eager        benchmarks/train_step.py, MFU of the four attention variants, eager
    mfu_compiled     the same with torch.compile
    compile_overlap  benchmarks/compile_overlap.py: where ZeRO-2's first gradient reduce fires within
                     the backward (eager, compiled per block, compiled whole); that benchmark runs on
                     gloo with the model on the CPU, so this row is the CPU's figure on this machine
    finetune         launchers/finetune_glue.py on a synthetic SST-2 (swbert.finetune.synthetic)

A failing or timed-out step does not stop the others; each writes its log under --work-dir. The
report (--report) is a short heading and one table, check | result | figure, ready to paste into
docs/performance.md. Exit status: 0 when every check passed ("n/a" is not a failure), 1 when one
failed or timed out, 77 when there is no CUDA device (nothing is run; --smoke and --dry-run need
none), 2 for bad flags.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.launch_utils import job_env, read_metrics, torchrun_cmd  # noqa: E402

SKIPPED = 77  # no CUDA device: the automake / meson convention for a skipped test
VARIANTS = ("standard", "shared", "symmetric", "pairwise")
COUNT_SYNCS = Path("tests/scripts/count_syncs.py")

Result = Literal["pass", "FAIL", "timeout", "n/a"]


@dataclass
class Outcome:
    """One row of the report."""

    result: Result
    figure: str


class StepTimeout(Exception):
    """A step's command ran past the step's deadline (its processes were killed)."""


@dataclass
class Context:
    """What the steps share: where they write, how big they run, and the running step's deadline."""

    work: Path
    smoke: bool
    nproc: int = 1
    deadline: float = float("inf")
    log: Path | None = None
    _data: Path | None = field(default=None, repr=False)

    @property
    def device(self) -> str:
        return "cpu" if self.smoke else "cuda"

    def env(self, **extra: str) -> dict[str, str]:
        """The launched jobs' environment: this interpreter's tools first on PATH (DeepSpeed's JIT
        builds need its ninja), the repository importable, DeepSpeed on this device."""
        env = job_env(**{"DS_ACCELERATOR": self.device, **extra})
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
        return env

    def run(self, cmd: Sequence[str], env: dict[str, str] | None = None) -> tuple[int, str]:
        """Run `cmd` from the repository root, its output appended to the step's log, until the step's
        deadline; returns (exit status, output). Past the deadline its whole process tree is killed and
        StepTimeout raised."""
        assert self.log is not None
        with open(self.log, "a") as f:
            f.write(f"$ {shlex.join(map(str, cmd))}\n")
            f.flush()
            start = f.tell()
            proc = subprocess.Popen(
                list(map(str, cmd)),
                cwd=REPO,
                env=env or self.env(),
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: a timeout kills all of it
            )
            try:
                rc = proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_tree(proc)
                raise StepTimeout("killed, with every process it started") from None
        with open(self.log) as f:
            f.seek(start)
            return rc, f.read()

    def data_dir(self) -> Path:
        """A tokenizer and shards of a small generated corpus, built once per work folder by the
        data_prep CLIs (as the tests build theirs), within the running step's deadline."""
        if self._data is None:
            root = self.work / "data"
            if not (root / "data" / "manifest.json").exists():
                shutil.rmtree(root, ignore_errors=True)
                root.mkdir(parents=True)
                build = (
                    "import sys, pathlib; from tests.launch_utils import make_data_dir; "
                    "make_data_dir(pathlib.Path(sys.argv[1]))"
                )
                rc, _ = self.run([sys.executable, "-c", build, root])
                if rc != 0:
                    raise RuntimeError(f"building the training data failed (exit status {rc}; see the log)")
            self._data = root / "data"
        return self._data

    def fresh(self, name: str) -> Path:
        """An empty folder for a step's run (a previous hour's is removed: a run never resumes)."""
        path = self.work / name
        shutil.rmtree(path, ignore_errors=True)
        return path


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a command and everything below it (torchrun starts its workers in new sessions)."""
    import psutil

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
    psutil.wait_procs(family, timeout=30)


@dataclass
class Step:
    """One row of the report: a named check with its own timeout (seconds, on a GPU)."""

    name: str
    check: str
    timeout: float
    run: Callable[[Context], Outcome]
    commands: Callable[[Context], list[list[str]]] = lambda ctx: []
    validate: Callable[[Context], None] = lambda ctx: None  # argument checks, for --dry-run


# ---------------------------------------------------------------------------------------------------
# The steps


def _pytest_cmd() -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/e2e/test_cuda.py"]


def cuda_tests(ctx: Context) -> Outcome:
    rc, out = ctx.run(_pytest_cmd())
    counts = pytest_counts(out)
    figure = ", ".join(f"{n} {kind}" for kind, n in counts.items()) or f"pytest exit status {rc}"
    return Outcome(
        "pass" if rc == 0 and counts.get("passed", 0) + counts.get("skipped", 0) else "FAIL", figure
    )


def pytest_counts(output: str) -> dict[str, int]:
    """{"passed": 12, "skipped": 1, ...} from pytest's closing line."""
    for line in reversed(output.splitlines()):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", line)
        if found and " in " in line:
            return {kind: int(n) for n, kind in found}
    return {}


def _pretrain_args(ctx: Context, out: Path, data: Path | str, deepspeed: str, steps: int) -> list[str]:
    return [
        "--config", "tiny_cpu", "--data-dir", str(data), "--output-dir", str(out), "--mlflow", "false",
        "--precision", "bf16", "--deepspeed-config", deepspeed, "--train-steps", str(steps),
        "--log-interval", "1", "--save-interval", "1000", "--eval-interval", "1000",
    ]  # fmt: skip


def _zero3_steps(ctx: Context) -> int:
    return 16 if ctx.smoke else 60


def _zero3_args(ctx: Context, data: Path | str = "DATA") -> list[str]:
    args = _pretrain_args(ctx, ctx.work / "zero3_compile", data, "ds_configs/zero3.json", _zero3_steps(ctx))
    return args + ["--compile", "on"]


def zero3_compile(ctx: Context) -> Outcome:
    data = ctx.data_dir()
    out = ctx.fresh("zero3_compile")
    rc, _ = ctx.run(torchrun_cmd(ctx.nproc, _zero3_args(ctx, data)))
    if rc != 0:
        return Outcome("FAIL", f"exit status {rc} (see its log)")
    return loss_falls(read_metrics(out), _zero3_steps(ctx), ctx.nproc)


def loss_falls(metrics: dict[int, dict], steps: int, nproc: int) -> Outcome:
    """Every step logged, and the mean loss of the last three steps at least 0.5 below the first
    three's (a learning run of the tiny recipe drops by 2-3 within its first 20 steps)."""
    losses = [metrics[s]["loss"] for s in sorted(metrics)]
    if len(losses) != steps:
        return Outcome("FAIL", f"{len(losses)} of {steps} steps logged")
    first, last = statistics.mean(losses[:3]), statistics.mean(losses[-3:])
    figure = f"{nproc} rank{'s' * (nproc > 1)}, {steps} steps: loss {first:.2f} -> {last:.2f}"
    if "mfu" in metrics[max(metrics)]:
        figure += f", MFU {metrics[max(metrics)]['mfu']:.1%} (tiny model)"
    return Outcome("pass" if last < first - 0.5 else "FAIL", figure)


def fp32_accum(ctx: Context) -> Outcome:
    path = ctx.work / "zero3_compile" / "ds_config.json"
    if not path.exists():
        return Outcome(
            "FAIL", f"no {path.name}: the zero3_compile step writes it (it failed or was left out)"
        )
    return grad_accum_of(json.loads(path.read_text()))


def grad_accum_of(ds: dict) -> Outcome:
    """bf16 on, and its gradients accumulated in fp32 (`data_types.grad_accum_dtype`)."""
    bf16 = bool(ds.get("bf16", {}).get("enabled"))
    dtype = ds.get("data_types", {}).get("grad_accum_dtype")
    figure = f"bf16.enabled={bf16}, data_types.grad_accum_dtype={dtype or 'unset (accumulates in bf16)'}"
    if "communication_data_type" in ds:
        figure += f", communication_data_type={ds['communication_data_type']}"
    return Outcome("pass" if bf16 and dtype == "fp32" else "FAIL", figure)


def _sync_steps(ctx: Context) -> int:
    return 6 if ctx.smoke else 12


def _sync_args(ctx: Context, data: Path | str = "DATA") -> list[str]:
    args = _pretrain_args(
        ctx, ctx.work / "host_syncs" / "run", data, "ds_configs/zero2.json", _sync_steps(ctx)
    )
    args[args.index("--log-interval") + 1] = "1000"  # plain steps: no logging, no evaluation
    return args


def _sync_cmd(ctx: Context, data: Path | str = "DATA") -> list[str]:
    syncs = ctx.work / "host_syncs" / "syncs"
    child = ["--count-syncs-child", str(COUNT_SYNCS), "--syncs-out", str(syncs), *_sync_args(ctx, data)]
    return torchrun_cmd(1, child, script=f"benchmarks/{Path(__file__).name}")


def host_syncs(ctx: Context) -> Outcome:
    if not (REPO / COUNT_SYNCS).exists():
        return Outcome("n/a", f"not available: no {COUNT_SYNCS} in this checkout")
    data = ctx.data_dir()
    out = ctx.fresh("host_syncs")
    rc, _ = ctx.run(_sync_cmd(ctx, data))
    record = out / "syncs" / "rank0.json"
    if rc != 0 or not record.exists():
        return Outcome("FAIL", f"exit status {rc}, {'no' if not record.exists() else 'a'} {record.name}")
    return syncs_per_step(json.loads(record.read_text()), cuda=not ctx.smoke)


CUDA_SYNCS = ("cuda_device_sync", "cuda_stream_sync", "cuda_event_sync")


def syncs_per_step(per_step: dict[str, list[dict]], cuda: bool = True) -> Outcome:
    """Medians over the steady steps (the first, DeepSpeed's warm-up, and the last, which ends the run,
    left out) of the CUDA-level synchronisations and of the calls count_syncs.py counts."""
    steps = sorted(map(int, per_step))[1:-1]
    if not steps:
        return Outcome("FAIL", f"{len(per_step)} steps recorded: too few for a steady one")
    device = statistics.median(sum(c["kind"] in CUDA_SYNCS for c in per_step[str(s)]) for s in steps)
    calls = statistics.median(sum(c["kind"] not in CUDA_SYNCS for c in per_step[str(s)]) for s in steps)
    where = f"median of steps {steps[0]}-{steps[-1]}"
    if not cuda:
        return Outcome("pass", f"{calls:g} host-blocking calls per step ({where}; no CUDA: calls only)")
    return Outcome(
        "pass", f"{device:g} CUDA synchronisations per step ({calls:g} host-blocking calls; {where})"
    )


def _mfu_json(ctx: Context, compiled: bool) -> Path:
    return ctx.work / f"train_step{'_compiled' if compiled else ''}.json"


def _mfu_cmd(ctx: Context, compiled: bool) -> list[str]:
    cmd = [sys.executable, "benchmarks/train_step.py", "--models", ",".join(VARIANTS)]
    cmd += (
        ["--smoke"] if ctx.smoke else ["--device", "cuda", "--batch", "256", "--reps", "5", "--warmup", "2"]
    )
    return cmd + (["--compile"] if compiled else []) + ["--json", str(_mfu_json(ctx, compiled))]


def mfu(ctx: Context, compiled: bool) -> Outcome:
    path = _mfu_json(ctx, compiled)
    path.unlink(missing_ok=True)
    rc, _ = ctx.run(_mfu_cmd(ctx, compiled))
    if rc != 0 or not path.exists():
        return Outcome("FAIL", f"exit status {rc} (see its log)")
    return mfu_of(json.loads(path.read_text()))


def mfu_of(result: dict) -> Outcome:
    """MFU per variant against the device's bf16 peak (TFLOP/s where the peak is unknown), and shared's
    throughput over standard's."""
    from swbert.runtime.monitor import peak_tflops_of

    peak = peak_tflops_of(result["machine"]) if result["args"].get("device", "").startswith("cuda") else None
    models = result["models"]
    if peak:
        parts = [f"{name} {models[name]['tflops'] / peak:.1%}" for name in models]
    else:
        parts = [f"{name} {models[name]['tflops']:.3f} TFLOP/s" for name in models]
    figure = ", ".join(parts)
    if "shared/standard" in result["ratios"]:
        figure += f"; shared/standard {result['ratios']['shared/standard']:.2f}x"
    ok = set(models) == set(VARIANTS) and all(m["tflops"] > 0 for m in models.values())
    return Outcome("pass" if ok else "FAIL", figure)


def _overlap_json(ctx: Context) -> Path:
    return ctx.work / "compile_overlap.json"


def _overlap_cmd(ctx: Context) -> list[str]:
    cmd = [sys.executable, "benchmarks/compile_overlap.py", "--json", str(_overlap_json(ctx))]
    if ctx.smoke:
        cmd += ["--layers", "2", "--hidden", "128", "--seq", "32", "--batch", "2", "--reps", "1"]
    return cmd


def compile_overlap(ctx: Context) -> Outcome:
    path = _overlap_json(ctx)
    path.unlink(missing_ok=True)
    rc, _ = ctx.run(_overlap_cmd(ctx), env=ctx.env(DS_ACCELERATOR="cpu"))  # the benchmark is gloo's
    if rc != 0 or not path.exists():
        return Outcome("FAIL", f"exit status {rc} (see its log)")
    return overlap_of(json.loads(path.read_text()))


def overlap_of(result: dict) -> Outcome:
    """Per block, the first reduce must fire in the first half of the backward, and before the
    whole-model graph's (which holds every gradient hook to its end)."""
    at = {mode: r["first_reduce_fraction"] for mode, r in result.items()}
    figure = ", ".join(f"{mode.replace('_', ' ')} {f:.1%}" for mode, f in at.items())
    ok = at.get("per_block", 1.0) < 0.5 and at.get("whole_model", 1.0) > at.get("per_block", 1.0)
    return Outcome("pass" if ok else "FAIL", figure + " of the backward (CPU, gloo)")


def _finetune_cmd(ctx: Context) -> list[str]:
    root = ctx.work / "finetune"
    return [
        sys.executable, "launchers/finetune_glue.py", "--checkpoint", f"tiny={root / 'ckpt'}",
        "--tasks", "sst2", "--data-dir", str(root / "glue"), "--output-dir", str(root / "out"),
        "--learning-rates", "3e-3", "--seeds", "1", "--epochs", "6",
        "--batch-size", "16", "--max-seq-length", "32", "--precision", "fp32" if ctx.smoke else "bf16",
        "--tracking-uri", f"sqlite:///{root / 'mlflow.db'}", "--experiment", "gpu-hour",
    ]  # fmt: skip


def finetune(ctx: Context) -> Outcome:
    from swbert.finetune.synthetic import make_checkpoint, write_glue_fixture

    root = ctx.fresh("finetune")
    with open(ctx.log, "a") as log, contextlib.redirect_stderr(log):  # transformers' progress bars
        write_glue_fixture(root / "glue", ["sst2"], n_train=192, n_dev=48)
        make_checkpoint(root / "ckpt")
    start = time.monotonic()
    rc, _ = ctx.run(_finetune_cmd(ctx))
    seconds = time.monotonic() - start
    if rc != 0:
        return Outcome("FAIL", f"exit status {rc} (see its log)")
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("gpu-hour")
    runs = client.search_runs([experiment.experiment_id], "tags.`swbert.kind` = 'glue_trial'")
    if not runs:
        return Outcome("FAIL", "no fine-tuning run in the MLflow store")
    accuracy = runs[0].data.metrics.get("best/validation/accuracy", float("nan"))
    precision = "fp32" if ctx.smoke else "bf16"
    figure = f"synthetic SST-2 dev accuracy {accuracy:.3f} ({precision}, {seconds:.0f} s with start-up)"
    return Outcome("pass" if accuracy >= 0.9 else "FAIL", figure)  # chance: 0.5


def _validate_pretrain(args: list[str]) -> None:
    from swbert.training.cli import parse_args

    parse_args(args)


def _validate_mfu(ctx: Context, compiled: bool) -> None:
    import runpy

    script = runpy.run_path(str(REPO / "benchmarks" / "train_step.py"), run_name="train_step")
    script["parse_args"](_mfu_cmd(ctx, compiled)[2:])


def _validate_finetune(ctx: Context) -> None:
    import runpy

    launcher = runpy.run_path(str(REPO / "launchers" / "finetune_glue.py"), run_name="finetune_glue")
    launcher["parse_args"](_finetune_cmd(ctx)[2:])  # exits with status 2 and the reason on a bad flag


STEPS: tuple[Step, ...] = (
    Step("cuda_tests", "`tests/e2e/test_cuda.py`", 1200, cuda_tests, lambda ctx: [_pytest_cmd()]),
    Step(
        "zero3_compile",
        "ZeRO-3 + compile per block, bf16: finishes, loss falls",
        900,
        zero3_compile,
        lambda ctx: [torchrun_cmd(ctx.nproc, _zero3_args(ctx))],
        lambda ctx: _validate_pretrain(_zero3_args(ctx, ctx.work)),
    ),
    Step("fp32_accum", "bf16 with fp32 gradient accumulation", 30, fp32_accum),
    Step(
        "host_syncs",
        "host syncs per optimizer step (bf16, ZeRO-2)",
        900,
        host_syncs,
        lambda ctx: [_sync_cmd(ctx)],
        lambda ctx: _validate_pretrain(_sync_args(ctx, ctx.work)),
    ),
    Step(
        "mfu_eager",
        "MFU per variant, eager (`train_step.py`)",
        900,
        lambda ctx: mfu(ctx, compiled=False),
        lambda ctx: [_mfu_cmd(ctx, False)],
        lambda ctx: _validate_mfu(ctx, False),
    ),
    Step(
        "mfu_compiled",
        "MFU per variant, torch.compile (`train_step.py --compile`)",
        1200,
        lambda ctx: mfu(ctx, compiled=True),
        lambda ctx: [_mfu_cmd(ctx, True)],
        lambda ctx: _validate_mfu(ctx, True),
    ),
    Step(
        "compile_overlap",
        "first ZeRO-2 gradient reduce, share of the backward (`compile_overlap.py`)",
        1200,
        compile_overlap,
        lambda ctx: [_overlap_cmd(ctx)],
    ),
    Step(
        "finetune",
        "fine-tuning, GLUE-style (synthetic SST-2)",
        900,
        finetune,
        lambda ctx: [_finetune_cmd(ctx)],
        _validate_finetune,
    ),
)


# ---------------------------------------------------------------------------------------------------
# Running the steps and writing the report


def run_steps(steps: Sequence[Step], ctx: Context, scale: float = 1.0) -> list[tuple[Step, Outcome]]:
    """Each step in turn under its own deadline (timeout x `scale`); a failure, a timeout or an
    exception is that step's row and the next step runs."""
    rows = []
    ctx.work.mkdir(parents=True, exist_ok=True)
    for step in steps:
        ctx.log = ctx.work / f"{step.name}.log"
        ctx.log.write_text("")
        ctx.deadline = time.monotonic() + step.timeout * scale
        start = time.monotonic()
        print(f"[{step.name}] {step.check} ...", flush=True)
        try:
            outcome = step.run(ctx)
        except StepTimeout as err:
            outcome = Outcome("timeout", f"after {step.timeout * scale:.0f} s ({err})")
        except Exception as err:  # noqa: BLE001 - one broken step must not hide the others' results
            outcome = Outcome("FAIL", f"{type(err).__name__}: {err}".splitlines()[0][:200])
        with open(ctx.log, "a") as f:
            f.write(f"\n# {step.name}: {outcome.result}: {outcome.figure}\n")
        print(
            f"[{step.name}] {outcome.result}: {outcome.figure} ({time.monotonic() - start:.0f} s)", flush=True
        )
        rows.append((step, outcome))
    return rows


def report(rows: list[tuple[Step, Outcome]], heading: str, work: str) -> str:
    """A heading, one table (check | result | figure) and where the logs are."""
    lines = [f"### {heading}", "", "| check | result | figure |", "|---|---|---|"]
    for step, outcome in rows:
        figure = outcome.figure.replace("|", "\\|")
        lines.append(f"| {step.check} | {outcome.result} | {figure} |")
    lines += ["", f"Logs: `{work}/<step>.log` (steps: {', '.join(s.name for s, _ in rows)})."]
    return "\n".join(lines) + "\n"


def shown(path: Path) -> str:
    """`path` relative to the repository when it is inside it (what a report pasted elsewhere shows)."""
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def exit_status(rows: list[tuple[Step, Outcome]]) -> int:
    return 1 if any(o.result in ("FAIL", "timeout") for _, o in rows) else 0


def machine_heading(smoke: bool) -> str:
    import torch

    when = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    if smoke:
        return f"GPU hour, smoke run on CPU ({when}, torch {torch.__version__}): tiny sizes, not figures"
    name = torch.cuda.get_device_name()
    versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"GPU hour: {torch.cuda.device_count()} x {name} ({when}, {versions})"


def no_cuda_reason() -> str | None:
    """Why this machine cannot run the GPU steps, in one line; None when it can."""
    try:
        import torch
    except ImportError as err:
        return f"torch is not importable ({err})"
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build (install a CUDA build: `make setup CONSTRAINTS=`)"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--report", type=Path, default=REPO / "runs" / "gpu-report.md", help="the Markdown table")
    p.add_argument(
        "--work-dir", type=Path, default=REPO / "runs" / "gpu-hour", help="the steps' logs and runs"
    )
    names = [s.name for s in STEPS]
    p.add_argument("--only", default=None, help=f"comma-separated steps to run, of {', '.join(names)}")
    p.add_argument("--skip", default=None, help="comma-separated steps to leave out")
    p.add_argument(
        "--nproc", type=int, default=None, help="ranks of the ZeRO-3 run (default: GPUs, at most 2)"
    )
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiplies every step's timeout")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="list the steps and their commands, run nothing")
    mode.add_argument("--smoke", action="store_true", help="each step's CPU-capable part, tiny sizes")
    args = p.parse_args(argv)
    for flag in ("only", "skip"):
        chosen = [n.strip() for n in (getattr(args, flag) or "").split(",") if n.strip()]
        unknown = sorted(set(chosen) - set(names))
        if unknown:
            p.error(f"--{flag}: unknown step {', '.join(unknown)}; the steps are {', '.join(names)}")
        setattr(args, flag, chosen)
    return args


def select(args: argparse.Namespace) -> list[Step]:
    return [s for s in STEPS if (not args.only or s.name in args.only) and s.name not in args.skip]


def dry_run(steps: Sequence[Step], ctx: Context) -> int:
    """Print each step with its timeout and commands, and check the commands' arguments against the
    parsers of what they call (a renamed flag fails here, not in the GPU hour)."""
    status = 0
    for step in steps:
        print(f"{step.name:16s} {step.timeout:5.0f} s  {step.check}")
        for cmd in step.commands(ctx):
            print(f"{'':24s}$ {shlex.join(map(str, cmd))}")
        try:
            step.validate(ctx)
        except (Exception, SystemExit) as err:  # noqa: BLE001 - report every step's problem
            print(f"{'':24s}! its arguments are refused: {err}")
            status = 1
    return status


def count_syncs_child(argv: list[str]) -> None:
    """Run tests/scripts/count_syncs.py (argv: its path, then its arguments) with CUDA's device, stream
    and event synchronisations recorded next to the calls it counts itself."""
    import runpy

    import torch

    script, *rest = argv
    module = runpy.run_path(script, run_name="count_syncs")
    record = module.get("_record")
    if record is not None and torch.cuda.is_available():
        from torch.cuda import _gpu_trace

        _gpu_trace.register_callback_for_device_synchronization(lambda: record("cuda_device_sync"))
        _gpu_trace.register_callback_for_stream_synchronization(lambda _s: record("cuda_stream_sync"))
        _gpu_trace.register_callback_for_event_synchronization(lambda _e: record("cuda_event_sync"))
        torch._C._activate_gpu_trace()
    sys.argv = [script, *rest]
    module["main"]()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--count-syncs-child"]:
        count_syncs_child(argv[1:])
        return 0
    args = parse_args(argv)
    steps = select(args)
    ctx = Context(work=args.work_dir.resolve(), smoke=args.smoke, nproc=args.nproc or 1)
    if args.dry_run:
        return dry_run(steps, ctx)
    if not args.smoke:
        reason = no_cuda_reason()
        if reason is not None:
            print(f"gpu_hour: skipped, no GPU to test: {reason}.", file=sys.stderr)
            return SKIPPED
        if args.nproc is None:
            import torch

            ctx.nproc = min(2, torch.cuda.device_count())
    rows = run_steps(steps, ctx, args.timeout_scale)
    text = report(rows, machine_heading(args.smoke), shown(ctx.work))
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(text)
    print(f"\n{text}\nreport: {shown(args.report.resolve())}")
    return exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())
