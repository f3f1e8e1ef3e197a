"""Preprocessing throughput with 1 and 2 workers, and tokens/s and peak memory at 3 corpus sizes.

    python benchmarks/data_prep.py [--small-mb 2] [--root DIR] [--smoke]

Targets: 2 workers give at least 1.8x the tokens/s of 1; at corpora of 1x, 10x and 100x
`--small-mb` (synthesised on disk), tokens/s holds and peak RSS stays flat (less than 1.5x over
the 100x): memory is bounded by the workers' batches, not by the corpus. The text is the embedded default corpus (CPython's documentation,
built under --root on first use), repeated with a per-copy prefix up to the wanted size, and
tokenized with its 8000-piece BPE tokenizer. On a shared machine, other load skews the
worker ratio: the script prints the load average next to the figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
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


def run_cli(corpus: Path, tokenizer: Path, out: Path, workers: int) -> dict[str, float]:
    """A real `python -m data_prep.preprocess` and its workers: peak of their summed RSS (and PSS),
    the tokens/s of its summary line (over the tokenizing phase), and the corpus's documents."""
    command = [sys.executable, "-m", "data_prep.preprocess", "--input", str(corpus), "--tokenizer",
               str(tokenizer), "--output", str(out), "--workers", str(workers), "--shard-size", SHARD,
               "--no-progress"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = out.with_suffix(".log")
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        main = psutil.Process(process.pid)
        rss_peak = pss_peak = polls = 0
        while process.poll() is None:
            try:
                procs = [main, *main.children(recursive=True)]
                rss_peak = max(rss_peak, sum(p.memory_info().rss for p in procs))
                if polls % 10 == 0:  # PSS reads every mapping (smaps): costly, so sampled less often
                    pss_peak = max(pss_peak, sum(p.memory_full_info().pss for p in procs))
            except psutil.Error:
                pass  # a worker exited between listing and reading
            polls += 1
            time.sleep(0.05)
    if process.returncode != 0:
        raise RuntimeError(
            f"preprocess failed with exit status {process.returncode}: {log.read_text()[-2000:]}"
        )
    rate = re.search(r"throughput: .* docs/s, ([\d,]+) tokens/s", log.read_text())
    splits = json.loads((out / "manifest.json").read_text())["splits"]
    return {
        "rss": rss_peak,
        "pss": pss_peak,
        "tokens_per_s": float(rate.group(1).replace(",", "")) if rate else float("nan"),
        "documents": sum(split["documents"] for split in splits.values()),
    }


def growth(
    base: Path, tokenizer: Path, tmp: Path, sizes: list[float], workers: int
) -> list[dict[str, float]]:
    """The CLI at each corpus size (10x apart): tokens/s must hold and peak memory stay flat."""
    rows = []
    for megabytes in sizes:
        corpus = make_corpus(base, tmp / f"corpus-{megabytes:g}.jsonl", megabytes)
        rows.append({"megabytes": megabytes, **run_cli(corpus, tokenizer, tmp / f"m-{megabytes:g}", workers)})
    mib, first = 1 << 20, rows[0]
    print(
        f"growth, {workers} workers: corpus MB, documents, tokens/s, peak RSS MiB, peak PSS MiB (x the smallest)"
    )
    for row in rows:
        print(f"  {row['megabytes']:>8g} MB {row['documents']:>10,} docs {row['tokens_per_s']:>12,.0f} tokens/s "
              f"{row['rss'] / mib:>7,.0f} MiB ({row['rss'] / first['rss']:.2f}x) "
              f"{row['pss'] / mib:>7,.0f} MiB ({row['pss'] / first['pss']:.2f}x)")  # fmt: skip
    return rows


def worker_scaling(corpus: Path, tokenizer: Path, tmp: Path, megabytes: float) -> dict[str, float]:
    """1 against 2 workers on one corpus, with the CPU time that tells other load apart."""
    one, cpu_one, wall_one = throughput(corpus, tokenizer, tmp / "w1", 1)
    two, cpu_two, wall_two = throughput(corpus, tokenizer, tmp / "w2", 2)
    print(f"throughput on {megabytes:g} MB: 1 worker {one:,.0f} tokens/s, 2 workers {two:,.0f} tokens/s, "
          f"ratio {two / one:.2f}x (target >= 1.8x)")  # fmt: skip
    # Independent of other load: the total work must not grow with the number of workers.
    print(
        f"worker CPU time: {cpu_one:.1f} s with 1 worker, {cpu_two:.1f} s with 2 ({cpu_two / cpu_one:.2f}x)"
    )
    # Below 100%, the workers waited for a CPU: other load, not the pipeline, set the ratio.
    print(f"workers on a CPU: {cpu_one / wall_one:.0%} of the time with 1, "
          f"{cpu_two / (2 * wall_two):.0%} with 2")  # fmt: skip
    return {"tokens_per_s_1": one, "tokens_per_s_2": two, "worker_ratio": two / one}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small-mb", type=float, default=2.0,
                        help="size of the smallest corpus (the others are 10x and 100x)")  # fmt: skip
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "swbert-default-data",
                        help="where the default corpus and tokenizer are built (kept between runs)")  # fmt: skip
    parser.add_argument("--smoke", action="store_true",
                        help="seconds-long run on a 150 kB default corpus and 0.01 / 0.1 / 1 MB inputs, to "
                        "check that the script works (its figures mean little)")  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.smoke:
        args.small_mb = 0.01
        data_dir = ensure_default_data(args.root, vocab_size=600, max_corpus_bytes=150_000)
    else:
        data_dir = ensure_default_data(args.root)
    tokenizer = data_dir / "tokenizer"
    base = Path(json.loads((data_dir / "manifest.json").read_text())["inputs"][0]["path"])
    sizes = [args.small_mb * 10**i for i in range(3)]
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        small = make_corpus(base, tmp / "small.jsonl", args.small_mb)
        out: dict = worker_scaling(small, tokenizer, tmp, args.small_mb)
        rows = growth(base, tokenizer, tmp, sizes, workers=2)
    print(f"peak RSS {rows[-1]['rss'] / rows[0]['rss']:.2f}x for {sizes[-1] / sizes[0]:g}x the corpus "
          "(target: flat, < 1.5x)")  # fmt: skip
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return {**out, "growth": rows, "rss_ratio": rows[-1]["rss"] / rows[0]["rss"]}


if __name__ == "__main__":
    main()
