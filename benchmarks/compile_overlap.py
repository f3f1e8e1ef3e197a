"""When does ZeRO's first gradient reduce start within the backward: eager, compiled per block, or
compiled as one graph?

A ZeRO-2 DeepSpeed engine (one process, gloo) runs the real swbert model; the optimizer's
gradient-ready handler (`reduce_ready_partitions_and_remove_grads`, what each parameter's gradient
hook calls to start its bucket's reduce) is timed. The figure is when it first fires, as a
fraction of the backward's wall time: near 0 means block i's gradients are reduced while the
blocks before it still run backward (overlap); 1.0 means every reduce waits for the whole
backward. Each mode runs in its own process (a fresh compiler cache), side by side in one run.

    python benchmarks/compile_overlap.py                  # eager, per-block, whole model
    python benchmarks/compile_overlap.py --modes per_block --layers 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("eager", "per_block", "whole_model")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measure(
    mode: str, layers: int, hidden: int, seq: int, batch: int, reps: int, backend: str, port: int
) -> dict[str, Any]:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist

    from swbert.models import SWBertConfig, SWBertForMaskedLM
    from swbert.training.wrappers import wrap_model

    dist.init_process_group("gloo")
    config = SWBertConfig.from_size(
        "tiny",
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=hidden // 64,
        intermediate_size=4 * hidden,
        vocab_size=1024,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = wrap_model(
        SWBertForMaskedLM(config),
        compile=mode == "per_block",
        compile_backend=backend,
        zero_stage=2,
        log_steps=False,
    )
    ds = {
        "train_micro_batch_size_per_gpu": batch,
        "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 10**9},
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds, dist_init_required=False)
    if mode == "whole_model":
        engine.compile(backend=backend)  # DeepSpeed's own: the whole module as one graph

    fired: list[float] = []
    handler = engine.optimizer.reduce_ready_partitions_and_remove_grads

    def timed(*args: Any, **kwargs: Any) -> Any:
        fired.append(time.perf_counter())
        return handler(*args, **kwargs)

    engine.optimizer.reduce_ready_partitions_and_remove_grads = timed  # what every gradient hook calls
    g = torch.Generator().manual_seed(0)
    fractions = []
    for rep in range(reps + 1):  # the first rep compiles: not counted
        ids = torch.randint(5, 1024, (batch, seq), generator=g)
        positions = torch.randint(1, seq - 1, (batch, max(1, seq // 8)), generator=g)
        targets = torch.randint(5, 1024, positions.shape, generator=g)
        loss = engine(input_ids=ids, mlm_positions=positions, mlm_targets=targets).loss
        fired.clear()
        start = time.perf_counter()
        engine.backward(loss)
        end = time.perf_counter()
        engine.step()
        if rep:
            fractions.append((min(fired) - start) / (end - start))
    dist.destroy_process_group()
    return {"first_reduce_fraction": statistics.median(fractions), "per_rep": fractions}


def _child(queue: Any, *args: Any) -> None:
    queue.put(_measure(*args))


def measure(
    mode: str,
    layers: int = 4,
    hidden: int = 256,
    seq: int = 128,
    batch: int = 8,
    reps: int = 3,
    backend: str = "inductor",
) -> dict:
    """The first gradient reduce's position within the backward for `mode`, in a fresh process.
    `backend`: torch.compile's; the graphs, one per unit or one for the model, and so when each
    gradient is ready, are the same for every backend that splits the backward as AOTAutograd
    does (inductor, aot_eager), whatever code it generates for them."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: choose from {', '.join(MODES)}")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    args = (queue, mode, layers, hidden, seq, batch, reps, backend, _port())
    proc = ctx.Process(target=_child, args=args)
    proc.start()
    result = queue.get(timeout=1800)
    proc.join()
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend (default inductor)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)
    out = {}
    for mode in args.modes.split(","):
        out[mode] = measure(mode, args.layers, args.hidden, args.seq, args.batch, args.reps, args.backend)
        print(
            f"{mode:12s} first gradient reduce at {out[mode]['first_reduce_fraction']:6.1%} of the backward"
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
