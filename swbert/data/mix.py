"""Weighted mixtures of data folders: which folder each position of the global stream draws from.

`--data-mix wiki=0.75 books=0.25` trains on several preprocessed folders at once. Position `p` of
the global sample stream draws from the folder a `MixSchedule` names, and takes that folder's next
sample in its own sampler order (`GlobalSampler`: a new epoch of a folder starts as that folder
runs out, independently of the others).

The schedule is Megatron-LM's blended-dataset rule (`build_blending_indices`: at each position,
the folder whose achieved count is furthest below weight x position) made periodic (ours): the
weights, read as exact decimals, are whole counts `c_k` over a window of `W = sum(c_k)` samples,
and the greedy rule runs over one window, `(j + 1) * c_k - W * drawn_k` at offset `j` (integers,
ties to the first folder). Over the window it draws exactly `c_k` from folder `k` (the smooth
weighted round-robin argument), and the window repeats. So every aligned window of `W` samples
meets the weights exactly, and any position's folder and its sample within the folder are a pure
function of the position: the same for any number of ranks, and after any resume. Megatron's
helper builds a finite index with `max(i, 1)` in place of `j + 1`, which is not exact over a
window; the loop here runs once per window, at start-up.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from swbert.data.manifest import MANIFEST_NAME, PREPROCESS_HINT, read_manifest

# The longest window: weights that need a longer one (e.g. 0.333333 and 0.666667) are rounded to
# counts over this many samples (largest remainders), which is within 1/MAX_WINDOW of each weight.
MAX_WINDOW = 10_000
FLAG = "--data-mix"


@dataclass(frozen=True)
class MixEntry:
    """One folder of a mix and its weight, as given (`DIR=WEIGHT`)."""

    path: Path
    weight: Fraction

    @property
    def name(self) -> str:
        """The folder's own name: it keys the folder's metrics (`val_loss/<name>`) and records."""
        return self.path.name


def metric_name(name: str) -> str:
    """`name` with the characters MLflow refuses in a metric or param key replaced by `_`."""
    return re.sub(r"[^A-Za-z0-9_.\- ]", "_", name)


def _weight(item: str, text: str) -> Fraction:
    try:
        weight = Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        raise ValueError(
            f"{FLAG} {item}: weight {text!r} is not a number; give DIR=WEIGHT, e.g. wiki=0.75"
        ) from None
    if weight <= 0:
        raise ValueError(
            f"{FLAG} {item}: weight {text} must be positive (a folder's share of the samples); leave a "
            "folder out instead of giving it weight 0"
        )
    return weight


def parse_data_mix(items: list[str]) -> list[MixEntry]:
    """`DIR=WEIGHT` items -> entries; a ValueError naming the item when one cannot be a mix."""
    entries: list[MixEntry] = []
    for item in items:
        folder, sep, text = item.rpartition("=")
        if not sep or not folder:
            raise ValueError(
                f"{FLAG} {item!r}: expected DIR=WEIGHT (a data folder and its weight), e.g. wiki=0.75"
            )
        entry = MixEntry(Path(folder), _weight(item, text))
        for other in entries:
            if other.path.resolve() == entry.path.resolve():
                raise ValueError(
                    f"{FLAG}: folder {entry.path} is listed twice; give each folder once, with one weight"
                )
            if metric_name(other.name) == metric_name(entry.name):
                raise ValueError(
                    f"{FLAG}: folders {other.path} and {entry.path} have the same name {entry.name!r}, which keys "
                    "each folder's metrics; link one under another name (ln -s DIR NEW_NAME) and list that"
                )
        entries.append(entry)
    if not entries:
        raise ValueError(f"{FLAG} needs at least one DIR=WEIGHT")
    return entries


def check_mix_folders(entries: list[MixEntry]) -> list[dict[str, Any]]:
    """Each folder's manifest (a ValueError naming the folder when one has none), all checked to
    name one tokenizer: a ValueError names both folders otherwise."""
    manifests = []
    for entry in entries:
        if not (entry.path / MANIFEST_NAME).is_file():
            raise ValueError(
                f"{FLAG}: {entry.path} holds no {MANIFEST_NAME} (not a finished preprocessed folder); make it with "
                f"{PREPROCESS_HINT.format(dir=entry.path)}"
            )
        manifests.append(read_manifest(entry.path))
    first = manifests[0]["tokenizer"]["hash"]
    for entry, manifest in zip(entries[1:], manifests[1:]):
        other = manifest["tokenizer"]["hash"]
        if other != first:
            raise ValueError(
                f"{FLAG}: {entries[0].path} and {entry.path} were tokenized with different tokenizers "
                f"({first[:12]} vs {other[:12]}); every folder of a mix needs the same one: preprocess {entry.path} "
                f"again with --tokenizer {entries[0].path / 'tokenizer'}"
            )
    return manifests


def window_counts(weights: list[Fraction]) -> list[int]:
    """Whole samples per window for each weight: the smallest window where the normalised weights
    are whole counts, or counts over `MAX_WINDOW` samples (largest remainders) when that is longer."""
    total = sum(weights)
    shares = [w / total for w in weights]
    window = math.lcm(*(s.denominator for s in shares))
    if window <= MAX_WINDOW:
        return [int(s * window) for s in shares]
    exact = [s * MAX_WINDOW for s in shares]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda k: exact[k] - counts[k], reverse=True)
    for k in by_remainder[: MAX_WINDOW - sum(counts)]:
        counts[k] += 1
    if min(counts) == 0:
        k = counts.index(0)
        raise ValueError(
            f"{FLAG}: weight {weights[k]} is less than one sample in {MAX_WINDOW} of the mix; raise it or leave "
            "that folder out"
        )
    divisor = math.gcd(*counts)
    return [c // divisor for c in counts]


class MixSchedule:
    """Which folder each global stream position draws from, and which of that folder's draws it is.

    `counts[k]` samples of folder `k` in every window of `window = sum(counts)` positions; the
    order within a window is the greedy largest-deficit one (see the module docstring).
    """

    def __init__(self, counts: list[int]) -> None:
        if not counts or min(counts) <= 0:
            raise ValueError(f"every folder needs a positive count per window, not {counts}")
        self.counts = np.asarray(counts, dtype=np.int64)  # (K,)
        self.window = int(self.counts.sum())
        self.folder = np.empty(self.window, dtype=np.int64)  # (W,) folder at each offset
        self.draw = np.empty(self.window, dtype=np.int64)  # (W,) that folder's draws before it in the window
        drawn = [0] * len(counts)
        for j in range(self.window):
            deficits = [c * (j + 1) - self.window * d for c, d in zip(counts, drawn)]
            k = deficits.index(max(deficits))
            self.folder[j], self.draw[j] = k, drawn[k]
            drawn[k] += 1

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(folder, draw within that folder) of each global stream position: two (N,) int64 arrays."""
        windows, offsets = np.divmod(np.asarray(positions, dtype=np.int64), self.window)
        folder = self.folder[offsets]
        return folder, windows * self.counts[folder] + self.draw[offsets]

    def drawn(self, samples: int) -> np.ndarray:
        """Samples each folder gave to stream positions `[0, samples)`: (K,) int64."""
        windows, offset = divmod(samples, self.window)
        return windows * self.counts + np.bincount(self.folder[:offset], minlength=len(self.counts))
