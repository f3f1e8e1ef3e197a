"""Fine-tuning steps on GLUE-like lengths: padded, length-grouped and unpadded batches side by side.

One process fine-tunes three copies of the same small classifier on the same examples, one per way
of batching them (swbert.finetune.batching), and times forward + backward + optimizer step of each,
interleaved step by step (a slow spell of a shared machine hits every mode alike):

    padded    random batches, each padded to its longest sequence (what fine-tuning did before)
    grouped   batches of similar lengths, padded to their longest (`LengthGroupedBatchSampler`)
    unpadded  the random batches as one token stream (`unpad_collate`): no padding computed

It prints per distribution the padding fraction (padding / tokens computed), the tokens computed,
and real tokens per second; `--json FILE` writes them too. Nothing is downloaded: example lengths
(in tokens, with [CLS] and [SEP]) are drawn from log-normal distributions of our choosing that
resemble BERT-tokenised GLUE training sets, where the paper's fine-tuning time goes:

    sst2   single sentences: median 10 tokens, sigma 0.7 (mean ~13), clipped to [3, 66], like SST-2's
           short phrases and its ~66-token longest sentence
    mnli   sentence pairs: median 36 tokens, sigma 0.45 (mean ~40), clipped to [8, 128] (the
           --max-seq-length GLUE runs use), like MNLI premise + hypothesis

    python benchmarks/finetune_step.py                      # both distributions, "mini" model, CPU
    python benchmarks/finetune_step.py --size small --examples 1024 --json finetune.json
    python benchmarks/finetune_step.py --smoke              # tiny, seconds (run by the tests)

It runs on the CPU, where the unpadded mode uses the per-sequence reference kernel (swbert.models.varlen);
a GPU's variable-length kernel is not measured here.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from swbert.finetune.batching import LengthGroupedBatchSampler, unpad_collate
from swbert.finetune.glue_data import EncodedDataset, pad_collate
from swbert.models import SWBertConfig, SWBertForSequenceClassification
from swbert.models.varlen import varlen_kernel
from swbert.runtime.optim import build_optimizer

MODES: tuple[str, ...] = ("padded", "grouped", "unpadded")
# name -> (median tokens, log-normal sigma, shortest, longest): see the module docstring
DISTRIBUTIONS: dict[str, tuple[float, float, int, int]] = {
    "sst2": (10.0, 0.7, 3, 66),
    "mnli": (36.0, 0.45, 8, 128),
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--distributions", default=",".join(DISTRIBUTIONS), help="comma-separated: sst2,mnli")
    p.add_argument("--size", default="mini", help="model size (swbert.models.config.SIZES)")
    p.add_argument("--attention", default="shared", help="attention variant")
    p.add_argument("--examples", type=int, default=512, help="examples per distribution (one pass)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny model and few examples (seconds)")
    args = p.parse_args(argv)
    args.distributions = args.distributions.split(",")
    unknown = sorted(set(args.distributions) - set(DISTRIBUTIONS))
    if unknown:
        p.error(f"--distributions: unknown {unknown}; choose from {', '.join(DISTRIBUTIONS)}")
    if args.smoke:
        args.size, args.examples, args.batch, args.warmup = "tiny", 48, 8, 1
    return args


def draw_lengths(name: str, n: int, seed: int) -> np.ndarray:
    median, sigma, lo, hi = DISTRIBUTIONS[name]
    rng = np.random.default_rng([seed, len(name)])
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), lo, hi).astype(int)


def examples(lengths: np.ndarray, vocab: int, seed: int) -> EncodedDataset:
    """Random token ids of the given lengths, [CLS] first, two segments, two classes."""
    rng = np.random.default_rng(seed)
    ids = [[2, *rng.integers(5, vocab, n - 1).tolist()] for n in lengths]
    types = [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths]
    masks = [[1] * n for n in lengths]
    labels = {"labels": rng.integers(0, 2, len(lengths))}
    return EncodedDataset({"input_ids": ids, "attention_mask": masks, "token_type_ids": types}, labels)


def batches(data: EncodedDataset, lengths: np.ndarray, args: argparse.Namespace) -> dict[str, list[dict]]:
    """Every mode's batches over the same examples (one pass)."""
    order = np.random.default_rng(args.seed).permutation(len(data))
    random_batches = [order[i : i + args.batch].tolist() for i in range(0, len(order), args.batch)]
    grouped = list(LengthGroupedBatchSampler(lengths.tolist(), args.batch, seed=args.seed))
    pad, flat = pad_collate(0), unpad_collate(0)

    def collate(fn, groups):
        return [fn([data[i] for i in g]) for g in groups]

    return {
        "padded": collate(pad, random_batches),
        "grouped": collate(pad, grouped),
        "unpadded": collate(flat, random_batches),
    }


