"""Epochs over a preprocessed corpus as the token budget a recipe's `train_tokens` holds.

    python -m swbert.training.budget shards/ --epochs 20 --seq-len 512 --global-batch-size 528

An epoch is one pass over the training sequences the trainer packs from the shards: the documents of
the train split form one stream ``doc0 [SEP] doc1 [SEP] ...`` cut into ``seq_len - 2`` tokens per
sequence (``[CLS]`` and ``[SEP]`` added), the last partial one dropped (`swbert.data.packing`). With
``N`` such sequences, ``E`` epochs are ``E * N * seq_len`` tokens as the trainer counts them
(``train_tokens / (global_batch_size * seq_len)`` steps, rounded up), which is what this prints.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from swbert import cli


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


@dataclass
class BudgetConfig:
    """The flags of `python -m swbert.training.budget`."""

    data_dir: Path = field(metadata={"positional": True})  # shards written by data_prep.preprocess
    epochs: float = 20.0  # passes over the corpus (the paper: 20)
    seq_len: int = 512  # tokens per sequence (the paper: 512)
    global_batch_size: int = 528  # sequences per step (the paper: 4 x 132)


def main(argv: list[str] | None = None) -> int:
    args = cli.parse_or_exit(BudgetConfig, argv, __doc__, recipes=False)
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
