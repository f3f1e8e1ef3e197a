"""Masked micro-batches per second: one DataLoader worker, and on the training thread.

    python benchmarks/data_loader.py [--json FILE] [--root DIR] [--micro-batch-size 32] [--growth-mb 2] [--smoke]

Then loader start-up (seconds to the first micro-batch, main-process memory, the worker's own
memory) at corpora of 1x, 10x and 100x `--growth-mb`, synthesised on disk from the default corpus:
neither may grow faster than the document count.

Target: one worker builds at least 10,000 samples/s of sequence 128 on one core, more than an
H100 trains at 50% MFU (printed per attention variant from `masked_lm_flops` at BERT-base and
989 TFLOP/s dense bf16 peak). The corpus is the embedded default corpus (CPython's
documentation, 8000-piece BPE), built offline under --root on first use. `TrainingData.loader`
is timed as the trainer uses it: micro-batches of one rank, consecutive stream positions.

On a shared machine a worker waits for a CPU whenever other jobs hold them, so the wall-clock
rate understates what the pipeline does; the script also prints the rate per second of the
worker's own CPU time and the load average, so a loaded run can be told apart.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.data_prep import make_corpus  # noqa: E402
from data_prep.default_corpus import ensure_default_data  # noqa: E402
from data_prep.preprocess import preprocess  # noqa: E402
from data_prep.train_tokenizer import train_tokenizer  # noqa: E402
from swbert.models import SWBertConfig  # noqa: E402
from swbert.models.attention import attention_types  # noqa: E402
from swbert.models.flops import masked_lm_flops  # noqa: E402
from swbert.training.data import TrainingData  # noqa: E402

H100_PEAK_TFLOPS = 989.0  # dense bf16, SXM
MFU = 0.5


def smoke_data(root: Path) -> Path:
    """Shards of 25 `pydoc` topics (0.1 MB) with a 600-piece tokenizer, built in-process in seconds."""
    from pydoc_data.topics import topics

    if (root / "shards" / "manifest.json").is_file():
        return root / "shards"
    root.mkdir(parents=True, exist_ok=True)
    corpus = root / "topics.jsonl"
    corpus.write_text("".join(json.dumps({"text": topics[name]}) + "\n" for name in sorted(topics)[:25]))
    train_tokenizer([str(corpus)], root / "tok", vocab_size=600, threads=1)
    preprocess([str(corpus)], root / "tok", root / "shards", workers=1, progress=False)
    return root / "shards"


def h100_samples_per_s(seq_len: int, mlm_probability: float) -> dict[str, float]:
    """Sequences per second one H100 trains at `MFU` of its peak, per attention variant (BERT-base)."""
    rates = {}
    for variant in attention_types():
        config = SWBertConfig.from_size(
            "base", attention_type=variant, max_position_embeddings=max(512, seq_len)
        )
        per_token = masked_lm_flops(config, seq_len, mlm_probability).training
        rates[variant] = MFU * H100_PEAK_TFLOPS * 1e12 / (per_token * seq_len)
    return rates


def measure(data: TrainingData, micro_bs: int, workers: int, seconds: float, warmup: int) -> dict[str, float]:
    """Samples/s over `seconds` of `loader()` with `workers` processes (after `warmup` batches), with the
    CPU time the main process and the workers spent per batch."""
    loader = data.loader(0, micro_bs, 0, 1, workers)
    try:
        for _ in range(warmup):  # worker start-up, first permutation, page cache
            next(loader)
        children = psutil.Process().children()
        cpu_children = sum(p.cpu_times().user + p.cpu_times().system for p in children)
        cpu_main, start, batches = time.process_time(), time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            next(loader)
            batches += 1
        wall = time.perf_counter() - start
        cpu_main = time.process_time() - cpu_main
        cpu_children = sum(p.cpu_times().user + p.cpu_times().system for p in children) - cpu_children
    finally:
        loader.close()
    samples = batches * micro_bs
    builder_cpu = cpu_children if workers else cpu_main  # who builds the batches
    return {
        "samples_per_s": samples / wall,
        "samples_per_cpu_s": samples / builder_cpu if builder_cpu > 0 else float("nan"),
        "main_cpu_us_per_batch": 1e6 * cpu_main / batches,
        "builder_on_cpu": builder_cpu / wall / max(workers, 1),  # below 1: it waited for a CPU
    }


def start_up(data_dir: Path, seq_len: int, micro_bs: int) -> dict[str, float]:
    """Seconds from nothing to the first micro-batch from one DataLoader worker, the main process's
    RSS growth over that (memory of the index it builds, roughly: freed memory is reused) and the
    worker's USS (memory it alone holds: what each further worker adds)."""
    gc.collect()
    process = psutil.Process()
    rss, started = process.memory_info().rss, time.perf_counter()
    data = TrainingData(data_dir, seq_len, mlm_probability=0.15, seed=0)
    loader = data.loader(0, micro_bs, 0, 1, 1)
    try:
        next(loader)
        seconds = time.perf_counter() - started
        main_growth = process.memory_info().rss - rss
        worker_uss = sum(child.memory_full_info().uss for child in process.children(recursive=True))
    finally:
        loader.close()
    documents = sum(shard["train"]["documents"] for shard in data.manifest["shards"])
    return {"seconds": seconds, "main_rss_growth": main_growth, "worker_uss": worker_uss, "documents": documents,
            "sequences": len(data.train)}  # fmt: skip


