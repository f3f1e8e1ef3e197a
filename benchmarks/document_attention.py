"""The cost of document-aware attention in pretraining (`--document-attention`, ours), side by side.

One process trains two copies of the same masked-LM model on the same packed batches, one with
plain attention over each whole sample and one with attention within each document only (the
documents as the sequences of the variable-length path, swbert.data.packing.document_seqlens),
and times forward + backward + optimizer step of each, interleaved step by step (a slow spell of a
shared machine hits both alike). It prints the documents per sample, each mode's step time and
the ratio; `--json FILE` writes them too.

Nothing is downloaded: document lengths (tokens) are drawn from a log-normal of our choosing,
median 100 tokens, sigma 1.0 (mean ~165), clipped to [8, 4096]: web-page-like text, several
documents to a 128-token sample. Samples are packed as `PackedSequences` packs them: the
documents one stream `doc0 [SEP] doc1 [SEP] ...`, cut into `[CLS] ... [SEP]` samples.

    python benchmarks/document_attention.py                 # "mini" model, seq_len 128, CPU
    python benchmarks/document_attention.py --seq-len 512 --json documents.json
    python benchmarks/document_attention.py --smoke         # tiny, seconds (run by the tests)

On the CPU the documents run through the per-sequence reference kernel (one attention call per
document); a GPU's variable-length kernel is not measured here.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from swbert.data.masking import MaskingCollator
from swbert.data.packing import document_seqlens
from swbert.data.tokenizer import CLS_ID, SEP_ID
from swbert.models import SWBertConfig, SWBertForMaskedLM
from swbert.runtime.optim import build_optimizer

MODES = ("plain", "documents")
VOCAB = 1024


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="mini", help="model size (swbert.models.config.SIZES)")
    p.add_argument("--attention", default="shared", help="attention variant")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="samples per step")
    p.add_argument("--steps", type=int, default=12, help="timed steps per mode (after 2 warm-up steps)")
    p.add_argument("--median", type=float, default=100.0, help="median document length in tokens")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 steps: checks that it runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.size, args.seq_len, args.batch, args.steps = "tiny", 32, 4, 2
    return args


def packed_batches(args: argparse.Namespace, count: int, seed: int = 0) -> list[np.ndarray]:
    """`count` batches (batch, seq_len) of packed documents, masked-LM ready (see the docstring)."""
    rng = np.random.default_rng(seed)
    content = args.seq_len - 2
    need = count * args.batch * content
    stream: list[np.ndarray] = []
    while sum(len(d) for d in stream) < need:
        length = int(np.clip(rng.lognormal(np.log(args.median), 1.0), 8, 4096))
        stream += [rng.integers(5, VOCAB, size=length), np.array([SEP_ID])]
    flat = np.concatenate(stream)[:need].reshape(count, args.batch, content)
    ends = np.broadcast_to(np.array([CLS_ID, SEP_ID]), (count, args.batch, 2))
    return list(np.concatenate([ends[..., :1], flat, ends[..., 1:]], axis=-1))


def step(model, optimizer, batch: dict) -> None:
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(0)
    config = SWBertConfig.from_size(args.size, vocab_size=VOCAB, attention_type=args.attention)
    models = {"plain": SWBertForMaskedLM(config)}
    models["documents"] = copy.deepcopy(models["plain"])
    optimizers = {m: build_optimizer(models[m], 1e-4, 0.01) for m in MODES}
    collator = MaskingCollator(VOCAB)
    seconds, documents = dict.fromkeys(MODES, 0.0), []
    for i, ids in enumerate(packed_batches(args, args.steps + 2)):
        masked = collator.mask(ids, np.arange(len(ids), dtype=np.int64) + i * len(ids))
        plain = {"input_ids": masked["input_ids"], "mlm_positions": masked["mlm_positions"]}
        plain["mlm_targets"] = masked["mlm_labels"]
        cu_seqlens, max_seqlen = document_seqlens(ids)
        documents.append((len(cu_seqlens) - 1) / len(ids))
        inputs = {"plain": plain, "documents": {**plain, "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}}
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            started = time.perf_counter()
            step(models[mode].train(), optimizers[mode], inputs[mode])
            if i >= 2:
                seconds[mode] += time.perf_counter() - started
    out = {
        "size": args.size,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "documents_per_sample": float(np.mean(documents)),
        "step_s": {m: seconds[m] / args.steps for m in MODES},
        "documents_over_plain": seconds["documents"] / seconds["plain"],
    }
    print(
        f"{args.size} seq_len {args.seq_len} x {args.batch}, {out['documents_per_sample']:.2f} documents a sample: "
        f"plain {out['step_s']['plain'] * 1e3:.1f} ms, documents {out['step_s']['documents'] * 1e3:.1f} ms "
        f"a step ({out['documents_over_plain']:.2f}x)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
