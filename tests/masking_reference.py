"""A straightforward per-sample reference of the masking rule and the sample stream, for the tests.

Written from the rule's description (swbert/data/masking.py's docstring) with Python integers
and lists, one sample and one token at a time: nothing is imported from the code it checks,
so a change of a constant or of the rule there makes the comparison fail.
"""

from __future__ import annotations

import numpy as np

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
ACTION_SALT = 0xD1B54A32D192ED03
SPECIALS = {0, 1, 2, 3, 4}  # [PAD] [UNK] [CLS] [SEP] [MASK]
MASK, CLS, SEP = 4, 2, 3
VALID_OFFSET = 1_000_003


def mix(x: int) -> int:
    """SplitMix64's finaliser on one 64-bit integer."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def sample_key(stream_seed: int, position: int) -> int:
    return mix(mix(stream_seed & M64) ^ position)


def mask_sample(
    ids: list[int], key: int, vocab: int, p: float = 0.15, predictions: int | None = None
) -> dict[str, list[int]]:
    """One sequence masked by the rule: k of its n maskable tokens, the k smallest hashes."""
    size = len(ids)
    predictions = predictions if predictions is not None else max(1, round(size * p))
    h = [mix((key + (t + 1) * GOLDEN) & M64) for t in range(size)]
    maskable = [t for t in range(size) if ids[t] not in SPECIALS]
    n = len(maskable)
    k = min(predictions, max(1, round(n * p))) if n else 0
    chosen = sorted(sorted(maskable, key=lambda t: (h[t] >> 1, t))[:k])
    replacements = [i for i in range(vocab) if i not in SPECIALS]
    out, labels = list(ids), [-100] * size
    for t in chosen:
        a = mix(h[t] ^ ACTION_SALT)
        u = (a >> 32) / 2**32
        labels[t] = ids[t]
        if u < 0.8:
            out[t] = MASK
        elif u < 0.9:
            out[t] = replacements[((a & 0xFFFFFFFF) * len(replacements)) >> 32]
    pad = predictions - k
    return {
        "input_ids": out,
        "labels": labels,
        "mlm_positions": chosen + [0] * pad,
        "mlm_labels": [ids[t] for t in chosen] + [-100] * pad,
    }


def stream_batch(
    stream: list[int],
    seq_len: int,
    seed: int,
    shuffle: bool,
    position: int,
    count: int,
    vocab: int,
    stream_seed: int,
) -> dict[str, list[list[int]]]:
    """The `count` masked samples at global stream positions `[position, position + count)`.

    `stream`: the split's documents joined by [SEP]; sample i is [CLS] + its i-th slice + [SEP].
    Epoch e visits the samples in `np.random.default_rng([seed, e]).permutation` order.
    """
    body = seq_len - 2
    num = len(stream) // body
    rows: dict[str, list[list[int]]] = {}
    for g in range(position, position + count):
        epoch, at = divmod(g, num)
        index = int(np.random.default_rng([seed, epoch]).permutation(num)[at]) if shuffle else at
        ids = [CLS] + stream[index * body : (index + 1) * body] + [SEP]
        for name, value in mask_sample(ids, sample_key(stream_seed, g), vocab).items():
            rows.setdefault(name, []).append(value)
    return rows