def tokens_computed(batch: dict) -> int:
    return int(batch["input_ids"].numel())  # (B, S) padded, (T,) unpadded


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> None:
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_distribution(name: str, args: argparse.Namespace) -> dict:
    """Time every mode on one length distribution; the figures for the report and the JSON."""
    config = SWBertConfig.from_size(args.size, attention_type=args.attention, num_labels=2, vocab_size=1000)
    lengths = draw_lengths(name, args.examples, args.seed)
    data = examples(lengths, config.vocab_size, args.seed)
    per_mode = batches(data, lengths, args)
    torch.manual_seed(args.seed)
    base = SWBertForSequenceClassification(config).train()
    models = {m: copy.deepcopy(base) for m in MODES}
    optims = {m: build_optimizer(models[m], 2e-5, 0.01, kind="torch_adamw", on_gpu=False) for m in MODES}
    seconds = dict.fromkeys(MODES, 0.0)
    for i in range(max(len(b) for b in per_mode.values())):
        for mode in MODES[i % 3 :] + MODES[: i % 3]:  # the order rotates every step
            if i >= len(per_mode[mode]):
                continue
            started = time.perf_counter()
            step(models[mode], optims[mode], per_mode[mode][i])
            if i >= args.warmup:
                seconds[mode] += time.perf_counter() - started
    real = int(lengths.sum())
    timed_real = {
        m: sum(
            int(b["attention_mask"].sum()) if "attention_mask" in b else tokens_computed(b)
            for b in per_mode[m][args.warmup :]
        )
        for m in MODES
    }
    computed = {m: sum(tokens_computed(b) for b in per_mode[m]) for m in MODES}
    return {
        "real_tokens": real,
        "tokens_computed": computed,
        "padding_fraction": {m: 1.0 - real / computed[m] for m in MODES},
        "tokens_per_s": {m: timed_real[m] / seconds[m] if seconds[m] else 0.0 for m in MODES},
        "seconds": seconds,
        "steps": {m: len(per_mode[m]) for m in MODES},
    }


def report(name: str, row: dict) -> None:
    print(f"\n{name}: {row['real_tokens']} real tokens in {row['steps']['padded']} batches")
    print(f"  {'mode':<9} {'padding':>8} {'computed':>9} {'real tok/s':>11} {'vs padded':>10}")
    base = row["tokens_per_s"]["padded"] or 1.0
    for m in MODES:
        print(
            f"  {m:<9} {row['padding_fraction'][m]:>8.1%} {row['tokens_computed'][m]:>9} "
            f"{row['tokens_per_s'][m]:>11.0f} {row['tokens_per_s'][m] / base:>9.2f}x"
        )
    print("  grouped/padded target >= 1.3x on CPU; unpadded computes the real tokens only")


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    kernel = varlen_kernel("cpu") or "per-sequence reference"
    print(
        f"finetune_step: size {args.size}, {args.attention} attention, batch {args.batch}, "
        f"{args.examples} examples per distribution, {torch.get_num_threads()} threads; attention: {kernel}"
    )
    out: dict = {"config": {k: str(v) for k, v in vars(args).items()}, "attention_kernel": kernel}
    for name in args.distributions:
        out[name] = run_distribution(name, args)
        report(name, out[name])
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
