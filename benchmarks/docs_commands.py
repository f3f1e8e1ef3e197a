"""Walk the documented commands: every shell command (and Python example) in the fenced code blocks
of README.md and docs/*.md, classified, and the ones that run offline on a CPU run as written, in
document order, in a scratch copy of the checkout, each with a timeout; then one table: command,
class, status, seconds.

    python benchmarks/docs_commands.py                    # `make docs-check`
    python benchmarks/docs_commands.py --list             # every command and its class; nothing runs
    python benchmarks/docs_commands.py --only pretrain     # the runnable ones whose text holds a word
    python benchmarks/docs_commands.py --classes cpu long # also the long CPU measurements

Why: the docs are what a newcomer runs first, and a flag renamed in the code but not in the docs is
caught only by running the docs' own text. What counts as a command: every non-comment line of a
`bash`/`sh`/`shell`/`console` block (a `\\` continuation, a `for ... done` loop and a line ending in
`&` with the next one are one command; `export` lines are set for the rest of their block), the lines
of an unlabelled block that start like a command (the rest are example output), and each `python`
block as one script. Optional parts written `[--flag VALUE]` are left out, as the synopsis means.

Each command gets the class of the first of RULES whose pattern it matches (the reason is printed
with --list): `cpu` runs; `gpu`, `slurm`, `hub` (downloads), `input` (needs a previous command's
output the docs do not make here, or your own data: placeholders), `long` (a CPU measurement of many
minutes, run with --classes) and `suite` (the test suite and this walk: CI and make run them) are
listed, not run. Commands run offline (HF_HUB_OFFLINE=1), with the scratch copy first on PYTHONPATH
and the given virtual environment first on PATH; make targets use that environment as it is
(`VENV`), never reinstalling into it.

Exit status: 0 when every command run passed; 1 when one failed or timed out; 2 for bad flags.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parents[1]
Kind = Literal["cpu", "gpu", "slurm", "hub", "input", "long", "suite"]
KINDS: tuple[Kind, ...] = ("cpu", "gpu", "slurm", "hub", "input", "long", "suite")


@dataclass(frozen=True)
class Rule:
    """A command matching `pattern` (a regular expression, searched) is of class `kind`, because `why`."""

    kind: Kind
    pattern: str
    why: str


# First match wins; a command matching none runs (class cpu). Ordered so that the reason shown is the
# one a reader acts on: a form with elided arguments is incomplete whatever else it needs.
RULES: tuple[Rule, ...] = (
    Rule(
        "suite", r"^make (test|test-fast|test-long|test-faults|golden)(?![\w-])", "the test suite: CI runs it"
    ),
    Rule("suite", r"^make docs-check\b", "this walk itself"),
    Rule("gpu", r"^make test-gpu\b", "the GPU checks (on a CPU: one line, exit 77)"),
    Rule("hub", r"^hf download\b", "downloads from the Hugging Face Hub"),
    Rule("hub", r"wikimedia/wikipedia|SamuelYang/bookcorpus", "streams a dataset from the Hub"),
    Rule("slurm", r"^sbatch\b", "submits a SLURM job"),
    Rule("slurm", r"submit\.sh\b", "submits a SLURM job array a study wrote"),
    Rule("slurm", r"MASTER_ADDR=10\.", "a rendezvous at another node's address: a cluster"),
    Rule("input", r"\.\.\.", "elided arguments (...): a form to fill in"),
    Rule("gpu", r"--(num_gpus|nproc_per_node) ([4-9]|\d\d)", "4 or more ranks: written for a GPU node"),
    Rule(
        "input", r"(?<![\w/.$-])(N|K|DATA|TAG|[A-Z]+_DIR)(?![\w/.-])", "a placeholder (N, DATA, CKPT_DIR...)"
    ),
    Rule("input", r"path/to/|ckpt/|runs/(std|sh|x)/|runs/paper-", "a placeholder model or run folder"),
    Rule(
        "input", r"runs/(glue|figure3)\b", "the output of a fine-tuning sweep the walk cannot run (Hub data)"
    ),
    Rule("input", r"--collect\b", "the results of the SLURM array above"),
    Rule("input", r"(?<![\w/-])(corpus|shards|tok|data/wiki)/", "your corpus, tokenizer or shards"),
    Rule("input", r"--data-mix\b", "your prepared corpora, mixed"),
    Rule("input", r"paper-(shards|tok)/", "the paper's corpus, built by the Hub commands above"),
    Rule(
        "long",
        r"benchmarks/(train_step|finetune_step|compile_overlap)\.py",
        "a CPU measurement, minutes each",
    ),
    Rule(
        "long",
        r"scaling_study\.py(?!.*--no-measure)(?!.*--emit-slurm).*--sizes",
        "measured runs up to BERT-large",
    ),
    Rule(
        "long",
        r"scaling_study\.py.*--quality",
        "a quality study: a ladder of models trained, minutes each",
    ),
)


@dataclass
class Command:
    """One documented command: where it is written, its text, and how it runs."""

    source: str  # file:line of its first line
    text: str  # as written
    lang: Literal["sh", "python"]
    env_prefix: str = ""  # the block's earlier `export` lines
    kind: Kind = "cpu"
    why: str = "runs offline on a CPU"

    def script(self) -> str:
        """What runs: the text without its optional `[--flag ...]` parts, after the block's exports;
        background jobs are waited for and any failure among them is the command's."""
        if self.lang == "python":
            return self.text
        body = re.sub(r"\s*\[-[^\]]*\]", "", self.text)
        wait = '\nrc=$?\nfor j in $(jobs -p); do wait "$j" || rc=$?; done\nexit $rc' if "&\n" in body else ""
        return f"{self.env_prefix}{body}{wait}"


