"""Held-out floors of the masked-LM loss: what predicting a masked token from n-gram counts alone
reaches, with no attention over its context (ours; docs/scaling.md, "Floors").

- unigram: p(token) from the training split's counts, add-one smoothed, special tokens given no
  mass (they are never predicted);
- bigram: p(token | the visible token to its left), Witten-Bell interpolated with the unigram
  (Witten and Bell, 1991): p = (c(l, t) + T(l) p(t)) / (c(l) + T(l)), T(l) the number of distinct
  tokens seen after l; a left neighbour never seen on the left (a [MASK], [CLS]) backs off to p(t).

A model whose held-out loss is not clearly below the unigram floor has learnt token frequencies,
not context: its ratio against another attention variant says nothing about attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from swbert.data.corpus import Corpus, open_corpus
from swbert.data.masking import IGNORE_INDEX, MaskingCollator
from swbert.data.packing import PackedSequences
from swbert.data.stream import VALID_STREAM_OFFSET, MaskedStream


class NgramFloors:
    """Unigram and bigram log-probabilities from the first `max_tokens` of a training split (pairs
    taken within a shard)."""

    def __init__(self, corpus: Corpus, special_ids: tuple[int, ...], max_tokens: int = 50_000_000) -> None:
        vocab = corpus.vocab_size
        counts = np.zeros(vocab, dtype=np.int64)
        pairs, seen = [], 0
        for shard in range(len(corpus.prefixes)):
            tokens = np.asarray(corpus.tokens(shard)[: max_tokens - seen], dtype=np.int64)
            counts += np.bincount(tokens, minlength=vocab)[:vocab]
            pairs.append(tokens[:-1] * vocab + tokens[1:])
            seen += len(tokens)
            if seen >= max_tokens:
                break
        smoothed = counts.astype(np.float64) + 1.0
        smoothed[list(special_ids)] = 0.0
        self.unigram = smoothed / smoothed.sum()
        self.vocab = vocab
        self.pair_keys, self.pair_counts = np.unique(np.concatenate(pairs), return_counts=True)
        left = self.pair_keys // vocab
        self.left_total = np.bincount(left, weights=self.pair_counts, minlength=vocab)  # c(l)
        self.left_types = np.bincount(left, minlength=vocab).astype(np.float64)  # T(l)

    def log_probs(self, left: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(unigram, bigram) log p(target | left) of each pair of int64 arrays."""
        uni = self.unigram[target]
        keys = left * self.vocab + target
        at = np.clip(np.searchsorted(self.pair_keys, keys), 0, len(self.pair_keys) - 1)
        pair = np.where(self.pair_keys[at] == keys, self.pair_counts[at], 0)
        total, types = self.left_total[left], self.left_types[left]
        with np.errstate(invalid="ignore", divide="ignore"):
            bi = np.where(total > 0, (pair + types * uni) / (total + types), uni)
        return np.log(uni), np.log(bi)

    def batch_nll(self, batch: dict[str, torch.Tensor]) -> tuple[float, float, int]:
        """Summed (unigram, bigram) negative log-likelihood of a masked batch's predicted tokens
        (`mlm_positions` / `mlm_labels`, the left neighbour as the model sees it) and their count."""
        labels, positions = batch["mlm_labels"].numpy(), batch["mlm_positions"].numpy()
        rows, cols = np.nonzero(labels != IGNORE_INDEX)
        target = labels[rows, cols].astype(np.int64)
        where = positions[rows, cols]
        left = batch["input_ids"].numpy()[rows, np.maximum(where - 1, 0)].astype(np.int64)
        uni, bi = self.log_probs(left, target)
        return -float(uni.sum()), -float(bi.sum()), len(target)


def held_out_floors(
    data_dir: str | Path, seq_len: int, mlm_probability: float, seed: int | Sequence[int], sequences: int
) -> dict[str, Any]:
    """The floors over the first `sequences` validation sequences of `data_dir`, masked as
    pretraining's validation masks them with `seed` (a run's held-out loss is measured on the
    same tokens): {"unigram", "bigram"} in nats, and "predicted_tokens". Several seeds (each masks
    its own tokens): their means, and each seed's own under "by_seed"."""
    corpus = open_corpus(data_dir, "train")
    special = corpus.special_ids
    valid = PackedSequences(open_corpus(data_dir, "valid", corpus.tokenizer_hash), seq_len)
    collator = MaskingCollator(
        corpus.vocab_size,
        mlm_probability=mlm_probability,
        mask_token_id=special.mask,
        pad_token_id=special.pad,
        special_ids=special.ids,
    )
    floors = NgramFloors(corpus, special.ids)
    by_seed = {}
    for one in [seed] if isinstance(seed, int) else list(dict.fromkeys(seed)):
        stream = MaskedStream(valid, collator, one, shuffle=False, stream_seed=one + VALID_STREAM_OFFSET)
        uni = bi = 0.0
        count = 0
        for start in range(0, sequences, 64):
            u, b, n = floors.batch_nll(stream.batch(start, min(64, sequences - start)))
            uni, bi, count = uni + u, bi + b, count + n
        count = max(count, 1)
        by_seed[str(one)] = {"unigram": uni / count, "bigram": bi / count, "predicted_tokens": float(count)}
    if len(by_seed) == 1:
        return next(iter(by_seed.values()))
    mean = {
        k: sum(f[k] for f in by_seed.values()) / len(by_seed)
        for k in ("unigram", "bigram", "predicted_tokens")
    }
    return {**mean, "by_seed": by_seed}
