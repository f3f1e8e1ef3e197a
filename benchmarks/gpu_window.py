"""The first GPU window: what only a GPU answers, in one command that fits 9 minutes on one H200.

    python benchmarks/gpu_window.py                    # on the GPU machine: wheels, then every step
    python benchmarks/gpu_window.py --rehearse         # the same steps at tiny sizes on this CPU
    python benchmarks/gpu_window.py --only trainer_shared,varlen --out DIR

`make test-gpu` runs the first form. It needs no virtual environment and no package index: the
wheels the GPU machine's image lacks (deepspeed, megatron-core, a recent transformers and their
requirements) come from `.whl/` (`make gpu-wheels` writes them where an index is reachable) and are
installed with `pip install --no-index --no-deps --target OUT/site`, then put first on PYTHONPATH.
The steps, in order of what they are worth:

    wheels            each wheel fits this Python (one line names any that does not), installed and imported
    data              a generated corpus, a BERT-size (30,522) tokenizer and shards, in OUT/data
    block_kernels     one compiled base block (bf16, dropout 0.1) under the profiler: the kernels SDPA
                      runs in the forward and the backward
    trainer_shared    the real trainer, base shared, 1 GPU, ZeRO-2, bf16, compile on, seq 128, at the
                      largest micro-batch the memory estimate fits: tokens/s, the trainer's MFU, peak
                      memory against `swbert.scaling.memory`, and its last two steps under
                      torch.profiler with CUDA's sync debug mode on (syncs on every thread, named)
    trainer_standard  the same for standard attention
    zero3_compile     ZeRO-3 + compile on 1 rank, 20 steps, its losses equal to eager's
    varlen            the variable-length fine-tuning kernel: equal to the padded path, real tokens/s
    tp2_graph_breaks  TP=2 + compile at dropout 0.1 under a fake 2-rank process group: graph breaks
    cuda_tests        pytest tests/e2e/test_cuda.py (every variant on the flash kernel, compiled = eager in
                      bf16, the fused AdamW, a 1-GPU job), in the time left

Each step runs in its own process with its own timeout, inside one overall budget (--budget,
540 s); a failing, timed-out or skipped step is one row and the next step runs. The report, in
--out (default runs/gpu-window), is rewritten after every step, so a killed run keeps its rows:
gpu-window.json (one row per step: name, status ok | failed | timed out | skipped, seconds, figures,
note) and gpu-window.md (the same as a table, ready for docs/performance.md). Each step's output is
in OUT/logs/STEP.log. Exit status: 0 when every step is ok, 1 otherwise, 2 for bad flags.

`--rehearse` runs the same steps at tiny sizes on the CPU (gloo, fp32 or bf16, torch.compile's
aot_eager backend: the same graphs without a C++ compiler), installing whatever `.whl/` holds (the
tests give it a small wheel of their own), with mlflow and datasets made unimportable in the steps
as on the GPU machine. tests/project/test_gpu_window.py runs it, so the script cannot rot between
windows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / ".whl"
BUDGET_S = 540.0  # 9 minutes: the window's 10-minute command limit, less the start and the copy back
# Packages the machine's image lacks on purpose: the steps must run without them (MLflow is off,
# no Hub dataset is read); a step that imports one fails here as it would there.
ABSENT_THERE = ("mlflow", "datasets")
STATUSES = ("ok", "failed", "timed out", "skipped")


@dataclass(frozen=True)
class Step:
    """One row: a name, what it checks, its timeout on the GPU and in the rehearsal (seconds)."""

    name: str
    check: str
    timeout: float
    rehearse_timeout: float
    needs_gpu: bool = True


STEPS: tuple[Step, ...] = (
    Step("wheels", "wheels fit this Python, install offline and import", 60, 120, needs_gpu=False),
    Step("data", "a generated corpus, a 30,522-piece tokenizer and shards", 45, 120, needs_gpu=False),
    Step("block_kernels", "compiled base block, bf16, dropout 0.1: SDPA's kernels", 60, 120),
    Step("trainer_shared", "trainer, base shared, ZeRO-2, bf16, compile: tokens/s, MFU, memory, syncs", 170, 240),
    Step("trainer_standard", "the same, standard attention", 150, 240),
    Step("zero3_compile", "ZeRO-3 + compile, 1 rank, 20 steps: losses equal to eager", 90, 240),
    Step("varlen", "variable-length fine-tuning kernel: equal to padded, real tokens/s", 45, 120),
    Step("tp2_graph_breaks", "TP=2 + compile, dropout 0.1, fake 2-rank group: graph breaks", 45, 120, needs_gpu=False),
    Step("cuda_tests", "tests/e2e/test_cuda.py, in whatever budget is left", 120, 240),
)  # fmt: skip


@dataclass
class Row:
    """One step's result, as gpu-window.json stores it."""

    name: str
    check: str
    status: str = "skipped"
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    note: str = ""


