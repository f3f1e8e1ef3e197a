"""The masking rule: a fixed count of predictions per sequence, chosen and decided by a hash of
(sample key, token position), against a per-sample reference; its statistics; its errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swbert.data import CLS_ID, MASK_ID, PAD_ID, SEP_ID, SPECIAL_IDS, MaskingCollator
from swbert.data.masking import sample_keys
from tests.masking_reference import mask_sample, sample_key

VOCAB = 300


def _rows() -> np.ndarray:
    """Rows whose maskable counts hit the rule's corners: none, one, ties of round(), padding."""
    rng = np.random.default_rng(0)
    ids = rng.integers(len(SPECIAL_IDS), VOCAB, size=(9, 40))
    ids[:, 0], ids[:, -1] = CLS_ID, SEP_ID
    ids[1, 1:-1] = PAD_ID  # n = 0: nothing to predict
    ids[2, 2:-1] = PAD_ID  # n = 1: round(0.15) = 0, but at least 1
    ids[3, 11:-1] = PAD_ID  # n = 10: round(1.5) = 2 (half to even)
    ids[4, 31:-1] = PAD_ID  # n = 30: round(4.5) = 4 (half to even)
    ids[5, 5:9] = MASK_ID  # specials inside a row are never chosen
    ids[6, ::3] = SEP_ID  # many separators
    return ids


@pytest.mark.parametrize("p, predictions", [(0.15, None), (0.15, 9), (0.4, None)])
def test_masks_equal_the_per_sample_reference(p: float, predictions: int | None) -> None:
    ids = _rows()
    keys = sample_keys(77, np.arange(100, 100 + len(ids)))
    assert keys.tolist() == [sample_key(77, g) for g in range(100, 100 + len(ids))]
    out = MaskingCollator(VOCAB, mlm_probability=p, max_predictions_per_seq=predictions).mask(ids, keys)
    for row in range(len(ids)):
        want = mask_sample(ids[row].tolist(), int(keys[row]), VOCAB, p, predictions)
        for name, value in want.items():
            assert out[name][row].tolist() == value, (name, row)
    assert all(out[name].dtype == torch.int64 for name in out)
    assert out["mlm_positions"].shape == (len(ids), predictions or max(1, round(40 * p)))
    assert (out["labels"][1] == -100).all() and (out["mlm_positions"][1] == 0).all()  # n = 0
    counts = (out["labels"] != -100).sum(1)[2:5].tolist()  # n = 1, 10, 30
    assert counts == ([1, 2, 4] if p == 0.15 else [1, 4, 12])
    assert "attention_mask" in out and torch.equal(
        out["attention_mask"], torch.from_numpy(ids != PAD_ID).long()
    )
    assert torch.equal(torch.from_numpy(ids), torch.from_numpy(_rows()))  # the input is left alone


def test_fixed_count_uniform_choice_and_the_80_10_10_split_over_many_rows() -> None:
    rows, size = 4000, 128
    rng = np.random.default_rng(1)
    ids = rng.integers(len(SPECIAL_IDS), VOCAB, size=(rows, size))
    ids[:, 0], ids[:, -1] = CLS_ID, SEP_ID  # packed rows: n = 126, k = round(18.9) = 19 = P
    out = MaskingCollator(VOCAB).mask(ids, sample_keys(5, np.arange(rows)))
    labels, positions, mlm_labels = out["labels"], out["mlm_positions"], out["mlm_labels"]
    selected = labels != -100
    assert positions.shape == (rows, 19) and (selected.sum(1) == 19).all() and "attention_mask" not in out
    # mlm_positions: increasing, the rows' selected positions; mlm_labels: the labels there
    assert (positions[:, 1:] > positions[:, :-1]).all()
    assert torch.equal(selected, torch.zeros_like(selected).scatter_(1, positions, True))
    assert torch.equal(mlm_labels, labels.gather(1, positions)) and torch.equal(
        mlm_labels, torch.from_numpy(ids).gather(1, positions)
    )
    # every maskable position is chosen equally often: 603 expected, standard deviation 23
    counts = selected.sum(0)[1:-1].double()
    assert counts.min() > 603 - 100 and counts.max() < 603 + 100 and not selected[:, [0, -1]].any()
    new, original = out["input_ids"][selected], torch.from_numpy(ids)[selected]
    masked = new == MASK_ID
    replaced = ~masked & (new != original)
    total = selected.sum()  # 76k predictions: standard deviations 0.0015 and 0.0011
    assert abs(masked.sum() / total - 0.8) < 0.008
    # a random draw equals the original one time in 295, so "kept" slightly exceeds 10%
    assert (
        abs(replaced.sum() / total - 0.1 * 294 / 295) < 0.006 and abs(1 - masked.sum() / total - 0.2) < 0.008
    )
    assert not torch.isin(new[replaced], torch.tensor(SPECIAL_IDS)).any()
    assert len(torch.unique(new[replaced])) > 250  # the draws cover the vocabulary


def test_the_mask_is_a_function_of_the_key() -> None:
    ids = _rows()
    collate = MaskingCollator(VOCAB)
    keys = sample_keys(3, np.arange(len(ids)))
    first, again = collate.mask(ids, keys), collate.mask(ids, keys.copy())
    assert all(torch.equal(first[name], again[name]) for name in first)
    other_stream = collate.mask(ids, sample_keys(4, np.arange(len(ids))))
    other_position = collate.mask(ids, sample_keys(3, np.arange(1, len(ids) + 1)))
    for other in (other_stream, other_position):
        assert not torch.equal(first["mlm_positions"], other["mlm_positions"])


def test_bad_settings_are_errors_that_name_the_fix() -> None:
    ids = _rows()  # seq_len 40: 0.15 needs round(6.0) = 6 predictions a sequence
    keys = sample_keys(0, np.arange(len(ids)))
    with pytest.raises(ValueError, match=r"max_predictions_per_seq=5 .*Set max_predictions_per_seq to 6"):
        MaskingCollator(VOCAB, max_predictions_per_seq=5).mask(ids, keys)
    with pytest.raises(ValueError, match=r"max_predictions_per_seq=41 is more than the 40 positions"):
        MaskingCollator(VOCAB, max_predictions_per_seq=41).mask(ids, keys)
    with pytest.raises(ValueError, match="max_predictions_per_seq must be positive"):
        MaskingCollator(VOCAB, max_predictions_per_seq=0)
    with pytest.raises(ValueError, match=r"input_ids must be \(B, S\) and keys \(B,\)"):
        MaskingCollator(VOCAB).mask(ids, keys[:3])
    with pytest.raises(ValueError, match="leaves no non-special token"):
        MaskingCollator(len(SPECIAL_IDS))
