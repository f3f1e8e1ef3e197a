"""Host work of a training step: the real trainer's step against a plain torch step, side by side.

    python benchmarks/host_overhead.py --json host.json                  # shared and standard
    python benchmarks/host_overhead.py --variants shared --backend aot_eager --steps 2   # quick

On a GPU a BERT-base micro-batch is tens of milliseconds of device work; what the host does per
step (Python, per-tensor loops, small ops, syncs) must fit beside it or the GPU waits. This
measures that host work on a CPU, where it costs the same: BERT-base's structure (12 blocks, every
parameter tensor of the variant) at hidden size 64, so the arithmetic is negligible and what
remains is launching ops. For each variant, one process each:

    trainer     the real `Trainer` step (DeepSpeed engine from the recipes' ds_configs/zero2.json,
                bf16, the optimizer `--optimizer auto` picks on a GPU, compiled per unit as on a GPU)
    reference   the same model compiled the same way, torch's fused AdamW, no DeepSpeed, one process

and for each: leaf aten ops per micro-batch (forward and backward) and per optimizer step (the
whole step), host CPU ms per micro-batch and per step (the profiler's CPU time of those ranges),
and host-blocking calls per step on every thread (`tests/scripts/count_syncs.py`; the loader's
pin-memory thread left out). `--json FILE` writes
`{VARIANT: {"trainer": {...}, "reference": {...}}}` with the keys ops_per_step,
ops_per_microbatch, host_ms_per_microbatch, host_ms_per_step, syncs_per_step. Figures are medians
over the measured steps, after `--warmup` steps (compile and DeepSpeed's first step).

Both sides run bf16, as on a GPU; this CPU's bf16 kernels are slow at any width (a bf16 step of the
bare model costs several times an fp32 one), so the op counts and syncs are the figures to compare
here, and host ms are the CPU's, not a GPU host's.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEYS = ("ops_per_step", "ops_per_microbatch", "host_ms_per_microbatch", "host_ms_per_step", "syncs_per_step")
SIZE = "12x64"  # BERT-base's 12 blocks and parameter tensors, at a width where arithmetic is negligible


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="shared,standard", help="comma-separated attention variants")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--size", default=SIZE, help="model size (default: BERT-base's structure at width 64)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    p.add_argument("--steps", type=int, default=3, help="measured steps")
    p.add_argument(
        "--backend", default="inductor", help="torch.compile's backend (aot_eager: no C++ compile)"
    )
    p.add_argument("--data-dir", type=Path, default=None, help="shards (default: a small generated corpus)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------
# Counting one process's steps


def leaf_aten_ops(events, within: str) -> list[int]:
    """Leaf aten ops (no aten op below them) inside each profiler range named `within`, per range."""
    counts = []
    for event in events:
        if event.name != within:
            continue
        counts.append(sum(1 for e in _descendants(event) if e.name.startswith("aten::") and not _has_aten(e)))
    return counts


def _descendants(event):
    for child in event.cpu_children:
        yield child
        yield from _descendants(child)


def _has_aten(event) -> bool:
    return any(c.name.startswith("aten::") for c in event.cpu_children)


def range_ms(events, name: str) -> list[float]:
    return [e.time_range.elapsed_us() / 1e3 for e in events if e.name == name]


def figures(prof, syncs: list[int]) -> dict[str, float]:
    """The five figures of the measured steps: a micro-batch is a "forward" range and the "backward"
    range after it, a step the "step" range around both and the optimizer."""
    events = prof.events()
    ops = map(sum, zip(leaf_aten_ops(events, "forward"), leaf_aten_ops(events, "backward")))
    ms = map(sum, zip(range_ms(events, "forward"), range_ms(events, "backward")))
    return {
        "ops_per_step": statistics.median(leaf_aten_ops(events, "step")),
        "ops_per_microbatch": statistics.median(ops),
        "host_ms_per_microbatch": round(statistics.median(ms), 3),
        "host_ms_per_step": round(statistics.median(range_ms(events, "step")), 3),
        "syncs_per_step": statistics.median(syncs),
    }


def ranged(call, name: str):
    """`call` inside a profiler range `name`."""

    def wrapper(*args, **kwargs):
        import torch

        with torch.profiler.record_function(name):
            return call(*args, **kwargs)

    return wrapper


class Syncs:
    """Host-blocking calls per step, on every thread, through tests/scripts/count_syncs.py."""

    def __init__(self) -> None:
        self.counter = runpy.run_path(
            str(REPO / "tests" / "scripts" / "count_syncs.py"), run_name="count_syncs"
        )
        self.counter["install"]()
        self.per_step: list[int] = []

    def start(self) -> None:
        self.counter["calls"].clear()

    def stop(self) -> None:
        pinning = self.counter["on_pin_memory_thread"]
        self.per_step.append(sum(not pinning(c) for c in self.counter["calls"]))


@contextmanager
def measured(name: str, syncs: Syncs | None = None):
    import torch

    if syncs:
        syncs.start()
    with torch.profiler.record_function(name):
        yield
    if syncs:
        syncs.stop()


# ---------------------------------------------------------------------------------------------------
# The trainer and the reference


def trainer_args(args: argparse.Namespace, variant: str, out: Path) -> list[str]:
    global_batch = args.micro_batch * args.accum
    return [
        "--size", args.size, "--attention-type", variant, "--data-dir", str(args.data_dir), "--output-dir", str(out),
        "--seq-len", str(args.seq_len), "--micro-batch-size", str(args.micro_batch),
        "--global-batch-size", str(global_batch), "--train-steps", str(args.warmup + args.steps),
        "--precision", "bf16", "--compile", "on", "--compile-backend", args.backend,
        "--deepspeed-config", "ds_configs/zero2.json", "--mlflow", "false", "--export", "false",
        "--progress-bar", "false", "--system-metrics", "false", "--eval-batches", "0",
        "--log-interval", "100000", "--save-interval", "100000", "--num-workers", "1",
    ]  # fmt: skip


def run_trainer(args: argparse.Namespace, variant: str) -> tuple[dict, tuple]:
    """The trainer's measured steps; returns its figures, and the model's config and the last step's
    batches for the reference."""
    from torch.profiler import ProfilerActivity, profile

    from swbert.logs import setup_logging
    from swbert.training.cli import parse_args as parse_train
    from swbert.training.trainer import Trainer

    out = Path(tempfile.mkdtemp(prefix="host-overhead-"))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))  # fmt: skip
    setup_logging()
    config = parse_train(trainer_args(args, variant, out))
    trainer = Trainer(config)
    setup = trainer.setup

    def ranged_setup():
        gpu_optimizer()
        run = setup()
        run.engine.backward = ranged(run.engine.backward, "backward")
        return run

    trainer.setup = ranged_setup
    prof, syncs, step, batches = profile(activities=[ProfilerActivity.CPU]), None, [0], []
    train_step, next_batch = trainer.train_step, trainer._next_batch

    def keep_batch():
        batch = next_batch()
        batches.append({k: v.clone() for k, v in batch.items()})
        return batch

    def counted():
        nonlocal syncs
        step[0] += 1
        if step[0] == args.warmup + 1:
            syncs = Syncs()
            prof.start()
        if step[0] <= args.warmup:
            return train_step()
        with measured("step", syncs):
            return train_step()

    trainer._next_batch, trainer.train_step = keep_batch, counted
    trainer.forward_and_count = ranged(trainer.forward_and_count, "forward")
    summary = trainer.train()
    prof.stop()
    assert summary["status"] == "FINISHED", summary
    model_config = trainer.run.model_config
    return figures(prof, syncs.per_step), (model_config, batches[-args.accum :])


def gpu_optimizer() -> None:
    """The optimizer `--optimizer auto` builds on a GPU (torch's fused AdamW, counters on the device)."""
    from swbert.training import build

    original = build.build_optimizer
    build.build_optimizer = lambda *a, **kw: original(*a, **{**kw, "on_gpu": True})


def run_reference(args: argparse.Namespace, model_config, batches: list[dict]) -> dict:
    """The same model and batches, compiled per unit the same way, torch's fused AdamW, no DeepSpeed."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from swbert.models import SWBertForMaskedLM
    from swbert.runtime.optim import param_groups
    from swbert.training.wrappers import wrap_model

    torch.manual_seed(0)
    model = SWBertForMaskedLM(model_config).to(torch.bfloat16).train()
    model = wrap_model(model, compile=True, compile_backend=args.backend, log_steps=False)
    optimizer = torch.optim.AdamW(param_groups(model, 0.01), lr=1e-4, fused=True)
    syncs = None
    prof = profile(activities=[ProfilerActivity.CPU])

    def step() -> None:
        for batch in batches:
            inputs = {k: v for k, v in batch.items() if k != "mlm_labels"}
            with torch.profiler.record_function("forward"):
                loss = model(**inputs, mlm_targets=batch["mlm_labels"]).loss
            with torch.profiler.record_function("backward"):
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            syncs = Syncs()
            prof.start()
        if i < args.warmup:
            step()
            continue
        with measured("step", syncs):
            step()
    prof.stop()
    return figures(prof, syncs.per_step)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------


def child(args: argparse.Namespace) -> None:
    """One variant in this process: the trainer, then the reference on the trainer's last batches;
    one JSON line on stdout."""
    trainer, (model_config, batches) = run_trainer(args, args.child)
    reference = run_reference(args, model_config, batches)
    print("RESULT " + json.dumps({"trainer": trainer, "reference": reference}), flush=True)
    os._exit(0)  # no teardown race with the communicators' threads (as launchers/pretrain.py)


def default_data(root: Path) -> Path:
    sys.path.insert(0, str(REPO))
    from tests.launch_utils import make_data_dir

    if not (root / "data" / "manifest.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        make_data_dir(root)
    return root / "data"


def report(results: dict) -> None:
    print(f"{'variant':<10} {'':<10} " + " ".join(f"{k:>22}" for k in KEYS))
    for variant, pair in results.items():
        for side in ("trainer", "reference"):
            print(f"{variant:<10} {side:<10} " + " ".join(f"{pair[side][k]:>22}" for k in KEYS))
        ratios = {k: pair["trainer"][k] / pair["reference"][k] if pair["reference"][k] else float("inf")
                  for k in KEYS}  # fmt: skip
        print(f"{variant:<10} {'ratio':<10} " + " ".join(f"{ratios[k]:>21.2f}x" for k in KEYS))


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.child:
        child(args)
    if args.data_dir is None:
        args.data_dir = default_data(Path(tempfile.gettempdir()) / "swbert-host-overhead-data")
    results = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for variant in args.variants.split(","):
        cmd = [sys.executable, __file__, "--child", variant, "--data-dir", str(args.data_dir)]
        cmd += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                ("size", "micro_batch", "accum", "seq_len", "warmup", "steps", "backend")]  # fmt: skip
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(
                f"host_overhead: the {variant} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
            )
        results[variant] = json.loads(line[len("RESULT ") :])
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