# ---------------------------------------------------------------------------------------------------
# Wheels: checked against this interpreter, installed offline, first on PYTHONPATH


def wheel_fits(filename: str, tags: set[str]) -> bool:
    """Whether a wheel's tags include one of `tags` (this interpreter's: `supported_tags`)."""
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename

    try:
        return any(str(tag) in tags for tag in parse_wheel_filename(filename)[3])
    except InvalidWheelFilename:
        return False


def supported_tags() -> set[str]:
    """This interpreter's wheel tags (`packaging`: transformers requires it, so every image that
    runs the steps has it)."""
    from packaging.tags import sys_tags

    return {str(t) for t in sys_tags()}


def install_wheels(wheels: Path, site: Path, log: Path) -> tuple[Row, bool]:
    """Install every wheel of `wheels` that fits this Python into `site` (pip, no index, no
    dependency resolution: the wheelhouse is the whole list). Returns the row and whether `site`
    should go on PYTHONPATH."""
    row = Row("wheels", STEPS[0].check)
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        row.status = "failed"
        row.note = f"no wheels in {shown(wheels)}: run `make gpu-wheels` where a package index is reachable"
        return row, False
    tags = supported_tags()
    wrong = [w.name for w in found if not wheel_fits(w.name, tags)]
    fits = [w for w in found if w.name not in wrong]
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    row.figures = {"wheels": len(found), "mib": round(sum(w.stat().st_size for w in found) / 2**20, 1)}
    notes = [f"not for Python {py} on this platform: {', '.join(wrong)}"] if wrong else []
    if fits:
        shutil.rmtree(site, ignore_errors=True)  # pip --target keeps what a folder holds already
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet",
               "--disable-pip-version-check", "--target", str(site), *map(str, fits)]  # fmt: skip
        with open(log, "a") as f:
            f.write(f"$ {shlex.join(cmd)}\n")
            f.flush()
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            notes.append(f"pip install exited {rc} (see {shown(log)})")
        row.figures["installed"] = len(fits) if rc == 0 else 0
    row.status = "failed" if notes else "ok"
    row.note = "; ".join(notes)
    return row, bool(fits)


# ---------------------------------------------------------------------------------------------------
# Running the steps


