"""Preprocessing throughput with 1 and 2 workers, and peak memory on two corpora 10x apart.

    python benchmarks/data_prep.py [--small-mb 4] [--root DIR] [--smoke]

Targets: 2 workers give at least 1.8x the tokens/s of 1; peak RSS grows less than 1.5x when
the corpus grows 10x. The text is the embedded default corpus (CPython's documentation,
built under --root on first use), repeated with a per-copy prefix up to the wanted size, and
tokenized with its 8000-piece BPE tokenizer. On a shared machine, other load skews the
worker ratio: the script prints the load average next to the figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_prep.default_corpus import ensure_default_data  # noqa: E402
from data_prep.preprocess import preprocess  # noqa: E402

SHARD = "512K"


def make_corpus(base: Path, path: Path, megabytes: float) -> Path:
    """Copies of the base corpus's documents, each copy prefixed so no two documents repeat."""
    lines = [json.loads(line)["text"] for line in base.read_text().splitlines()]
    target, size, copy = int(megabytes * (1 << 20)), 0, 0
    with open(path, "w", encoding="utf-8") as stream:
        while size < target:
            for text in lines:
                line = json.dumps({"text": f"Copy {copy}. {text}"}) + "\n"
                stream.write(line)
                size += len(line)
                if size >= target:
                    break
            copy += 1
    return path


def throughput(corpus: Path, tokenizer: Path, out: Path, workers: int) -> tuple[float, float, float]:
    """Tokens/s over the tokenizing phase, the workers' CPU seconds, and the phase's wall seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = preprocess([str(corpus)], tokenizer, out, workers=workers, shard_bytes=512 << 10, progress=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the pool's workers, reaped at its shutdown
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return result.tokens_per_second, cpu, result.work_seconds


def peak_rss(corpus: Path, tokenizer: Path, out: Path, workers: int) -> tuple[int, int]:
    """Peak of the summed RSS of a real `python -m data_prep.preprocess` and its workers (and of PSS)."""
    command = [sys.executable, "-m", "data_prep.preprocess", "--input", str(corpus), "--tokenizer",
               str(tokenizer), "--output", str(out), "--workers", str(workers), "--shard-size", SHARD,
               "--no-progress"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    main = psutil.Process(process.pid)
    rss_peak = pss_peak = 0
    while process.poll() is None:
        try:
            procs = [main, *main.children(recursive=True)]
            rss_peak = max(rss_peak, sum(p.memory_info().rss for p in procs))
            pss_peak = max(pss_peak, sum(p.memory_full_info().pss for p in procs))
        except psutil.Error:
            pass  # a worker exited between listing and reading
        time.sleep(0.05)
    if process.returncode != 0:
        raise RuntimeError(f"preprocess failed with exit status {process.returncode}")
    return rss_peak, pss_peak


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--small-mb", type=float, default=4.0, help="size of the small corpus (the large is 10x)"
    )
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "swbert-default-data",
                        help="where the default corpus and tokenizer are built (kept between runs)")  # fmt: skip
    parser.add_argument("--smoke", action="store_true",
                        help="seconds-long run on a 150 kB default corpus and 0.05 MB / 0.5 MB inputs, to "
                        "check that the script works (its figures mean little)")  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.smoke:
        args.small_mb = 0.05
        data_dir = ensure_default_data(args.root, vocab_size=600, max_corpus_bytes=150_000)
    else:
        data_dir = ensure_default_data(args.root)
    tokenizer = data_dir / "tokenizer"
    base = Path(json.loads((data_dir / "manifest.json").read_text())["inputs"][0]["path"])
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        small = make_corpus(base, tmp / "small.jsonl", args.small_mb)
        large = make_corpus(base, tmp / "large.jsonl", 10 * args.small_mb)
        one, cpu_one, wall_one = throughput(small, tokenizer, tmp / "w1", 1)
        two, cpu_two, wall_two = throughput(small, tokenizer, tmp / "w2", 2)
        print(f"throughput on {args.small_mb:g} MB: 1 worker {one:,.0f} tokens/s, 2 workers {two:,.0f} tokens/s, "
              f"ratio {two / one:.2f}x (target >= 1.8x)")  # fmt: skip
        # Independent of other load: the total work must not grow with the number of workers.
        print(
            f"worker CPU time: {cpu_one:.1f} s with 1 worker, {cpu_two:.1f} s with 2 ({cpu_two / cpu_one:.2f}x)"
        )
        # Below 100%, the workers waited for a CPU: other load, not the pipeline, set the ratio.
        print(f"workers on a CPU: {cpu_one / wall_one:.0%} of the time with 1, "
              f"{cpu_two / (2 * wall_two):.0%} with 2")  # fmt: skip
        rss_small, pss_small = peak_rss(small, tokenizer, tmp / "m_small", 2)
        rss_large, pss_large = peak_rss(large, tokenizer, tmp / "m_large", 2)
        mib = 1 << 20
        print(f"peak RSS, 2 workers: {rss_small / mib:,.0f} MiB on {args.small_mb:g} MB, {rss_large / mib:,.0f} MiB "
              f"on {10 * args.small_mb:g} MB, ratio {rss_large / rss_small:.2f}x (target < 1.5x)")  # fmt: skip
        print(f"peak PSS (shared pages counted once): {pss_small / mib:,.0f} MiB and {pss_large / mib:,.0f} MiB, "
              f"ratio {pss_large / pss_small:.2f}x")  # fmt: skip
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return {
        "tokens_per_s_1": one,
        "tokens_per_s_2": two,
        "worker_ratio": two / one,
        "rss_small": rss_small,
        "rss_large": rss_large,
        "rss_ratio": rss_large / rss_small,
    }


if __name__ == "__main__":
    main()
