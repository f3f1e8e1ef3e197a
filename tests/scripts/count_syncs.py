"""Run pretraining in-process and count the host-blocking calls of every optimizer step.

    torchrun --nproc_per_node 2 tests/scripts/count_syncs.py --syncs-out DIR <pretraining args>

On a GPU each of these makes the host wait for the device: reading a tensor's value (`item`,
`tolist`, `__bool__`, `__float__`, `__int__`, `__index__`, `cpu`, `numpy`), synchronising the
device (`torch.cuda.synchronize`, DeepSpeed's `get_accelerator().synchronize`) and building a
tensor from host data on the device (`torch.tensor(x, device=...)`: a copy from pageable memory,
which waits for the kernels queued before it). On a CPU they do not wait, but they are the same
calls at the same places, so counting them here counts what an H100 would wait for. Every call is
counted with the stack and the thread that made it, from the first step on (set-up is not counted),
on every thread: on a GPU the backward, and every DeepSpeed gradient hook with it, runs on
autograd's device thread. The reader decides which (if any) are host-only (see
tests/training/test_host_syncs.py); those of a DataLoader's pin-memory thread
(`on_pin_memory_thread`), which copies host tensors into page-locked host memory, always are.

The optimizer is the one `--optimizer auto` picks on a GPU (`gpu_optimizer`). Each rank writes
DIR/rank<r>.json: for every step (1-based, the loop's iteration: the step itself, its logging and
saving) the list of calls, each as `kind`, `thread` (its name) and `stack` (its innermost frames).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2].as_posix()
TENSOR_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")

# torch's DataLoader leaves the Python name of its pin-memory thread unset, so Python names it after
# the thread's target: "Thread-<n> (_pin_memory_loop)".
PIN_MEMORY_THREAD = "(_pin_memory_loop)"

calls: list[dict] = []  # of the current step, from every thread
steps: dict[int, list[dict]] = {}


def _where() -> list[str]:
    """The innermost frames of the call (this file's own left out), innermost last, as
    `path:line:function`: paths of installed packages from the package (`deepspeed/...`,
    `torch/...`), the repository's from its root (`swbert/...`)."""
    frames = []
    for f in traceback.extract_stack()[:-3]:
        path = Path(f.filename).resolve().as_posix()
        if "-packages/" in path:
            path = path.split("-packages/", 1)[1]
        elif path.startswith(f"{REPO}/"):
            path = path[len(REPO) + 1 :]
        frames.append(f"{path}:{f.lineno}:{f.name}")
    return frames[-12:]


def _record(kind: str) -> None:
    calls.append({"kind": kind, "thread": threading.current_thread().name, "stack": _where()})


def on_pin_memory_thread(call: dict) -> bool:
    """Whether a recorded call was made on a DataLoader's pin-memory thread, which reads and copies
    host tensors only: none of its calls makes the host wait for the device."""
    return call["thread"].endswith(PIN_MEMORY_THREAD)


def _counting(kind: str, original):
    def wrapper(self, *args, **kwargs):
        _record(kind)
        return original(self, *args, **kwargs)

    return wrapper


def _counting_fn(kind: str, original):
    def wrapper(*args, **kwargs):
        _record(kind)
        return original(*args, **kwargs)

    return wrapper


def _copying(original):
    """`torch.tensor(data, device=...)`: host data copied to the device, which on a GPU waits for
    the kernels queued before it (a pageable host-to-device copy)."""

    def wrapper(*args, **kwargs):
        if kwargs.get("device") is not None:
            _record("host_to_device")
        return original(*args, **kwargs)

    return wrapper


def install() -> None:
    for name in TENSOR_READS:
        setattr(torch.Tensor, name, _counting(name, getattr(torch.Tensor, name)))
    torch.tensor = _copying(torch.tensor)
    torch.cuda.synchronize = _counting_fn("torch.cuda.synchronize", torch.cuda.synchronize)
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    accelerator.synchronize = _counting_fn("accelerator.synchronize", accelerator.synchronize)


def gpu_optimizer() -> None:
    """Build the optimizer `--optimizer auto` builds on a GPU: torch's fused AdamW, which runs on a
    CPU too. Its step counters live with the parameters (on the device on a GPU); the unfused AdamW
    a CPU run takes by default keeps them on the host and reads them every step."""
    from swbert.training import build

    original = build.build_optimizer

    def as_on_a_gpu(*args, **kwargs):
        return original(*args, **{**kwargs, "on_gpu": True})

    build.build_optimizer = as_on_a_gpu


def main() -> None:
    argv = sys.argv[1:]
    i = argv.index("--syncs-out")
    out = Path(argv[i + 1])
    del argv[i : i + 2]

    from swbert.training.cli import parse_args
    from swbert.training.trainer import Trainer, setup_logging

    setup_logging()
    gpu_optimizer()
    trainer = Trainer(parse_args(argv))
    step_of_calls = [0]  # the step the calls now being counted belong to (0: set-up)

    def close_step() -> None:
        closed = list(calls)
        del calls[: len(closed)]  # not clear(): a call another thread records meanwhile stays
        steps[step_of_calls[0]] = closed

    train_step, checkpoint_now = trainer.train_step, trainer.checkpoint_now

    def counted_step():
        close_step()
        step_of_calls[0] += 1
        return train_step()

    def counted_checkpoint_now(*args, **kwargs):
        close_step()  # the last step ends here: the closing checkpoint is not a step's
        step_of_calls[0] = -1
        return checkpoint_now(*args, **kwargs)

    trainer.train_step = counted_step
    trainer.checkpoint_now = counted_checkpoint_now
    setup = trainer.setup

    def counted_setup():
        run = setup()
        install()  # after set-up: only the steps are counted
        calls.clear()
        return run

    trainer.setup = counted_setup
    summary = trainer.train()
    assert summary["status"] == "FINISHED", summary
    out.mkdir(parents=True, exist_ok=True)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ["RANK"])
    record = {str(k): v for k, v in sorted(steps.items()) if k > 0}
    (out / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    sys.stdout.flush()
    os._exit(0)  # as launchers/pretrain.py: no teardown race of the communicators' threads


if __name__ == "__main__":
    main()