def growth(data_dir: Path, seq_len: int, micro_bs: int, sizes: list[float]) -> list[dict[str, float]]:
    """Loader start-up at corpora 10x apart made of `data_dir`'s input documents, each preprocessed
    first with its tokenizer: start-up time and per-worker memory must not grow faster than the
    documents."""
    base = Path(json.loads((data_dir / "manifest.json").read_text())["inputs"][0]["path"])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for megabytes in sizes:
            corpus = make_corpus(base, Path(tmp) / f"corpus-{megabytes:g}.jsonl", megabytes)
            shards = Path(tmp) / f"shards-{megabytes:g}"
            preprocess([str(corpus)], data_dir / "tokenizer", shards, workers=1, progress=False)
            rows.append({"megabytes": megabytes, **start_up(shards, seq_len, micro_bs)})
    mib, first = 1 << 20, rows[0]
    print("loader start-up: corpus MB, documents, seconds to the first batch, main RSS growth, worker USS "
          "(x the smallest)")  # fmt: skip
    for row in rows:
        print(f"  {row['megabytes']:>8g} MB {row['documents']:>10,} docs ({row['documents'] / first['documents']:,.0f}x) "
              f"{row['seconds']:>7.2f} s ({row['seconds'] / first['seconds']:.1f}x) "
              f"{row['main_rss_growth'] / mib:>7,.1f} MiB {row['worker_uss'] / mib:>7,.1f} MiB "
              f"({row['worker_uss'] / max(first['worker_uss'], 1):.2f}x)")  # fmt: skip
    return rows


def report_rates(results: dict[str, list[dict[str, float]]], seq_len: int) -> tuple[dict, dict[str, float]]:
    """Print the median of each path's repetitions beside what an H100 consumes; return both."""
    median = {
        name: {key: statistics.median(rep[key] for rep in reps) for key in reps[0]}
        for name, reps in results.items()
    }
    h100 = h100_samples_per_s(seq_len, 0.15)
    for name, row in median.items():
        print(f"{name:>10}: {row['samples_per_s']:>9,.0f} samples/s ({row['samples_per_cpu_s']:,.0f} per second of "
              f"the builder's CPU time, which was on a CPU {row['builder_on_cpu']:.0%} of the time); main "
              f"process {row['main_cpu_us_per_batch']:,.0f} us CPU a micro-batch")  # fmt: skip
    print("H100 at 50% MFU, BERT-base: " + ", ".join(f"{k} {v:,.0f}" for k, v in h100.items()) + " samples/s")
    print(f"one worker / H100 standard: {median['one_worker']['samples_per_s'] / h100['standard']:.2f}x "
          f"(target: one worker >= 10,000 samples/s)")  # fmt: skip
    return median, h100


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results to this file")
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "swbert-default-data",
                        help="where the default corpus and tokenizer are built (kept between runs)")  # fmt: skip
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=32, help="sequences per micro-batch")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured time of each repetition")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each measurement (median kept)")
    parser.add_argument("--growth-mb", type=float, default=2.0, help="smallest corpus of the start-up runs")
    parser.add_argument("--smoke", action="store_true",
                        help="a second-long run on a 0.1 MB corpus built in-process, start-up at 0.01 / 0.1 / 1 MB, "
                        "to check that the script works (its figures mean little)")  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.smoke:
        args.seconds, args.reps, args.growth_mb = 0.2, 1, 0.01
        data_dir = smoke_data(args.root / "smoke")
    else:
        data_dir = ensure_default_data(args.root)
    data = TrainingData(data_dir, args.seq_len, mlm_probability=0.15, seed=0)
    print(f"# seq {args.seq_len}, micro-batch {args.micro_batch_size}, {len(data.train):,} training sequences; "
          f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")  # fmt: skip
    results: dict[str, list[dict[str, float]]] = {"in_thread": [], "one_worker": []}
    for _ in range(args.reps):  # interleaved, so both see the same load
        results["in_thread"].append(measure(data, args.micro_batch_size, 0, args.seconds, warmup=5))
        results["one_worker"].append(measure(data, args.micro_batch_size, 1, args.seconds, warmup=20))
    median, h100 = report_rates(results, args.seq_len)
    rows = growth(data_dir, args.seq_len, args.micro_batch_size, [args.growth_mb * 10**i for i in range(3)])
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    out = {
        "growth": rows,
        "samples_per_s_one_worker": median["one_worker"]["samples_per_s"],
        "samples_per_s_in_thread": median["in_thread"]["samples_per_s"],
        "h100_samples_per_s_at_50pct_mfu": h100,
        "samples_per_cpu_s_one_worker": median["one_worker"]["samples_per_cpu_s"],
        "samples_per_cpu_s_in_thread": median["in_thread"]["samples_per_cpu_s"],
        "main_cpu_us_per_batch_one_worker": median["one_worker"]["main_cpu_us_per_batch"],
        "reps": results,
        "setup": {
            "seq_len": args.seq_len,
            "micro_batch_size": args.micro_batch_size,
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg()[0],
        },
    }
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
