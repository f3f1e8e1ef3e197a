"""The schedules of a run (ours, not the paper's): wsd and one_minus_sqrt LR schedules against their
closed forms, the batch-size warm-up's steps against an enumeration of the ramp, the masking rate
per step against the per-sample masking reference, and their bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from swbert.data import CLS_ID, SEP_ID, SPECIAL_IDS, MaskingCollator
from swbert.data.masking import MaskingRates, sample_keys
from swbert.data.steps import BatchSchedule
from swbert.runtime.optim import build_scheduler, decay_start, lr_factor, schedule_change
from swbert.training.cli import parse_args
from swbert.training.config import TrainConfig
from tests.masking_reference import mask_sample

# ---- learning rate ----------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["wsd", "one_minus_sqrt"])
@pytest.mark.parametrize("floor", [0.0, 0.1])
def test_stable_then_decay_schedules_equal_their_closed_forms(schedule, floor):
    """100 steps, warm-up 10, decay fraction 0.2: warm-up, the peak from step 10 to 79, then from
    step 80 to 100 linearly (wsd) or as 1 - sqrt(progress) to the floor."""
    f = lr_factor(100, 10, schedule, floor, decay_fraction=0.2)
    shape = (lambda p: 1 - p) if schedule == "wsd" else (lambda p: 1 - math.sqrt(p))
    assert decay_start(100, 10, schedule, 0.2) == 80
    for step, want in [
        (0, 0.1),
        (4, 0.5),
        (9, 1.0),
        (10, 1.0),
        (45, 1.0),
        (79, 1.0),
        (80, floor + (1 - floor) * shape(0.0)),
        (85, floor + (1 - floor) * shape(0.25)),
        (90, floor + (1 - floor) * shape(0.5)),
        (99, floor + (1 - floor) * shape(0.95)),
        (100, floor),
        (150, floor),
    ]:
        assert f(step) == pytest.approx(want, abs=1e-15), (step, f(step), want)
    # the two differ inside the decay: 1 - sqrt(p) falls faster at first
    assert lr_factor(100, 10, "one_minus_sqrt")(85) < lr_factor(100, 10, "wsd")(85)


def test_the_decay_fraction_places_the_decay():
    # the whole run after the warm-up (fraction 1), never inside the warm-up, at least one step
    assert decay_start(100, 10, "wsd", 1.0) == 10
    assert decay_start(100, 30, "wsd", 0.9) == 30
    assert decay_start(100, 0, "wsd", 0.001) == 99
    assert decay_start(50, 0, "one_minus_sqrt", 0.5) == 25
    # linear and cosine ignore it: their decay starts after the warm-up, as before
    assert decay_start(100, 10, "linear", 0.2) == 10
    assert lr_factor(100, 10, "linear", 0.0, 0.5)(55) == lr_factor(100, 10, "linear")(55) == 0.5


def test_the_scheduler_steps_the_lr_through_the_schedule():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2e-3)
    sched = build_scheduler(opt, total=20, warmup=2, schedule="wsd", floor=0.0, decay_fraction=0.25)
    seen = []
    for _ in range(20):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    want = [2e-3 * lr_factor(20, 2, "wsd", 0.0, 0.25)(s) for s in range(20)]
    assert seen == pytest.approx(want, rel=1e-12)
    assert seen[2:15] == [2e-3] * 13 and seen[15] == 2e-3 and seen[16] < 2e-3
    said = schedule_change(20, 40, 10, 2e-3, 2, "wsd", 0.0, 0.25)
    assert "stays until step 30, decays linearly from there" in said


@pytest.mark.parametrize("value", ["0", "-0.1", "1.5", "nan"])
def test_a_decay_fraction_outside_0_1_is_refused_naming_the_key(value):
    with pytest.raises(ValueError, match=r"^lr_decay_fraction=\S+ must be (in \(0, 1\]|a finite number)"):
        parse_args(["--lr-schedule", "wsd", "--lr-decay-fraction", value])
    assert parse_args(["--lr-schedule", "one_minus_sqrt", "--lr-decay-fraction", "1"]).lr_decay_fraction == 1


def test_the_schedules_bad_input_names_the_key():
    with pytest.raises(ValueError, match=r"^mlm_probability_final=1.0 must be in \(0, 1\)"):
        TrainConfig(mlm_probability_final=1.0).check()
    with pytest.raises(
        ValueError, match=r"^batch_size_start=None must be between 1 and global_batch_size=32"
    ):
        TrainConfig(batch_size_warmup_steps=10).check()
    with pytest.raises(ValueError, match=r"^batch_size_start=64 must be between 1 and global_batch_size=32"):
        TrainConfig(batch_size_warmup_steps=10, batch_size_start=64).check()
    with pytest.raises(ValueError, match=r"^batch_size_warmup_steps=-1 must be 0 or more"):
        TrainConfig(batch_size_warmup_steps=-1).check()
    # P must hold the larger rate: 0.3 of 128 tokens is 38 predictions
    with pytest.raises(
        ValueError, match="max_predictions_per_seq=20 is below what mlm_probability=0.3 needs"
    ):
        TrainConfig(mlm_probability=0.3, mlm_probability_final=0.15, max_predictions_per_seq=20).check()


# ---- batch-size warm-up -----------------------------------------------------------------------


def ramp_by_hand(full: int, unit: int, start: int, warmup: int, steps: int) -> list[int]:
    """The warm-up's batch of each step, written out with floats: linear, then whole units."""
    out = []
    for s in range(steps):
        raw = start + (full - start) * s / warmup if s < warmup else full
        out.append(max(unit, math.floor(raw / unit + 1e-9) * unit))
    return out