def classify(cmd: Command) -> Command:
    """Give `cmd` the class and reason of the first rule it matches (`cpu` when none does)."""
    text = cmd.env_prefix + cmd.text
    for rule in RULES:
        if re.search(rule.pattern, text, re.MULTILINE):
            cmd.kind, cmd.why = rule.kind, rule.why
            break
    return cmd


FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
SHELL = {"bash", "sh", "shell", "console"}
# an unlabelled block's line that is a command, not example output
COMMAND_START = re.compile(
    r"^(python3?|make|deepspeed|torchrun|swbert-[\w-]+|hf download|sbatch|export|[A-Z_]+=\S*) "
)


def fenced_blocks(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line number of the first content line, language, lines) of every fenced block in `path`."""
    blocks, current, lang, start, fence = [], None, "", 0, ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        match = FENCE.match(line)
        if current is None and match:
            current, fence, lang, start = [], match.group(1), match.group(2).lower(), number + 1
        elif current is not None and line.strip().startswith(fence[:3]) and not line.strip().strip(fence[0]):
            blocks.append((start, lang, current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def strip_comment(line: str) -> str:
    """`line` without its `# ...` comment (a `#` outside quotes, at the start or after a space)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def shell_commands(where: str, first: int, lines: list[str], labelled: bool) -> list[Command]:
    """The commands of one shell block (see the module docstring for what joins lines)."""
    out: list[Command] = []
    exports, pending, start, loop = "", "", 0, False
    for offset, raw in enumerate(lines):
        line = strip_comment(raw)
        if not line.strip() or (not labelled and not pending and not COMMAND_START.match(line)):
            continue
        if not pending:
            start = first + offset
            loop = bool(re.match(r"\s*(for|while|if)\b", line))
        pending += line + "\n"
        if line.endswith("\\") or line.endswith("&") or (loop and not re.match(r"\s*(done|fi)\b", line)):
            continue
        if pending.startswith("export "):
            exports += pending
        else:
            out.append(Command(f"{where}:{start}", pending.rstrip("\n"), "sh", exports))
        pending = ""
    return out


def documented_commands(root: Path) -> list[Command]:
    """Every command of README.md and docs/*.md under `root`, in reading order, classified."""
    out: list[Command] = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        where = str(path.relative_to(root))
        for first, lang, lines in fenced_blocks(path):
            if lang == "python":
                out.append(Command(f"{where}:{first}", "\n".join(lines), "python"))
            elif lang in SHELL or not lang:
                out += shell_commands(where, first, lines, labelled=bool(lang))
    return [classify(c) for c in out]


def copy_checkout(scratch: Path, venv: Path) -> None:
    """Copy the checkout's files (tracked and untracked, not ignored: no runs/, no .venv) into
    `scratch`, over an earlier copy (whose runs/ stays). The copied pyproject.toml and constraints are
    dated before the environment's install marker, so `make` there finds `setup` done and never
    reinstalls into `venv`."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    if listed.returncode != 0:
        raise SystemExit(f"docs_commands: {REPO} is not a git checkout; the walk copies a checkout's files")
    for name in filter(None, listed.stdout.split("\0")):
        source = REPO / name
        if source.is_file():
            (scratch / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, scratch / name)
    marker = venv / "bin" / ".installed"
    if marker.is_file():
        older = marker.stat().st_mtime - 1
        for name in ("pyproject.toml", "constraints-cpu.txt"):
            if (scratch / name).is_file():
                os.utime(scratch / name, (older, older))


def job_env(scratch: Path, venv: Path) -> dict[str, str]:
    """The commands' environment: offline, the scratch copy's package first, `venv`'s tools first on
    PATH and as make's VENV; no tracking server of the caller's."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MAKEFLAGS", "MFLAGS")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VENV=str(venv))
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(scratch), env.get("PYTHONPATH", "")]))
    return env


