"""Logging for every entry point: library code logs, and the entry point decides where it goes.

Two streams, as users of training jobs expect them:

- `status` lines (`swbert.status`): what a person running the job reads as it goes (where the
  resolved config is, a line per logged step without the progress bar, where a run resumed, a
  pre-emption), on standard output, rank 0 only;
- everything else (`swbert.*`, and the libraries' warnings) on standard error with a timestamp:
  INFO on rank 0, warnings and errors on every rank.

The console budget is kept here, in one place. Third-party messages known to be harmless
(`KNOWN_NOISE`) are dropped by their exact text, whether they come as Python warnings, as log
records or as prints around a call (`known_prints_dropped`); anything else still shows. The
libraries that log through handlers of their own (DeepSpeed on standard output, MLflow in colour,
transformers) are routed through ours, so the same filter and one plain format apply to them, and
colour codes are stripped from every line: logs are read in files, not terminals.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

STATUS = "swbert.status"
status = logging.getLogger(STATUS)

# libraries whose per-shard or per-migration chatter drowns the progress
QUIET = ("megatron", "mlflow.store.db.utils", "alembic", "sqlalchemy.engine")

# libraries that install console handlers of their own; their records go through ours instead
ROUTED = ("DeepSpeed", "transformers", "mlflow", "alembic", "sqlalchemy.engine", "huey")

ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colour codes (a progress bar's cursor moves are its own)
LOAD_REPORT = " LOAD REPORT"  # transformers' table of the keys `from_pretrained` did not load as saved


@dataclass(frozen=True)
class Noise:
    """A third-party message known to be harmless here, dropped from the console."""

    # "warnings" (Python warnings), "prints" (a call's own prints), "bars" (a progress bar's label) or a
    # logger (its records and its children's)
    source: str
    text: str  # how the message starts, exactly (what follows may vary: paths, numbers)
    why: str  # why dropping it hides nothing a user must act on
    cpu_only: bool = False  # harmless without a GPU only (a GPU tuning hint): shown on GPU machines


ZERO_TO_FP32 = "DeepSpeed's zero_to_fp32 merging the shards for the export: progress, not a result"
SYSTEM_METRICS = "MLflow's system-metrics thread starting and stopping (the metrics are in the MLflow run)"
MLFLOW_MODEL = (
    "the exported model logged as an MLflow pyfunc: swbert gives its signature; no input example is needed"
)
HF_BAR = "transformers' bar over a folder's weights, a fraction of a second per model"

KNOWN_NOISE: tuple[Noise, ...] = (
    Noise(
        "warnings",
        "`torch.distributed.all_gather_into_tensor` is deprecated.",
        "DeepSpeed's ZeRO gathers call it; torch forwards it to all_gather_single, the same collective",
    ),
    Noise(
        "warnings",
        "Apex is not installed. Falling back to Torch Norm",
        "megatron-core's layer specs, imported with its tensor-parallel layers; swbert's norms are torch's",
    ),
    Noise(
        "warnings",
        "Transformer Engine and Apex are not installed. Falling back to ",
        "megatron-core's optimizer and FSDP modules, imported with its parallel state; swbert uses neither",
    ),
    Noise(
        "warnings",
        "When using sequence parallelism it is recommended to set the environment variable "
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "megatron-core's hint for overlapping GPU kernels; nothing to set on a CPU",
        cpu_only=True,
    ),
    Noise(
        "warnings",
        "When using async grad allreduce it is recommended to set the environment variable "
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "megatron-core's hint for overlapping GPU kernels; nothing to set on a CPU",
        cpu_only=True,
    ),
    Noise("warnings", "Add type hints to the `predict` method to enable data validation", MLFLOW_MODEL),
    Noise("warnings", "An input example was not provided when logging the model.", MLFLOW_MODEL),
    Noise(
        "prints",
        "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully",
        "every CPU rank's start: the op is loaded from the extension cache (a build failure is an error)",
    ),
    *(
        Noise("prints", start, ZERO_TO_FP32)
        for start in (
            "Processing zero checkpoint '",
            "Parsing checkpoint created by deepspeed==",
            "Detected checkpoint of type zero stage ",
            "Loading checkpoint shards: ",
            "Reconstructed fp32 state dict with ",
            "Reconstructed Frozen fp32 state dict with ",
            "Reconstructed Trainable fp32 state dict with ",
        )
    ),
    *(
        Noise("mlflow.system_metrics", start, SYSTEM_METRICS)
        for start in (
            "Skip logging GPU metrics.",
            "Started monitoring system metrics.",
            "Stopping system metrics monitoring...",
            "Successfully terminated system metrics monitoring!",
        )
    ),
    *(Noise("bars", start, HF_BAR) for start in ("Loading weights", "Writing model shards")),
)


_ON_GPU = False  # set by `drop_known_warnings`: GPU hints (`Noise.cpu_only`) show on GPU machines


def is_noise(source: str, message: str) -> bool:
    """Whether `message` from `source` (a logger name, "warnings" or "stdout") is known noise."""
    return any(
        (source == n.source or source.startswith(n.source + "."))
        and message.startswith(n.text)
        and not (n.cpu_only and _ON_GPU)
        for n in KNOWN_NOISE
    )


def load_report_line(message: str) -> str:
    """transformers' load report (a table of keys, a dozen lines per model) as one line: the class,
    the folder, and the keys by status. A new task head is reported as missing on every trial."""
    lines = ANSI.sub("", message).splitlines()
    model, _, source = lines[0].partition(LOAD_REPORT)
    words = {"MISSING": "new (not in the checkpoint)", "UNEXPECTED": "unused", "MISMATCH": "re-initialised"}
    keys: dict[str, list[str]] = {}
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.split(" | ")]
        if len(cells) >= 2 and cells[1] in words:
            keys.setdefault(words[cells[1]], []).append(cells[0])
    found = "; ".join(f"{w}: {', '.join(sorted(keys[w]))}" for w in words.values() if w in keys)
    return f"{model.strip()} {source.strip().removeprefix('from: ')}: {found or 'loaded with differences'}"


class ConsoleFilter(logging.Filter):
    """On our handlers: drops known noise and turns a load report into one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if is_noise(record.name, message) or _silenced_by_mlflow(record):
            return False
        if LOAD_REPORT in message:
            record.msg, record.args = load_report_line(message), None
        return True