def owner_by_enumeration(sizes: list[int]) -> list[int]:
    """The step of each stream position, one position at a time."""
    return [step for step, size in enumerate(sizes) for _ in range(size)]


@pytest.mark.parametrize(("full", "unit", "start", "warmup"), [(16, 4, 4, 6), (64, 8, 8, 10), (12, 2, 11, 3)])
def test_the_batch_warm_up_ramps_in_whole_units_and_positions_map_to_their_steps(full, unit, start, warmup):
    schedule = BatchSchedule(full, unit, start, warmup)
    sizes = ramp_by_hand(full, unit, start, warmup, warmup + 5)
    assert [schedule.batch_at(s) for s in range(len(sizes))] == sizes
    assert all(schedule.accumulation(s) * unit == sizes[s] for s in range(len(sizes)))
    assert [schedule.samples_before(s) for s in range(len(sizes) + 1)] == np.cumsum([0, *sizes]).tolist()
    owners = owner_by_enumeration(sizes)
    assert schedule.steps_of(np.arange(len(owners))).tolist() == owners
    # anchored where the schedule itself stands: the same steps (an exact resume)
    k = warmup // 2
    anchored = schedule.anchored(k, schedule.samples_before(k))
    later = np.arange(schedule.samples_before(k), len(owners))
    assert anchored.steps_of(later).tolist() == owners[schedule.samples_before(k) :]
    # without a warm-up, every step takes the full batch
    assert BatchSchedule(full, unit).steps_of(np.arange(3 * full)).tolist() == owner_by_enumeration(
        [full] * 3
    )


def test_a_changed_schedule_continues_from_the_anchor():
    """A resume at step 3 (stream position 24 of an 8-per-step run) with a 16-per-step batch: the
    next positions belong to steps 3, 4, ... in blocks of 16."""
    anchored = BatchSchedule(16, 4).anchored(3, 24)
    assert anchored.steps_of(np.arange(24, 24 + 48)).tolist() == [3] * 16 + [4] * 16 + [5] * 16


# ---- masking rate per step --------------------------------------------------------------------

VOCAB = 300


def test_each_sample_is_masked_at_the_rate_of_its_step():
    """0.30 -> 0.15 over 9 steps of a warm-up 4 -> 8 batch: each row equals the per-sample reference
    at the rate of the step that draws it, with P sized for 0.30; rows of one batch span two steps."""
    steps = BatchSchedule(8, 2, 4, 3)
    rates = MaskingRates(0.30, 0.15, 9, steps)
    sizes = [steps.batch_at(s) for s in range(9)]
    owners = owner_by_enumeration(sizes)
    rng = np.random.default_rng(1)
    ids = rng.integers(len(SPECIAL_IDS), VOCAB, size=(len(owners), 40))
    ids[:, 0], ids[:, -1] = CLS_ID, SEP_ID
    collator = MaskingCollator(VOCAB, mlm_probability=0.30, rates=rates)
    assert collator.max_predictions(40) == 12  # round(40 x 0.30)
    seen = set()
    for first in range(0, len(owners), 5):  # batches of 5: not aligned with the steps
        positions = np.arange(first, min(first + 5, len(owners)))
        keys = sample_keys(7, positions)
        out = collator.mask(ids[positions], keys, positions)
        for row, g in enumerate(positions.tolist()):
            rate = 0.30 + (0.15 - 0.30) * owners[g] / 8
            seen.add(round(rate, 6))
            want = mask_sample(ids[g].tolist(), int(keys[row]), VOCAB, rate, 12)
            for name, value in want.items():
                assert out[name][row].tolist() == value, (name, g)
    assert len(seen) == 9 and min(seen) == 0.15 and max(seen) == 0.3
    # validation's collator: the final rate for every row, the same static shape
    valid = collator.at_fixed_rate(0.15, 40)
    keys = sample_keys(7, np.arange(4))
    out = valid.mask(ids[:4], keys, np.arange(4))
    assert out["mlm_positions"].shape == (4, 12)
    for row in range(4):
        assert (
            out["mlm_labels"][row].tolist()
            == mask_sample(ids[row].tolist(), int(keys[row]), VOCAB, 0.15, 12)["mlm_labels"]
        )
