"""Epochs over a preprocessed corpus as the token budget a recipe's `train_tokens` holds.

    python -m swbert.training.budget shards/ --epochs 20 --seq-len 512 --global-batch-size 528

An epoch is one pass over the training sequences the trainer packs from the shards: the documents of
the train split form one stream ``doc0 [SEP] doc1 [SEP] ...`` cut into ``seq_len - 2`` tokens per
sequence (``[CLS]`` and ``[SEP]`` added), the last partial one dropped (`swbert.data.packing`). With
``N`` such sequences, ``E`` epochs are ``E * N * seq_len`` tokens as the trainer counts them
(``train_tokens / (global_batch_size * seq_len)`` steps, rounded up), which is what this prints.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Budget:
    sequences_per_epoch: int
    epochs: float
    seq_len: int
    global_batch_size: int

    @property
    def train_tokens(self) -> int:
        return math.ceil(self.epochs * self.sequences_per_epoch * self.seq_len)

    @property
    def steps(self) -> int:
        """Optimizer steps the trainer runs for `train_tokens` (the same rounding as the trainer)."""
        return math.ceil(self.train_tokens / (self.global_batch_size * self.seq_len))


def epochs_budget(data_dir: str | Path, epochs: float, seq_len: int, global_batch_size: int) -> Budget:
    """The token budget of ``epochs`` passes over the train split of ``data_dir`` at ``seq_len``."""
    from swbert.data.corpus import open_corpus
    from swbert.data.packing import PackedSequences

    if epochs <= 0 or seq_len < 3 or global_batch_size <= 0:
        raise ValueError("--epochs and --global-batch-size must be positive and --seq-len at least 3")
    sequences = len(PackedSequences(open_corpus(data_dir, "train"), seq_len))
    return Budget(sequences, epochs, seq_len, global_batch_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m swbert.training.budget",
        description="Print the train_tokens that make EPOCHS passes over a preprocessed corpus.",
    )
    parser.add_argument("data_dir", type=Path, help="shards written by data_prep.preprocess")
    parser.add_argument("--epochs", type=float, default=20.0, help="passes over the corpus (the paper: 20)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (the paper: 512)")
    parser.add_argument(
        "--global-batch-size", type=int, default=528, help="sequences per step (the paper: 4 x 132)"
    )
    args = parser.parse_args(argv)
    try:
        budget = epochs_budget(args.data_dir, args.epochs, args.seq_len, args.global_batch_size)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(
        f"{budget.sequences_per_epoch:,} sequences of {budget.seq_len} per epoch; {budget.epochs:g} epochs = "
        f"{budget.steps:,} steps of {budget.global_batch_size}\n--train-tokens {budget.train_tokens}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