def _silenced_by_mlflow(record: logging.LogRecord) -> bool:
    """What MLflow's own handler would not print (routed here, its records skip that handler): those of
    its telemetry thread, and any while it has turned its logging off."""
    utils = sys.modules.get("mlflow.utils.logging_utils")
    if utils is None or not record.name.startswith("mlflow"):
        return False
    return bool(utils.should_suppress_logs_in_thread.get()) or not utils.MLFLOW_LOGGING_STREAM.enabled


class PlainFormatter(logging.Formatter):
    """A formatter that strips terminal colour codes (MLflow's, transformers' bold) from its lines."""

    def format(self, record: logging.LogRecord) -> str:
        return ANSI.sub("", super().format(record))


class _CurrentStream(logging.StreamHandler):
    """Writes to `sys.stdout` or `sys.stderr` as they are when a record comes, not as they were when
    logging was set up (a test's captured streams, an entry point called twice in one process)."""

    def __init__(self, name: str) -> None:
        super().__init__(getattr(sys, name))
        self.name_of_stream = name

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = getattr(sys, self.name_of_stream)
        super().emit(record)


def _our_handler(stream: str, fmt: str, level: int) -> logging.Handler:
    handler = _CurrentStream(stream)
    handler.setFormatter(PlainFormatter(fmt))
    handler.setLevel(level)
    handler.addFilter(ConsoleFilter())
    handler._swbert = True  # type: ignore[attr-defined]
    return handler


def _ours(logger: logging.Logger) -> bool:
    return any(getattr(h, "_swbert", False) for h in logger.handlers)


def _quiet_bar(factory: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """transformers' tqdm hook: its bars labelled as known noise are created disabled."""
    if is_noise("bars", str(kwargs.get("desc", ""))):
        kwargs = {**kwargs, "disable": True}
    return factory(*args, **kwargs)


def route_library_loggers() -> None:
    """Send the records of `ROUTED` libraries through the root logger's handlers instead of their own
    (MLflow also configures none when imported later), and turn their known bars off. Libraries
    imported after this call keep their handlers: DeepSpeed is imported before any entry point sets
    logging up (swbert.training.checkpoint imports it), transformers with swbert itself."""
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar over a local copy
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_default_handler()  # creates it first if transformers has not yet
        if hasattr(hf_logging, "set_tqdm_hook"):  # transformers 5
            hf_logging.set_tqdm_hook(_quiet_bar)
    for name in ROUTED:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate = True


def drop_known_warnings() -> None:
    """Python warnings of `KNOWN_NOISE` are not shown from here on, in this process. At the point of
    showing, not as a warnings filter: MLflow shows its warnings under `catch_warnings` with a filter
    of its own in front of ours, and colours their text."""
    global _ON_GPU
    import torch

    _ON_GPU = torch.cuda.is_available()
    if not getattr(warnings.showwarning, "_swbert", False):
        warnings.showwarning = _shown_unless_known(warnings.showwarning)


def _shown_unless_known(show: Any) -> Any:
    def showwarning(
        message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None
    ):
        if not is_noise("warnings", ANSI.sub("", str(message))):
            show(message, category, filename, lineno, file, line)

    showwarning._swbert = True  # type: ignore[attr-defined]
    return showwarning


@contextlib.contextmanager
def known_prints_dropped(stderr: bool = False) -> Iterator[None]:
    """Around a third-party call that prints (DeepSpeed's start on CPU, its zero_to_fp32): its known
    chatter on standard output (and error, for a call that draws a bar there) dropped, any other line
    passed on to where it was going once the call returns."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err) if stderr else contextlib.nullcontext(),
        ):
            yield
    finally:
        for buffer, stream in ((out, sys.stdout), (err, sys.stderr)):
            # splitlines also splits a progress bar's frames, which end in a carriage return
            kept = [line for line in buffer.getvalue().splitlines() if line and not is_noise("prints", line)]
            if kept:
                stream.write("\n".join(kept) + "\n")


def setup_logging(rank: int | None = None) -> None:
    """Configure the root logger, the status stream and the console budget for this process (rank
    from the launcher's environment when not given). Safe to call more than once. A root logger that
    already has handlers (an application's, pytest's) is left as it is."""
    if rank is None:
        rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    level = logging.INFO if rank == 0 else logging.WARNING
    root = logging.getLogger()
    if not root.handlers:
        root.setLevel(level)
        fmt = f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s"
        root.addHandler(_our_handler("stderr", fmt, level))
    if _ours(root):  # their records are filtered only where the handlers are ours
        route_library_loggers()
    drop_known_warnings()
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    status.propagate = False
    status.setLevel(level)
    if not _ours(status):
        status.addHandler(_our_handler("stdout", "%(message)s", logging.NOTSET))
