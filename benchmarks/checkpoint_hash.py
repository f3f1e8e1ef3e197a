"""What checkpoint hashing costs: a save and a resume's start-up, with and without it.

Two ranks on gloo (the default recipe's layout: 2 ranks, ZeRO-2, fp32, torch AdamW) save the
recipe's model through `swbert.training.checkpoint.save` (DeepSpeed's save, fsync, every rank's
hashes of its own files, the marker) and load it back. Printed side by side, medians over --reps:

    save      a save without hashes (DeepSpeed's writes by path, `file_hash` stubbed out), and
              what a save with them takes longer: each rank hashing the bytes it writes as they go
    start-up  building the model and engine and DeepSpeed's load (the process group, data and
              tracking left out, so the share is an upper bound), and what `verify` adds: the
              ranks splitting the re-hashing of every file before anything loads

    python benchmarks/checkpoint_hash.py                 # the default recipe (mini, shared, vocab 8000)
    python benchmarks/checkpoint_hash.py --size base     # BERT-base, for scale
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from swbert.models import SWBertConfig, SWBertForMaskedLM
from swbert.runtime.optim import build_optimizer
from swbert.training import checkpoint as ckpt
from swbert.training.build import pretraining_ds_config
from swbert.training.config import TrainConfig


def _engine(size: str, vocab: int):
    import deepspeed

    cfg = TrainConfig(size=size, global_batch_size=32, micro_batch_size=16)
    torch.manual_seed(0)
    model = SWBertForMaskedLM(SWBertConfig.from_size(size, attention_type="shared", vocab_size=vocab))
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.01, kind="torch_adamw")
    ds_config = pretraining_ds_config(cfg, dist.get_world_size(), "fp32")
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config, dist_init_required=False
    )
    for group in engine.optimizer.optimizer.param_groups:  # Adam moments exist, as after a step
        for p in group["params"]:
            state = {
                "step": torch.tensor(1.0),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.ones_like(p),
            }
            engine.optimizer.optimizer.state[p] = state
    return engine


def _timed(fn, *args) -> float:
    dist.barrier()
    started = time.perf_counter()
    fn(*args)
    dist.barrier()
    return time.perf_counter() - started


def _no_hash(path: Path) -> str:
    return ""


def _save_unhashed(recorder, state_dict, path: Path) -> None:
    """In place of `_RecordedWrites._save_hashed`: DeepSpeed's own write by path, nothing hashed."""
    recorder.inner.save(state_dict, str(path))


def _once(args: argparse.Namespace, folder: Path, rep: int) -> dict[str, float]:
    """One save with hashing and one without (`file_hash` stubbed out), and one start-up, whole and
    its check of the hashes."""
    started = time.perf_counter()
    engine = _engine(args.size, args.vocab)
    build = time.perf_counter() - started
    times = {}
    for kind in ("hashed", "plain") if rep % 2 else ("plain", "hashed"):  # alternate which goes first
        real = ckpt.file_hash, ckpt._RecordedWrites._save_hashed
        if kind == "plain":  # DeepSpeed's own writes, nothing hashed
            ckpt.file_hash, ckpt._RecordedWrites._save_hashed = _no_hash, _save_unhashed
        try:
            times[kind] = _timed(ckpt.save, engine, folder / kind, 1, {"step": 1}, {"model": {}}, 1)
        finally:
            ckpt.file_hash, ckpt._RecordedWrites._save_hashed = real
    hashed, plain = times["hashed"], times["plain"]
    tag_dir = folder / "hashed" / ckpt.tag_for(1)
    out = {
        "save": plain,
        "hash": hashed - plain,
        "verify": _timed(ckpt.verify, tag_dir),
        "startup": build + _timed(ckpt.load, engine, tag_dir.parent, tag_dir.name),
        "mib": sum(p.stat().st_size for p in tag_dir.iterdir()) / 2**20,
    }
    dist.barrier()
    if dist.get_rank() == 0:  # the benchmark's own scratch copies: BERT-base's are GBs each
        shutil.rmtree(folder)
    return out


def _ranks(rank: int, world: int, port: int, args: argparse.Namespace, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")  # fmt: skip
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    runs = [_once(args, Path(root) / f"rep{rep}", rep) for rep in range(args.reps)]
    if rank == 0:
        medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        _report(args, medians)
    dist.destroy_process_group()


def _report(args: argparse.Namespace, t: dict[str, float]) -> None:
    print(f"{args.size} shared, vocab {args.vocab}, 2 ranks, ZeRO-2 fp32: checkpoint {t['mib']:,.0f} MiB")
    print(f"{'':10} {'without s':>10} {'hashing adds s':>15} {'share':>7}")
    for name, whole, part in (("save", "save", "hash"), ("start-up", "startup", "verify")):
        print(f"{name:10} {t[whole]:10.3f} {t[part]:15.3f} {t[part] / t[whole]:7.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="mini")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--reps", type=int, default=6)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as root:
        mp.start_processes(_ranks, args=(2, port, args, root), nprocs=2, join=True, start_method="fork")


if __name__ == "__main__":
    main()
