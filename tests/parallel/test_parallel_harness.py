"""Shared pieces of the tensor-parallel tests: real processes on gloo, a tiny model, batches.

`run_ranks(fn, n, ...)` starts n processes (forked from tests/launch_utils.py's fork server, which
has imported torch and DeepSpeed once, so they start in about a second rather than ten; a free
localhost port), initializes torch.distributed on gloo in each and calls `fn(*args)`; an assertion
failing in any rank fails the test with that rank's traceback.

The ranks are never forked from the test process itself: a process that has run a process group
(an in-process fine-tuning run's 1-rank group, say) may hold locks in threads a forked child does
not get, and a child that needs such a lock waits forever. The server is a fresh interpreter that
runs no group, so `fn` and its arguments must be picklable: `fn` a module-level function, and
whatever it needs from the test process passed as an argument (the environment is passed whole).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from swbert.models import SWBertConfig, SWBertForMaskedLM

VOCAB = 128


def tiny_config(attention_type: str = "shared", **overrides: object) -> SWBertConfig:
    """The tiny model without dropout, so TP=1 and TP=k runs are comparable step by step."""
    fields = dict(
        vocab_size=VOCAB,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attention_type=attention_type,
    )
    return SWBertConfig.from_size("tiny", **{**fields, **overrides})


def reference_model(config: SWBertConfig, seed: int = 0) -> SWBertForMaskedLM:
    """A TP=1 model with every parameter away from its init (dq, dk, dv, U start as ones/identity)."""
    torch.manual_seed(seed)
    model = SWBertForMaskedLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def mlm_batch(seed: int, batch: int = 4, seq: int = 16, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """Token ids with padding and ~25% labelled positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, seq // 2 :] = 0
    ids[mask == 0] = 0
    labels = torch.where(torch.rand(ids.shape, generator=g) < 0.25, ids, torch.full_like(ids, -100))
    labels[mask == 0] = -100
    labels[0, 1] = ids[0, 1]  # at least one labelled token
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., None],
    args: tuple,
    deepspeed: bool,
    env: dict,
    log: str,
    start_method: str,
) -> None:
    """One rank, in a process forked from the server: the test's environment and a launcher's
    variables, a process group, `fn(*args)`; its output into `log`.out, a failure's traceback into
    `log`.err for the test."""
    stream = os.open(f"{log}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for fd in (1, 2):  # not the server's: it has the streams of whichever test started it
        os.dup2(stream, fd)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(1)  # several ranks share a few cores
    multiprocessing.set_start_method(start_method, force=True)  # a rank's loader workers: the test's
    try:
        _in_group(fn, args, deepspeed)
    except BaseException:
        Path(f"{log}.err").write_text(traceback.format_exc())
        raise


def _in_group(fn: Callable[..., None], args: tuple, deepspeed: bool) -> None:
    if deepspeed:
        import deepspeed as ds

        ds.init_distributed(dist_backend="gloo", verbose=False)
    else:
        dist.init_process_group(
            "gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
        )
    try:
        fn(*args)
    finally:
        from swbert import parallel

        if parallel.is_initialized():
            parallel.destroy()
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., None], world: int, *args: object, deepspeed: bool = False, timeout: float | None = None
) -> None:
    """Run `fn(*args)` in `world` processes on gloo; `deepspeed=True` starts them the DeepSpeed way.
    A rank that fails stops the others and fails the test with its traceback; ranks still running
    after `timeout` seconds (default: the suite's hang guard, HANG_S) are killed and the test fails
    (a hang is reported, not waited out). A port another process took between `_free_port` and the
    rendezvous (EADDRINUSE: `fn` never ran) is not the test's failure: the ranks start again on
    another port, up to PORT_TRIES times."""
    from tests.launch_utils import HANG_S

    timeout = HANG_S if timeout is None else timeout
    for _ in range(PORT_TRIES):
        code, failed = _launch(fn, world, args, deepspeed, timeout)
        if code == 0 or "EADDRINUSE" not in failed:
            break
    assert code == 0, f"{fn.__name__} failed in a rank (exit code {code}){failed}"


PORT_TRIES = 3


def _launch(
    fn: Callable[..., None], world: int, args: tuple, deepspeed: bool, timeout: float
) -> tuple[int, str]:
    """The ranks' exit code and the failed ranks' tracebacks, on a fresh free port."""
    from tests.launch_utils import _rank_context, _stop_ranks, _wait_ranks

    context, port, env = _rank_context(), _free_port(), dict(os.environ)
    start_method = multiprocessing.get_start_method()  # the test process's, not the server's
    logs = Path(tempfile.mkdtemp(prefix="run-ranks-"))
    ranks = [
        context.Process(
            target=_entry, args=(r, world, port, fn, args, deepspeed, env, str(logs / str(r)), start_method)
        )
        for r in range(world)
    ]
    for rank in ranks:
        rank.start()
    try:
        code = _wait_ranks(ranks, timeout)
        errors = [(r, logs / f"{r}.err") for r in range(world)]
        failed = "".join(
            f"\nrank {r} (its output ends: {_tail(err.with_suffix('.out'))}):\n{err.read_text()}"
            for r, err in errors
            if err.exists()
        )
    except subprocess.TimeoutExpired:
        _stop_ranks(ranks, signal.SIGKILL)
        raise AssertionError(f"{fn.__name__} in {world} ranks did not finish in {timeout:.0f} s") from None
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    return code, failed


def _tail(path: Path, chars: int = 2000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""
