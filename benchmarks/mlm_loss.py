"""The masked-LM decoder and loss, plain against chunked (ours), side by side: memory and time.

    python benchmarks/mlm_loss.py                        # BERT-base: N = 32 x 20 rows, V = 30522, d = 768
    python benchmarks/mlm_loss.py --rows 5120 --json mlm_loss.json   # a 32k-token micro-batch's predictions
    python benchmarks/mlm_loss.py --smoke                # tiny, seconds (run by the tests)

Both sides take the head's transformed rows x (N, d), the decoder weight (V, d) and bias, and
targets (one in ten IGNORE_INDEX, a static batch's padding), and run forward + backward:

    plain     `F.cross_entropy(F.linear(x, W, b).float(), ...)`: the (N, V) logits, their fp32 copy
              and the softmax saved for the backward (what the model computes when it returns logits)
    chunked   `swbert.models.mlm_loss.logit_stats`: vocabulary chunks of at most 64 MiB of fp32
              logits, recomputed in the backward (the trainer's path, `return_logits=False`)

and for each: the bytes autograd saves for the backward (`saved_tensors_hooks`; the weights, which
exist anyway, left out), the peak memory of forward + backward above what was allocated before
(`torch.cuda.max_memory_allocated` on a GPU; on a CPU the profiler's allocations and frees in time
order, each op's own allocations counted at its start), and the median time of `--reps` runs
after one warm-up. It prints the ratios plain / chunked; `--json FILE` writes everything.
On a GPU the inputs are bf16 (the training dtype), on a CPU fp32 (unless `--dtype`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from swbert.models.mlm_loss import MLM_CHUNK_BYTES, logit_stats, vocab_chunks
from swbert.models.modeling import IGNORE_INDEX, labelled_mean, mlm_loss_from_stats

SIDES = ("plain", "chunked")
KEYS = ("saved_bytes", "peak_bytes", "transient_bytes", "ms")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=32 * 20, help="predicted rows N (sequences x predictions)")
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--reps", type=int, default=5, help="timed runs per side (after one warm-up)")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default=None, help="default: bf16 on GPU, fp32 on CPU"
    )
    p.add_argument(
        "--chunk-bytes", type=int, default=MLM_CHUNK_BYTES, help="fp32 logits of one chunk at most"
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="small shapes, 1 run: checks that it runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.rows, args.vocab, args.hidden, args.reps = 64, 1000, 32, 1
        args.chunk_bytes = 4 * args.rows * 300  # 4 chunks, as BERT-base at 32k tokens a micro-batch has
    return args


def _inputs(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, args.hidden, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).to(device, dtype).requires_grad_()
    bias = torch.zeros(args.vocab).to(device, dtype).requires_grad_()
    target = torch.randint(0, args.vocab, (args.rows,), generator=g)
    target[::10] = IGNORE_INDEX
    return x, weight, bias, target.to(device)


def _plain(x, weight, bias, target, _chunk_bytes):
    return labelled_mean(F.cross_entropy(F.linear(x, weight, bias).float(), target, reduction="none"), target)


def _chunked(x, weight, bias, target, chunk_bytes):
    lse, picked, _, _ = logit_stats(x, weight, bias, target, weight.shape[0], chunk_bytes)
    return mlm_loss_from_stats(lse, picked, target)


def _saved_bytes(loss_fn: Callable, inputs: tuple, chunk_bytes: int) -> int:
    total, weights = 0, {inputs[1].data_ptr(), inputs[2].data_ptr()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if t.data_ptr() not in weights:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(*inputs, chunk_bytes)
    loss.backward()
    return total


class _LiveBytes(TorchDispatchMode):
    """The bytes of the tensor storages that the ops run under it allocate, now and at the peak: a
    CPU's view of `torch.cuda`'s allocated-memory counters (storages from before are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, int] = {}  # storage -> tensors alive on it
        self.size: dict[int, int] = {}
        self.now = self.peak = 0

    def _drop(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.now -= self.size.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        allocates = not (func.is_view or func._schema.is_mutable)  # views and in-place ops do not
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage().data_ptr()
            if key not in self.refs:
                if not allocates:
                    continue
                self.refs[key], self.size[key] = 0, t.untyped_storage().nbytes()
                self.now += self.size[key]
                self.peak = max(self.peak, self.now)
            self.refs[key] += 1
            weakref.finalize(t, self._drop, key)
        return out


def _peak_bytes(run: Callable[[], None], device: torch.device, fresh: Callable) -> tuple[int, int]:
    """Peak memory of `run()` above what was allocated when it started, and what was left at its
    end (the gradients): their difference is the transient."""
    fresh()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, torch.cuda.memory_allocated() - before
    with _LiveBytes() as live:
        run()
    return live.peak, live.now


def _seconds(run: Callable[[], None], device: torch.device, reps: int, fresh: Callable) -> float:
    times = []
    for _ in range(reps):
        fresh()
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    inputs = _inputs(args, device, dtype)
    out: dict = {}
    for name, loss_fn in (("plain", _plain), ("chunked", _chunked)):

        def run(loss_fn=loss_fn) -> None:
            loss_fn(*inputs, args.chunk_bytes).backward()

        def fresh() -> tuple:  # no gradient left from before: its free would count in the peak
            for t in inputs[:3]:
                t.grad = None
            return inputs

        run()  # warm-up
        loss = loss_fn(*inputs, args.chunk_bytes).detach().double().item()
        peak, kept = _peak_bytes(run, device, fresh)
        out[name] = {
            "loss": loss,
            "saved_bytes": _saved_bytes(loss_fn, fresh(), args.chunk_bytes),
            "peak_bytes": peak,
            "transient_bytes": peak - kept,
            "ms": 1e3 * _seconds(run, device, args.reps, fresh),
        }
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    sides = measure(args, device, dtype)
    plain, chunked = sides["plain"], sides["chunked"]
    out = {
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "rows": args.rows,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "chunks": len(vocab_chunks(args.rows, args.vocab, args.chunk_bytes)),
        **sides,
        "ratios": {key: plain[key] / max(chunked[key], 1e-9) for key in KEYS},
    }
    mib = 2**20
    print(f"masked-LM loss, N {args.rows} x V {args.vocab} x d {args.hidden}, {out['dtype']} on {device.type}, "
          f"{out['chunks']} chunks; loss plain {plain['loss']:.6f} chunked {chunked['loss']:.6f}")  # fmt: skip
    print(f"{'':14}{'saved MiB':>12}{'peak MiB':>12}{'transient MiB':>15}{'ms':>10}")
    for name in SIDES:
        row = sides[name]
        mibs = "".join(f"{row[k] / mib:{w}.1f}" for k, w in zip(KEYS[:3], (12, 12, 15), strict=True))
        print(f"{name:14}{mibs}{row['ms']:10.2f}")
    r = out["ratios"]
    ratios = "".join(f"{r[k]:{w}.2f}x" for k, w in zip(KEYS, (11, 11, 14, 9), strict=True))
    print(f"{'plain/chunked':14}{ratios}")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
