"""Shared by the multi-process tests: a small generated corpus and real launches on gloo."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import random
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]

# The one limit on waiting for a job, a file or a log line: a hang guard, which only needs to end a
# hung test, so far above the slowest case on a loaded 2-core machine (a 3-launch test at load 17);
# never a measure of speed. tests/conftest.py gives every slow test the same limit (pytest-timeout),
# so a slow job is never ended before its test would be. SWBERT_TEST_HANG_S sets it.
HANG_S = float(os.environ.get("SWBERT_TEST_HANG_S", "1800"))

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


def make_second_folder(data_dir: Path, root: Path, documents: int = 200, own_tokenizer: bool = False) -> Path:
    """Another data folder for mixes: a corpus of its own (another seed), through the same
    preprocessing CLI as `make_data_dir` but in this process (a fraction of the CPU time of a new
    interpreter), with the tokenizer trained for `data_dir`, or (`own_tokenizer`) one of its own."""
    from data_prep.preprocess import preprocess
    from data_prep.train_tokenizer import train_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    text = str(write_corpus(root / "corpus.txt", documents=documents, seed=1))
    tokenizer = data_dir.parent / "tok"
    if own_tokenizer:
        tokenizer = root / "tok"
        train_tokenizer([text], tokenizer, vocab_size=80, threads=1)
    preprocess([text], tokenizer, root / "data", workers=1, progress=False)
    return root / "data"


def slowdown() -> float:
    """How many times longer CPU-bound work takes here now than on an idle core (at least 1): the
    1-minute load average per usable CPU, or a 50 ms busy loop's wall time over its CPU time,
    whichever is higher (the first sees the minute a timed action took, the second the moment now).

    For the few tests that bound how long something takes, where no event can show it (a stall that
    must not happen, a failure that must come within a timeout): their limits are written for an
    idle machine and multiplied by this, so other jobs on the machine (or `make test`'s own workers)
    lengthen them instead of failing them."""
    load = os.getloadavg()[0] / len(os.sched_getaffinity(0))
    wall, cpu = time.perf_counter(), time.thread_time()
    while time.thread_time() - cpu < 0.05:
        pass
    probe = (time.perf_counter() - wall) / (time.thread_time() - cpu)
    return max(1.0, load, probe)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The DeepSpeed accelerator of a job's environment unless it asks for another, and so the one the fork
# server has: DeepSpeed picks its accelerator once, the first time it is asked, and keeps it.
SERVER_ACCELERATOR = "cpu"


def job_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DS_ACCELERATOR=SERVER_ACCELERATOR,
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


# What every rank of a job imports (about 12 s of CPU a process, most of a tiny job's cost); the
# fork server imports it once per test worker and forks each rank from there.
RANK_PRELOAD = [
    "swbert.training.trainer",
    "swbert.training.loop",
    "swbert.training.cli",
    "deepspeed.runtime.zero.muon.muon_optimizer",  # imported by every ZeRO optimizer; it imports inductor
]
# SWBERT_TEST_LAUNCHER=torchrun starts every `launch` under torchrun instead.
LAUNCHER = os.environ.get("SWBERT_TEST_LAUNCHER", "fork")


def launch(
    nproc: int,
    args: list[str],
    timeout: float = HANG_S,
    env: dict[str, str] | None = None,
    script: str = "launchers/pretrain.py",
    torchrun: bool = False,
) -> subprocess.CompletedProcess:
    """Run a real multi-process job to completion; its output is returned, not raised.

    The ranks are real processes on gloo, each running `script` as `python script args` would, with
    the environment a launcher gives (RANK, WORLD_SIZE, MASTER_ADDR, ...), but forked from a server
    that has imported the job's modules (`RANK_PRELOAD`), as DeepSpeed's own tests run theirs; ranks
    whose DS_ACCELERATOR is not the server's start in a fresh interpreter instead (`_rank_process`).
    Like torchrun, a rank that fails stops the others (SIGTERM, then SIGKILL). `torchrun=True` (or
    SWBERT_TEST_LAUNCHER=torchrun) launches under torchrun, for the tests of launching itself.
    A job past `timeout` (a hang guard, `HANG_S`), or whose test is ended meanwhile (pytest-timeout,
    Ctrl-C), is killed whole, so a hung test leaves no orphaned rank behind."""
    if torchrun or LAUNCHER == "torchrun":
        return _launch_torchrun(nproc, args, timeout, env, script)
    env = dict(env or job_env())
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc))
    env.update(LOCAL_WORLD_SIZE=str(nproc))
    return _forked(
        script, args, [{**env, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(nproc)], timeout
    )


def _forked(
    script: str, args: list[str], envs: list[dict[str, str]], timeout: float
) -> subprocess.CompletedProcess:
    """`python script args` in one process per environment of `envs` (`_rank_process`); their
    outputs joined in order."""
    logs = Path(tempfile.mkdtemp(prefix="ranks-"))
    ranks = []
    for rank, env in enumerate(envs):
        ranks.append(_rank_process(script, args, env, str(logs / str(rank))))
        ranks[-1].start()
    try:
        returncode = _wait_ranks(ranks, timeout)
        out, err = (_read_logs(logs, len(envs), suffix) for suffix in ("out", "err"))
    except BaseException:  # past `timeout`, or the test ended (pytest-timeout's failure, Ctrl-C)
        _stop_ranks(ranks, signal.SIGKILL)  # else the interpreter would wait for them at exit
        raise
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    return subprocess.CompletedProcess([script, *args], returncode, out, err)


def _read_logs(logs: Path, nproc: int, suffix: str) -> str:
    files = [logs / f"{rank}.{suffix}" for rank in range(nproc)]
    return "".join(f.read_text(errors="replace") for f in files if f.exists())


def _rank_context() -> multiprocessing.context.BaseContext:
    """The fork server, started once per test process with a job's environment and imports."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(RANK_PRELOAD)
    saved = dict(os.environ)
    os.environ.update(job_env())  # read at import (OMP threads, the DeepSpeed accelerator)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return context


def _rank_process(
    script: str, args: list[str], env: dict[str, str], log: str
) -> multiprocessing.process.BaseProcess:
    """The process (not started) of one rank that runs `python script args` with `env`, its output
    into `log`.out and `log`.err: forked from the server when `env` asks for the server's DeepSpeed
    accelerator, else spawned, a fresh interpreter that imports DeepSpeed under `env`'s DS_ACCELERATOR
    (a rank forked from the server would keep the server's, picked when it imported DeepSpeed)."""
    on_server = env.get("DS_ACCELERATOR") == SERVER_ACCELERATOR
    context = _rank_context() if on_server else multiprocessing.get_context("spawn")
    start_method = multiprocessing.get_start_method()  # a fresh `python script`'s, not the server's
    return context.Process(target=_run_rank, args=(script, args, env, log, start_method))


def _run_rank(script: str, args: list[str], env: dict[str, str], log: str, start_method: str) -> None:
    """One rank, in a process forked from the server or spawned: `python script args` with `env`."""
    multiprocessing.set_start_method(start_method, force=True)
    for fd, suffix in ((1, "out"), (2, "err")):
        os.dup2(os.open(f"{log}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)
    path = str(REPO / script)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(path))
    runpy.run_path(path, run_name="__main__")


def _wait_ranks(ranks: list, timeout: float, grace: float = 10) -> int:
    """0 once every rank exited 0; else the first failure's code, once the others are stopped (a
    rank that fails alone leaves the rest `grace` seconds to finish on their own: several ranks
    that stop on one error each report it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        failed = [r.exitcode for r in ranks if r.exitcode not in (None, 0)]
        if failed:
            for rank in ranks:
                rank.join(timeout=max(0.0, min(grace, deadline - time.monotonic())))
                grace = 0.0 if rank.exitcode is None else grace
            _stop_ranks(ranks, signal.SIGTERM)
            return failed[0]
        if all(r.exitcode == 0 for r in ranks):
            return 0
        time.sleep(0.1)
    raise subprocess.TimeoutExpired([r.name for r in ranks], timeout)


def _stop_ranks(ranks: list, sig: int, grace: float = 30) -> None:
    """`sig` to every rank still running and its children; SIGKILL to those left after `grace`."""
    family = []
    for rank in ranks:
        if rank.exitcode is None:
            try:
                family += [psutil.Process(rank.pid), *psutil.Process(rank.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
    for p in family:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(family, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    for rank in ranks:
        rank.join(timeout=30)


def _launch_torchrun(
    nproc: int, args: list[str], timeout: float, env: dict[str, str] | None, script: str
) -> subprocess.CompletedProcess:
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
    except BaseException:  # past `timeout`, or the test ended meanwhile
        kill_group(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_single(
    args: list[str], timeout: float = HANG_S, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python launchers/pretrain.py ...`: one process, no launcher (start-up errors, small runs),
    started as `launch` starts a rank (`torchrun` launches: a new interpreter)."""
    if LAUNCHER == "torchrun":
        return subprocess.run(
            [sys.executable, "launchers/pretrain.py", *args],
            cwd=REPO,
            env=env or job_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    return _forked("launchers/pretrain.py", args, [dict(env or job_env())], timeout)


class Forked:
    """`python launchers/pretrain.py args` started as `launch` starts a rank and left running: the
    handle a test signals, polls and waits on as it would a `subprocess.Popen` (`kill_group` included)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.process = _rank_process("launchers/pretrain.py", args, env, str(log))
        self.process.start()
        self.pid, self.args = self.process.pid, args

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.process.exitcode is None:
            os.kill(self.pid, sig)


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
    predicate, timeout: float = HANG_S, interval: float = 0.2, proc: subprocess.Popen | None = None
) -> None:
    """Poll `predicate` until it holds: the event a test waits on (a file, a log line, a step logged).
    `proc` ending first fails at once; `timeout` is a hang guard (`HANG_S`), not a measure of speed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} before the condition held")
        time.sleep(interval)
    raise TimeoutError(f"condition not reached in {timeout:.0f} s")


def _not_json(constant: str) -> None:
    raise ValueError(f"metrics.jsonl holds {constant}, which strict JSON readers refuse")


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl by step; a step logged twice (before a kill and after resume) keeps the last."""
    records = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line, parse_constant=_not_json)  # NaN / Infinity: not strict JSON
        records[record["step"]] = record
    return records