def run_one(cmd: Command, scratch: Path, env: dict[str, str], log: Path, timeout: float) -> tuple[str, float]:
    """Run `cmd` in `scratch`, its output in `log`; (status, seconds). Past `timeout` its whole process
    group is stopped (SIGTERM, then SIGKILL)."""
    argv = [str(Path(env["PATH"].split(os.pathsep)[0]) / "python"), "-"]
    if cmd.lang == "sh":
        argv = ["bash", "-c", cmd.script()]
    start = time.monotonic()
    with open(log, "w") as out:
        out.write(f"# {cmd.source}\n{cmd.script()}\n# ---\n")
        out.flush()
        proc = subprocess.Popen(
            argv, cwd=scratch, env=env, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE, text=True, start_new_session=True,  # its own group: a timeout stops all
        )  # fmt: skip
        try:
            proc.communicate(cmd.script() if cmd.lang == "python" else "", timeout=timeout)
            status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            stop_group(proc)
            status = f"timeout ({timeout:.0f} s)"
    return status, time.monotonic() - start


def stop_group(proc: subprocess.Popen) -> None:
    """Stop `proc` and every process it started (its session's group): SIGTERM, then SIGKILL."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def short(text: str, width: int = 78) -> str:
    """One line of at most `width` characters for the table."""
    line = " ".join(text.replace("\\\n", " ").split()).replace("|", "\\|")
    return line if len(line) <= width else line[: width - 3] + "..."


def table(rows: list[tuple[Command, str, float | None]]) -> str:
    """The Markdown table and a summary line per class and per status."""
    lines = ["| # | where | command | class | status | s |", "|---|---|---|---|---|---|"]
    for i, (cmd, status, seconds) in enumerate(rows, 1):
        secs = "" if seconds is None else f"{seconds:.0f}"
        lines.append(f"| {i} | {cmd.source} | `{short(cmd.text)}` | {cmd.kind} | {status} | {secs} |")
    kinds = Counter(cmd.kind for cmd, _, _ in rows)
    statuses = Counter(status.split(":")[0].split(" (")[0] for _, status, _ in rows)
    lines += [
        "",
        f"{len(rows)} commands: " + ", ".join(f"{kinds[k]} {k}" for k in KINDS if kinds[k]),
        "status: " + ", ".join(f"{n} {s}" for s, n in statuses.most_common()),
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument(
        "--list", action="store_true", help="print every command's class and reason; run nothing"
    )
    parser.add_argument(
        "--classes", nargs="+", default=["cpu"], choices=KINDS, help="classes to run (default: cpu)"
    )
    parser.add_argument(
        "--only", nargs="+", default=[], help="run only commands whose text holds one of these"
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per command (default 1800)")
    parser.add_argument("--venv", type=Path, default=Path(sys.prefix), help="environment the commands use")
    parser.add_argument(
        "--scratch", type=Path, help="folder to run in (kept; default: a temporary one, removed)"
    )
    parser.add_argument("--report", type=Path, help="also write the table to this Markdown file")
    args = parser.parse_args(argv)
    args.venv = args.venv.absolute()
    if not (args.venv / "bin" / "python").exists():
        parser.error(
            f"--venv {args.venv}: no bin/python there; name the virtual environment the commands use"
        )
    return args


def walk(args: argparse.Namespace, scratch: Path) -> list[tuple[Command, str, float | None]]:
    """Run the selected commands in order in `scratch`; one row per documented command."""
    copy_checkout(scratch, args.venv)
    env, logs = job_env(scratch, args.venv), scratch / ".docs-check"
    logs.mkdir(exist_ok=True)
    rows: list[tuple[Command, str, float | None]] = []
    for i, cmd in enumerate(documented_commands(scratch), 1):
        if cmd.kind not in args.classes:
            rows.append((cmd, f"not run: {cmd.why}", None))
        elif cmd.text.startswith("make ") and not (args.venv / "bin" / ".installed").is_file():
            # make would take the environment for a fresh one and reinstall this copy into it
            rows.append((cmd, f"not run: {args.venv} was not made by `make setup`", None))
        elif args.only and not any(word in cmd.text for word in args.only):
            rows.append((cmd, "not run (--only)", None))
        else:
            print(f"[{i}] {short(cmd.text)}", flush=True)
            status, seconds = run_one(cmd, scratch, env, logs / f"{i:02d}.log", args.timeout)
            if status != "ok":
                tail = (logs / f"{i:02d}.log").read_text(errors="replace").splitlines()[-3:]
                print("    " + status + ": " + " | ".join(t.strip() for t in tail), flush=True)
            rows.append((cmd, status, seconds))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for cmd in documented_commands(REPO):
            print(f"{cmd.kind:<6} {cmd.source:<26} {short(cmd.text, 70):<70}  {cmd.why}")
        return 0
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="swbert-docs-check-"))
    scratch.mkdir(parents=True, exist_ok=True)
    rows = walk(args, scratch.absolute())
    report = table(rows)
    print(report)
    if args.report:
        args.report.write_text(report + "\n", encoding="utf-8")
    passed = all(status == "ok" for _, status, seconds in rows if seconds is not None)
    if args.scratch is None and passed:
        shutil.rmtree(scratch, ignore_errors=True)
    elif not passed:
        print(f"each command's output: {scratch / '.docs-check'}/<#>.log")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