@dataclass
class Window:
    """Where the steps write, how they run, and the rows so far."""

    out: Path
    rehearse: bool
    budget: float
    pythonpath: list[str] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    gpu_reason: str | None = None  # why there is no GPU, where one was expected

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        path = [*self.pythonpath, str(REPO), env.get("PYTHONPATH", "")]
        env.update(
            PYTHONPATH=os.pathsep.join(p for p in path if p),
            DS_ACCELERATOR="cpu" if self.rehearse else "cuda",
            PYTHONUNBUFFERED="1",
            TOKENIZERS_PARALLELISM="false",
            SWBERT_WINDOW_ABSENT=",".join(ABSENT_THERE),
        )
        env.pop("MLFLOW_TRACKING_URI", None)
        # the wheels' scripts (ninja, for an op DeepSpeed compiles on first use) before the image's
        env["PATH"] = os.pathsep.join([*(str(Path(p) / "bin") for p in self.pythonpath), env.get("PATH", "")])
        if self.rehearse:
            env["OMP_NUM_THREADS"] = "1"
        return env

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.started)

    def write_report(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        record = {
            "machine": machine(self.rehearse),
            "budget_s": self.budget,
            "steps": [asdict(r) for r in self.rows],
        }
        atomic_write(self.out / "gpu-window.json", json.dumps(record, indent=1) + "\n")
        atomic_write(self.out / "gpu-window.md", markdown(self.rows, record["machine"], self.out))


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_child(window: Window, step: Step) -> Row:
    """`step` in a process of its own, killed with everything it started past its timeout (or the
    budget left); its figures come back as OUT/steps/STEP.json."""
    row = Row(step.name, step.check)
    limit = min(step.rehearse_timeout if window.rehearse else step.timeout, window.left())
    if window.left() < 5:
        row.note = f"not started: {max(0.0, window.left()):.0f} s of the {window.budget:.0f} s budget left"
        return row
    result = window.out / "steps" / f"{step.name}.json"
    result.unlink(missing_ok=True)
    log = window.out / "logs" / f"{step.name}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", step.name, "--out", str(window.out)]
    cmd += ["--rehearse"] if window.rehearse else []
    started = time.monotonic()
    with open(log, "w") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=window.env(), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            rc = None
    row.seconds = round(time.monotonic() - started, 1)
    if result.exists():
        found = json.loads(result.read_text())
        row.status, row.figures, row.note = found["status"], found["figures"], found.get("note", "")
    if rc is None:
        row.status = "timed out"
        row.note = f"killed after {limit:.0f} s" + (f"; {row.note}" if row.note else "")
    elif not result.exists():
        row.status = "failed"
        row.note = f"exit status {rc}: {last_error(log)}"
    return row


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a step's process group (its data loaders, compile workers and ranks with it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def last_error(log: Path) -> str:
    """The line of a step's log that says what went wrong: its last exception line, else its last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", line) or line.startswith("error:"):
            return line[:300]
    return (lines[-1] if lines else "no output")[:300]


def run_window(window: Window, steps: Sequence[Step], wheels: Path) -> list[Row]:
    (window.out / "logs").mkdir(parents=True, exist_ok=True)
    (window.out / "steps").mkdir(parents=True, exist_ok=True)
    for step in steps:
        print(f"[{step.name}] {step.check} ...", flush=True)
        started = time.monotonic()
        if step.name == "wheels":
            row, use = install_wheels(wheels, window.out / "site", window.out / "logs" / "wheels.log")
            if use:
                window.pythonpath = [str(window.out / "site")]
                row = imports_row(window, row)
            row.seconds = round(time.monotonic() - started, 1)
        elif step.needs_gpu and window.gpu_reason:
            row = Row(step.name, step.check, "skipped", note=f"no GPU: {window.gpu_reason}")
        else:
            row = run_child(window, step)
        window.rows.append(row)
        window.write_report()
        figures = ", ".join(f"{k} {v}" for k, v in row.figures.items() if not isinstance(v, (dict, list)))
        print(f"[{step.name}] {row.status} ({row.seconds:.0f} s) {figures} {row.note}".rstrip(), flush=True)
    return window.rows


def imports_row(window: Window, row: Row) -> Row:
    """The installed wheels import in a fresh interpreter, ahead of the image's own packages."""
    probe = (
        "import importlib, json; out = {}\n"
        "for name in ('deepspeed', 'megatron.core', 'transformers'):\n"
        "    try:\n"
        "        m = importlib.import_module(name); out[name] = getattr(m, '__version__', '?')\n"
        "    except Exception as err:\n"
        "        out[name] = f'not importable: {type(err).__name__}: {err}'.splitlines()[0][:160]\n"
        "print(json.dumps(out))"
    )
    try:
        done = subprocess.run([sys.executable, "-c", probe], env=window.env(), capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        versions = json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError) as err:
        row.status, row.note = "failed", f"import probe failed: {err}"
        return row
    row.figures["versions"] = versions
    broken = [f"{k} {v}" for k, v in versions.items() if str(v).startswith("not importable")]
    if broken:
        row.status = "failed"
        row.note = "; ".join([row.note, *broken]) if row.note else "; ".join(broken)
    return row


