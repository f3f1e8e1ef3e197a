"""Shared by the multi-process tests: a small generated corpus and real launches on gloo."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]

NOUNS = "cat dog bird fish horse mouse lion tiger bear wolf fox owl".split()
ADJS = "big small red blue old young fast slow happy sad".split()
VERBS = "sees chases likes finds follows watches helps meets".split()


def write_corpus(path: Path, documents: int = 400, seed: int = 0) -> Path:
    """Text with learnable structure (agreement, repeated phrases) so the MLM loss can fall."""
    rng = random.Random(seed)
    lines = []
    for _ in range(documents):
        sentences = []
        for _ in range(rng.randint(3, 8)):
            a, b = rng.choice(NOUNS), rng.choice(NOUNS)
            sentences.append(
                f"the {rng.choice(ADJS)} {a} {rng.choice(VERBS)} the {rng.choice(ADJS)} {b} and the {a} is happy ."
            )
        lines.append(" ".join(sentences))
    path.write_text("\n".join(lines) + "\n")
    return path


def make_data_dir(root: Path, vocab_size: int = 96) -> Path:
    """Tokenizer + shards from a generated corpus, through the real data_prep CLIs."""
    text = write_corpus(root / "corpus.txt")
    env = job_env()

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", *args],
            check=True,
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
        )

    run(
        "data_prep.train_tokenizer",
        "--input",
        str(text),
        "--output",
        str(root / "tok"),
        "--vocab-size",
        str(vocab_size),
    )
    run(
        "data_prep.preprocess",
        "--input",
        str(text),
        "--tokenizer",
        str(root / "tok"),
        "--output",
        str(root / "data"),
        "--workers",
        "1",
    )
    return root / "data"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DS_ACCELERATOR="cpu",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        # torchrun/deepspeed of this interpreter's environment, as in an activated venv
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update(extra)
    return env


def torchrun_cmd(nproc: int, args: list[str], script: str = "launchers/pretrain.py") -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        script,
        *args,
    ]


def launch(
    nproc: int,
    args: list[str],
    timeout: float = 300,
    env: dict[str, str] | None = None,
    script: str = "launchers/pretrain.py",
) -> subprocess.CompletedProcess:
    """Run a real multi-process job to completion; its output is returned, not raised.

    A job past `timeout` is killed whole (launcher and workers, as `kill_group`), so a hung test
    leaves no orphaned rank behind to load the machine for the tests after it."""
    proc = subprocess.Popen(
        torchrun_cmd(nproc, args, script),
        cwd=REPO,
        env=env or job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_single(
    args: list[str], timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python launchers/pretrain.py ...`: one process, no launcher (start-up errors, small runs)."""
    return subprocess.run(
        [sys.executable, "launchers/pretrain.py", *args],
        cwd=REPO,
        env=env or job_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start(
    nproc: int, args: list[str], env: dict[str, str] | None = None, log: Path | None = None
) -> subprocess.Popen:
    """Start a job in its own process group (so a test can kill -9 all of its processes)."""
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen(
        torchrun_cmd(nproc, args),
        cwd=REPO,
        env=env or job_env(),
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def kill_group(proc: subprocess.Popen) -> None:
    """kill -9 the launcher and every process below it (torchrun starts workers in new sessions)."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for p in [*family]:
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


def wait_for(
    predicate, timeout: float = 240, interval: float = 0.2, proc: subprocess.Popen | None = None
) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} before the condition held")
        time.sleep(interval)
    raise TimeoutError("condition not reached in time")


def _not_json(constant: str) -> None:
    raise ValueError(f"metrics.jsonl holds {constant}, which strict JSON readers refuse")


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl by step; a step logged twice (before a kill and after resume) keeps the last."""
    records = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line, parse_constant=_not_json)  # NaN / Infinity: not strict JSON
        records[record["step"]] = record
    return records
