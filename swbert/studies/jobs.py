"""A point's training job (`launchers/pretrain.py` under torchrun, in a session of its own, output in
the point's `run.log`): tied to the study, given a time limit, waited for while another job still
holds its run folder, and its failure put in one line."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swbert.runtime.dist import signal_on_parent_death
from swbert.runtime.exits import PREEMPTED_EXIT

log = logging.getLogger("swbert.studies")

REPO = Path(__file__).resolve().parents[2]
CHECKOUT = REPO if (REPO / "launchers").is_dir() else None  # where jobs start (None: the wheel's launchers)

# The trainer's refusal of a run folder that another job holds (swbert.training.runlock), and how long
# a point waits for it to be freed (ours): the job of a study that was killed is still checkpointing
# on its way out (SIGTERM when the study died, `start_job`) when the study is run again.
BUSY = "is in use by another job"
BUSY_WAIT_S, BUSY_RETRY_S = 600.0, 10.0


def start_job(cmd: list[str], cwd: Path | None, env: dict[str, str], out: Any) -> subprocess.Popen:
    """Start a training job writing to `out`, in its own process group (a time limit kills it whole).
    On Linux the launcher gets SIGTERM when this process dies, however (kill -9 included): its ranks
    checkpoint and stop rather than train on as orphans holding the run folder's lock."""
    parent = os.getpid()
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=lambda: signal_on_parent_death(signal.SIGTERM, parent),
    )  # fmt: skip


_ERROR = re.compile(r"^(?:\[rank\d+\]: )?(error: .*|\w*(?:Error|Exception)\b.*)")


def last_error(log_path: Path, offset: int = 0) -> str:
    """The ranks' own error line (not the launcher's summary), else the last line, of `log_path`
    from byte `offset` on."""
    with open(log_path, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        m = _ERROR.match(line)
        if m and "ChildFailedError" not in line:
            return m.group(1)[:300]
    return lines[-1][:300] if lines else "no output"


def pretrain_command(nproc: int, args: Sequence[str]) -> list[str]:
    """`launchers/pretrain.py ARGS` under torchrun on `nproc` local processes."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        "-m", "swbert.launchers.pretrain", *args,
    ]  # fmt: skip


def job_env() -> dict[str, str]:
    """A point's job's environment: unbuffered, no MLflow store of its own (the study records it)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


@dataclass
class JobEnd:
    """How a point's job ended."""

    rc: int | None  # exit status; None: ran past its time limit and was killed
    error: str  # its own error line ("" when it succeeded)
    wall_s: float
    log: Path

    @property
    def busy(self) -> bool:  # refused: another job still held the run folder (not a failure)
        return self.rc not in (0, None) and BUSY in self.error

    def failure(self, timeout_s: float) -> tuple[str, str] | None:
        """None when the job succeeded, else its point's status and why, in one line with its log:
        `stopped` (on request, checkpointed, or its folder still held: runs again next time) or `failed`."""
        if self.rc is None:
            return "failed", f"timed out after {timeout_s:.0f} s (--point-timeout); log: {self.log}"
        if self.rc == PREEMPTED_EXIT:
            return "stopped", f"stopped on request (exit status {self.rc}); re-run to resume it"
        if self.busy:
            return "stopped", f"{self.error}; re-run the study when that job has ended"
        if self.rc == 0:
            return None
        kind = f"killed by signal {-self.rc} (out of memory?)" if self.rc < 0 else f"exit status {self.rc}"
        kind = "diverged" if "non-finite" in self.error else kind
        return "failed", f"{kind}: {self.error}; log: {self.log}"


def run_job(
    cmd: list[str],
    log_path: Path,
    timeout_s: float,
    env: dict[str, str] | None = None,
    watch: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None,
) -> JobEnd:
    """Run a point's job to its end in the checkout (`env`: `job_env()`'s by default), output appended
    to `log_path`, `watch(pid)` around each attempt (a memory watchdog). One refused because another
    job (a killed study's, checkpointing on its way out) still holds its folder is started again
    every BUSY_RETRY_S for up to BUSY_WAIT_S."""
    start, busy_until = time.perf_counter(), time.monotonic() + BUSY_WAIT_S
    with open(log_path, "a") as out:
        while True:
            out.flush()
            offset = out.tell()  # this attempt's output starts here
            proc = start_job(cmd, CHECKOUT, env or job_env(), out)
            with watch(proc.pid) if watch else contextlib.nullcontext():
                try:
                    rc: int | None = proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:  # past its time limit: killed whole
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    rc = None
                except BaseException:  # the study stops (Ctrl-C, SIGTERM): its job checkpoints and stops
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait()
                    raise
            error = last_error(log_path, offset) if rc not in (0, None) else ""
            if BUSY not in error or time.monotonic() > busy_until:
                return JobEnd(rc, error, time.perf_counter() - start, log_path)
            log.info("%s is still in use; trying again in %.0f s", log_path.parent, BUSY_RETRY_S)
            time.sleep(BUSY_RETRY_S)
