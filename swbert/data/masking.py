"""Masked-language-model masking with static shapes, drawn by hashing (sample key, token position).

The rule (NVIDIA's BERT recipe, with a counter-based hash instead of a stateful generator):

- every sequence has `n` maskable (non-special) tokens and gets exactly
  `k = min(P, max(1, round(n * mlm_probability)))` predicted positions (0 when `n == 0`), where
  `P = max_predictions_per_seq` (default `max(1, round(seq_len * mlm_probability))`);
- the positions are the `k` maskable ones with the smallest hash `h[t]` (ties, which a 64-bit
  hash makes vanishingly rare, go to the lower position): a uniform choice of k among n;
- each predicted position then draws `a = mix64(h[t] ^ ACTION_SALT)`: the high 32 bits `u`
  (as `u / 2**32`) pick `[MASK]` below `mask_fraction`, a random non-special token below
  `mask_fraction + random_fraction`, the original token otherwise; the low 32 bits pick the
  random token, `replacement_ids[(lo * R) >> 32]`.

`h[t]` is output `t + 1` of a SplitMix64 generator seeded with the sequence's 64-bit key, and
SplitMix64 is counter-based: output `i` is `mix64(key + i * GOLDEN)`, computed directly for
every (row, position) of a batch at once with a handful of numpy operations. The trainer keys
a sequence by its position in the global sample stream (`sample_keys`), so a mask depends only
on (seed, stream position, token position): not on the number of ranks or loader workers, and a
resumed run masks exactly as the uninterrupted one.

Batches have static shapes, which a compiled step and the masked-LM head (gathering the
predicted rows) need: `mlm_positions` / `mlm_labels` are (B, P) whatever the row's `k`.

A masking-rate schedule (`MaskingRates`, ours) gives each sample the rate of the optimizer step it
is drawn for, a pure function of its stream position; P is then sized for the larger rate.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from swbert.data.steps import BatchSchedule
from swbert.data.tokenizer import MASK_ID, PAD_ID, SPECIAL_IDS

IGNORE_INDEX = -100  # label of positions that are not predicted (ignored by the loss)

GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment: 2**64 / golden ratio, odd
ACTION_SALT = np.uint64(0xD1B54A32D192ED03)  # separates the action draw from the selection hash
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 words (a bijection; wraps modulo 2**64). Returns a new array."""
    x = x ^ (x >> np.uint64(30))
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def sample_keys(stream_seed: int, positions: np.ndarray | Sequence[int]) -> np.ndarray:
    """The 64-bit key of each sample at global stream `positions` of the stream `stream_seed`: (B,) uint64.

    `mix64` is a bijection, so distinct positions of one stream get distinct keys.
    """
    base = mix64(np.array([stream_seed & _MASK64], dtype=np.uint64))
    return mix64(base ^ np.asarray(positions, dtype=np.int64).astype(np.uint64))


def position_hashes(keys: np.ndarray, seq_len: int) -> np.ndarray:
    """`h[b, t]`: output `t + 1` of the SplitMix64 generator seeded with `keys[b]`; (B, S) uint64."""
    steps = (np.arange(1, seq_len + 1, dtype=np.uint64) * GOLDEN)[None, :]  # (1, S), wraps
    return mix64(keys.astype(np.uint64, copy=False)[:, None] + steps)


def default_max_predictions(seq_len: int, mlm_probability: float) -> int:
    """Predictions per sequence the rate needs at full length: `max(1, round(seq_len * p))` (as NVIDIA's BERT)."""
    return max(1, round(seq_len * mlm_probability))


def resolve_max_predictions(seq_len: int, mlm_probability: float, max_predictions_per_seq: int | None) -> int:
    """`max_predictions_per_seq`, defaulted and checked against `seq_len` and the masking rate."""
    need = default_max_predictions(seq_len, mlm_probability)
    if max_predictions_per_seq is None:
        return need
    if max_predictions_per_seq < need:
        raise ValueError(
            f"max_predictions_per_seq={max_predictions_per_seq} is below what mlm_probability={mlm_probability} "
            f"needs at seq_len={seq_len}: round({seq_len} x {mlm_probability}) = {need} predictions a sequence. "
            f"Set max_predictions_per_seq to {need} (or more), or leave it unset"
        )
    if max_predictions_per_seq > seq_len:
        raise ValueError(
            f"max_predictions_per_seq={max_predictions_per_seq} is more than the {seq_len} positions of a "
            f"sequence (seq_len={seq_len}); {need} fits mlm_probability={mlm_probability}, or leave it unset"
        )
    return max_predictions_per_seq


