"""The held-out n-gram floors (ours, swbert.data.floors) against counts made here by hand, on the
tokens the trainer's validation reads."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import torch

from swbert.data.floors import NgramFloors, held_out_floors


def _counts(corpus):
    unigrams, pairs = Counter(), Counter()
    for shard in range(len(corpus.prefixes)):
        tokens = corpus.tokens(shard).tolist()
        unigrams.update(tokens)
        pairs.update(zip(tokens, tokens[1:]))
    return unigrams, pairs


def test_bigram_floor_is_witten_bell_over_the_unigram(data_dir):
    from swbert.training.data import TrainingData

    corpus = TrainingData(data_dir, 64, 0.15, 1234).train.corpus
    specials = set(corpus.special_ids.ids)
    unigrams, pairs = _counts(corpus)
    total = sum(unigrams.get(t, 0) + 1 for t in range(corpus.vocab_size) if t not in specials)
    left_total, left_types = Counter(), Counter()
    for (left, _), c in pairs.items():
        left_total[left] += c
        left_types[left] += 1
    seen = sorted(pairs, key=pairs.get, reverse=True)[:5]  # frequent pairs
    lefts, targets = [p[0] for p in seen], [p[1] for p in seen]
    lefts += [seen[0][0], corpus.special_ids.mask]  # a pair never seen; a left never seen on the left
    targets += [
        next(t for t in range(corpus.vocab_size) if t not in specials and (seen[0][0], t) not in pairs)
    ] * 2
    expected_uni, expected_bi = [], []
    for left, target in zip(lefts, targets):
        p = (unigrams.get(target, 0) + 1) / total
        expected_uni.append(math.log(p))
        if left_total[left] == 0:
            expected_bi.append(math.log(p))
        else:
            t = left_types[left]
            expected_bi.append(math.log((pairs.get((left, target), 0) + t * p) / (left_total[left] + t)))
    uni, bi = NgramFloors(corpus, corpus.special_ids.ids).log_probs(np.array(lefts), np.array(targets))
    torch.testing.assert_close(uni.tolist(), expected_uni, rtol=1e-12, atol=0)
    torch.testing.assert_close(bi.tolist(), expected_bi, rtol=1e-12, atol=0)
    assert bi[:5].mean() > uni[:5].mean()  # a frequent pair is likelier after its left token


def test_held_out_floors_score_the_tokens_the_trainers_validation_predicts(data_dir):
    from swbert.training.data import TrainingData

    data = TrainingData(data_dir, 64, 0.15, 1234)
    corpus = data.train.corpus
    floors = NgramFloors(corpus, data.special_ids.ids)
    uni = bi = 0.0
    count = 0
    for start in (0, 8):  # the trainer's validation: micro-batches of its validation stream, in order
        batch = data.batch(start, 8, 0, 1, valid=0)
        labels, positions, inputs = batch["mlm_labels"], batch["mlm_positions"], batch["input_ids"]
        for row, col in zip(*torch.nonzero(labels >= 0, as_tuple=True)):
            target, where = int(labels[row, col]), int(positions[row, col])
            u, b = floors.log_probs(np.array([int(inputs[row, where - 1])]), np.array([target]))
            uni, bi, count = uni - float(u[0]), bi - float(b[0]), count + 1
    got = held_out_floors(data_dir, 64, 0.15, 1234, 16)
    assert got["predicted_tokens"] == count
    torch.testing.assert_close(got["unigram"], uni / count, rtol=1e-9, atol=0)
    torch.testing.assert_close(got["bigram"], bi / count, rtol=1e-9, atol=0)
    assert got["bigram"] < got["unigram"]


def test_several_seeds_give_each_its_own_floor_and_their_mean(data_dir):
    one, two = (held_out_floors(data_dir, 64, 0.15, seed, 16) for seed in (1, 2))
    both = held_out_floors(data_dir, 64, 0.15, [1, 2], 16)
    assert both["by_seed"] == {"1": one, "2": two} and one != two  # each seed masks other tokens
    for key in ("unigram", "bigram"):
        torch.testing.assert_close(both[key], (one[key] + two[key]) / 2, rtol=1e-12, atol=0)