# ---------------------------------------------------------------------------------------------------
# The report


def machine(rehearse: bool) -> dict:
    """What ran the window: the device and the versions the figures depend on."""
    info = {
        "python": sys.version.split()[0],
        "when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available() and not rehearse:
            info["device"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
            info["cuda"] = torch.version.cuda
        else:
            info["device"] = "CPU (rehearsal: tiny sizes, not figures)" if rehearse else "no CUDA device"
    except ImportError as err:
        info["device"] = f"torch not importable: {err}"
    return info


def markdown(rows: Sequence[Row], info: dict, out: Path) -> str:
    """A heading naming the machine and one table: step | status | seconds | figures | note."""
    what = ", ".join(f"{k} {v}" for k, v in info.items() if k not in ("when", "device"))
    lines = [f"### GPU window: {info.get('device')} ({info['when']}; {what})", "",
             "| step | status | s | figures | note |", "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        figures = "; ".join(f"{k}: {fmt(v)}" for k, v in r.figures.items())
        cells = [r.name, r.status, f"{r.seconds:.0f}", figures, r.note]
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    lines += ["", f"Logs: `{shown(out)}/logs/<step>.log`; figures: `{shown(out)}/gpu-window.json`."]
    return "\n".join(lines) + "\n"


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {fmt(v)}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(map(fmt, value))
    return str(value)


def shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def no_gpu_reason() -> str | None:
    """Why this machine has no CUDA device for the steps, in one line; None when it has one."""
    try:
        import torch
    except ImportError as err:
        return f"torch is not importable ({err})"
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-window", help="the report and the logs")
    p.add_argument("--wheels", type=Path, default=WHEELS, help="the wheelhouse (`make gpu-wheels`)")
    p.add_argument("--rehearse", action="store_true", help="the same steps at tiny sizes on the CPU")
    p.add_argument(
        "--budget", type=float, default=None, help="seconds for all steps (default 540; rehearsal 1200)"
    )
    names = [s.name for s in STEPS]
    p.add_argument("--only", default="", help=f"comma-separated steps, of {', '.join(names)}")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one step, in its own process
    args = p.parse_args(argv)
    args.only = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(args.only) - set(names)) + (
        [args.child] if args.child and args.child not in names else []
    )
    if unknown:
        p.error(f"unknown step {', '.join(unknown)}; the steps are {', '.join(names)}")
    if args.budget is None:
        args.budget = 1200.0 if args.rehearse else BUDGET_S
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        from benchmarks import gpu_window_steps

        return gpu_window_steps.run_step(args.child, args.out.resolve(), args.rehearse)
    window = Window(out=args.out.resolve(), rehearse=args.rehearse, budget=args.budget)
    if not args.rehearse:
        window.gpu_reason = no_gpu_reason()
    steps = [s for s in STEPS if not args.only or s.name in args.only]
    if "wheels" not in [s.name for s in steps] and (window.out / "site").is_dir():
        window.pythonpath = [str(window.out / "site")]  # what an earlier run installed
    rows = run_window(window, steps, args.wheels.resolve())
    print(f"\n{(window.out / 'gpu-window.md').read_text()}")
    return 0 if all(r.status == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