@dataclass(frozen=True)
class MaskingRates:
    """The masking rate of a sample as a function of the optimizer step that draws it (ours; the paper
    masks 15% throughout): linear from `start` at step 0 to `final` at the run's last step
    (`total_steps - 1`), as some 2024-25 encoders go from 30% down to 15%. `steps` says which step
    draws each stream position (the batch-size warm-up included)."""

    start: float
    final: float
    total_steps: int
    steps: BatchSchedule

    def at_steps(self, steps: np.ndarray) -> np.ndarray:
        """The rate at each (0-based) step; float64."""
        progress = np.minimum(1.0, np.asarray(steps, dtype=np.float64) / max(1, self.total_steps - 1))
        return self.start + (self.final - self.start) * progress

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The rate of the sample at each stream position; (B,) float64."""
        return self.at_steps(self.steps.steps_of(positions))


class MaskingCollator:
    """Stack sequences and mask them BERT-style with a fixed number of predictions per sequence.

    `mask(input_ids, keys)` is the rule of this module's docstring, keyed by one 64-bit word per
    row: the trainer passes `sample_keys(seed, stream positions)`. Called as a DataLoader
    `collate_fn`, each row's key is drawn from `generator` (per call or at construction; torch's
    global generator otherwise), so a seeded generator reproduces the masks.

    Returns CPU tensors: `input_ids`, `labels` (B, S) int64 (the original id at predicted
    positions, -100 elsewhere); `mlm_positions` (B, P) int64, the predicted positions of each
    row in increasing order, padded with 0; `mlm_labels` (B, P) int64, the original ids there,
    -100 in the padding; and `attention_mask` (B, S) int64 only when some position is `[PAD]`
    (packed batches have none, so attention needs no mask and SDPA can use flash attention).
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        mlm_probability: float = 0.15,
        max_predictions_per_seq: int | None = None,
        mask_fraction: float = 0.8,
        random_fraction: float = 0.1,
        mask_token_id: int = MASK_ID,
        pad_token_id: int = PAD_ID,
        special_ids: Sequence[int] = SPECIAL_IDS,
        generator: torch.Generator | None = None,
        rates: MaskingRates | None = None,
    ) -> None:
        if not 0.0 < mlm_probability < 1.0:
            raise ValueError(f"mlm_probability must be in (0, 1), not {mlm_probability}")
        if mask_fraction < 0 or random_fraction < 0 or mask_fraction + random_fraction > 1:
            raise ValueError(
                f"mask_fraction ({mask_fraction}) and random_fraction ({random_fraction}) must be "
                "non-negative and sum to at most 1"
            )
        if max_predictions_per_seq is not None and max_predictions_per_seq < 1:
            raise ValueError(f"max_predictions_per_seq must be positive, not {max_predictions_per_seq}")
        self.vocab_size = vocab_size
        self.mlm_probability = mlm_probability
        self.max_predictions_per_seq = max_predictions_per_seq
        self.mask_fraction = mask_fraction
        self.random_fraction = random_fraction
        self.mask_token_id = mask_token_id
        self.pad_token_id = pad_token_id
        specials = sorted(set(special_ids) | {mask_token_id, pad_token_id})
        self.special_ids = torch.tensor(specials)
        # A lookup table (one byte per id) tells maskable tokens faster than an isin per batch.
        self._special_table = np.zeros(max(vocab_size, max(specials) + 1), dtype=bool)
        self._special_table[specials] = True
        # Random replacements come from this table so they can never be a special token.
        self._replacements = np.flatnonzero(~self._special_table[:vocab_size]).astype(np.int64)
        if len(self._replacements) == 0:
            raise ValueError(f"vocab_size={vocab_size} leaves no non-special token to draw")
        self.replacement_ids = torch.from_numpy(self._replacements)
        self.generator = generator
        # a rate per sample from its stream position (`mask(..., positions=...)`); else mlm_probability
        self.rates = rates

    def highest_rate(self) -> float:
        """The largest rate this collator masks at: what P must hold."""
        scheduled = (self.rates.start, self.rates.final) if self.rates is not None else ()
        return max((self.mlm_probability, *scheduled))

    def max_predictions(self, seq_len: int) -> int:
        """P for sequences of `seq_len` tokens (a ValueError naming `max_predictions_per_seq` if it cannot fit)."""
        return resolve_max_predictions(seq_len, self.highest_rate(), self.max_predictions_per_seq)

    def at_fixed_rate(self, mlm_probability: float, seq_len: int) -> MaskingCollator:
        """A copy that masks every sample at `mlm_probability`, with this collator's P at `seq_len`
        (the same static shape: validation batches of a scheduled run)."""
        fixed = copy.copy(self)
        fixed.max_predictions_per_seq = self.max_predictions(seq_len)
        fixed.mlm_probability, fixed.rates = mlm_probability, None
        return fixed

    def __call__(
        self,
        batch: Sequence[torch.Tensor] | torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        """`batch`: a list of (S,) LongTensors or a (B, S) LongTensor (not modified)."""
        input_ids = torch.stack(list(batch)) if not isinstance(batch, torch.Tensor) else batch
        gen = generator if generator is not None else self.generator
        # One key per row; the full int64 range read as uint64 covers every 64-bit word.
        keys = torch.randint(-(2**63), 2**63 - 1, (len(input_ids),), dtype=torch.int64, generator=gen)
        return self.mask(input_ids.numpy().astype(np.int64, copy=False), keys.numpy().view(np.uint64))

    def mask(
        self, input_ids: np.ndarray, keys: np.ndarray, positions: np.ndarray | None = None
    ) -> dict[str, torch.Tensor]:
        """Mask `input_ids` (B, S) by the rows' 64-bit `keys` (B,); the input array is not modified.
        With `rates`, each row at the rate of its stream position (`positions`, (B,))."""
        if input_ids.ndim != 2 or keys.shape != (input_ids.shape[0],):
            raise ValueError(
                f"input_ids must be (B, S) and keys (B,), not {input_ids.shape} and {keys.shape}"
            )
        batch, seq_len = input_ids.shape
        predictions = self.max_predictions(seq_len)
        maskable = ~self._special_table[input_ids]  # (B, S)
        n = maskable.sum(axis=1)  # (B,)
        rate = self.mlm_probability if self.rates is None or positions is None else self.rates(positions)
        # np.rint rounds half to even, as Python's round does.
        k = np.where(n > 0, np.minimum(predictions, np.maximum(1, np.rint(n * rate))), 0)
        k = k.astype(np.int64)

        h = position_hashes(keys, seq_len)  # (B, S)
        # Specials sort after every maskable position (their key is above any h >> 1), and k <= n.
        order_keys = np.where(maskable, h >> np.uint64(1), np.uint64(_MASK64))
        chosen = np.argsort(order_keys, axis=1, kind="stable")[:, :predictions]  # (B, P) by key
        slot = np.arange(predictions)[None, :]  # (1, P)
        valid = slot < k[:, None]  # (B, P): the first k slots of each row hold its predictions
        # Increasing positions, padding last: sort with the padding slots set past the end.
        positions = np.sort(np.where(valid, chosen, seq_len), axis=1)
        positions = np.where(valid, positions, 0)  # (B, P)

        rows = np.broadcast_to(np.arange(batch)[:, None], positions.shape)
        rows_v, pos_v = rows[valid], positions[valid]  # (K,) the predicted (row, position) pairs
        original = input_ids[rows_v, pos_v]  # (K,)
        action = mix64(h[rows_v, pos_v] ^ ACTION_SALT)  # (K,)
        u = (action >> np.uint64(32)).astype(np.float64) * 2.0**-32  # uniform in [0, 1), exact
        pick = ((action & np.uint64(0xFFFFFFFF)) * np.uint64(len(self._replacements))) >> np.uint64(32)
        new = np.where(
            u < self.mask_fraction,
            self.mask_token_id,
            np.where(u < self.mask_fraction + self.random_fraction, self._replacements[pick], original),
        )

        out_ids = np.array(input_ids, dtype=np.int64)  # a copy
        out_ids[rows_v, pos_v] = new
        labels = np.full((batch, seq_len), IGNORE_INDEX, dtype=np.int64)
        labels[rows_v, pos_v] = original
        mlm_labels = np.full((batch, predictions), IGNORE_INDEX, dtype=np.int64)
        mlm_labels[valid] = original
        out = {
            "input_ids": torch.from_numpy(out_ids),
            "labels": torch.from_numpy(labels),
            "mlm_positions": torch.from_numpy(positions.astype(np.int64, copy=False)),
            "mlm_labels": torch.from_numpy(mlm_labels),
        }
        padding = input_ids == self.pad_token_id
        if padding.any():
            out["attention_mask"] = torch.from_numpy((~padding).astype(np.int64))
        return out
