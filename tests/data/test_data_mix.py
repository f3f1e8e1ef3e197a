"""Weighted mixtures of data folders (--data-mix): the schedule, the draws of 2 real ranks, bad input."""

from __future__ import annotations

import json
import os
from fractions import Fraction
from unittest import mock

import numpy as np
import pytest
import torch

from swbert.data.mix import MAX_WINDOW, MixEntry, MixSchedule, parse_data_mix, window_counts
from swbert.data.sampler import GlobalSampler
from swbert.training.data import TrainingData
from tests.launch_utils import launch, make_second_folder


@pytest.mark.parametrize(
    "weights, counts",
    [(["0.75", "0.25"], [3, 1]), (["7", "2", "1"], [7, 2, 1]), (["0.333333", "0.666667"], [3333, 6667])],
)
def test_every_window_meets_the_weights_exactly(weights, counts):
    """Each aligned window draws exactly the counts; each folder's draws are 0, 1, 2, ... in stream
    order (so each folder walks its own sampler); any slice of positions (a rank's) locates alike."""
    assert window_counts([Fraction(w) for w in weights]) == counts
    schedule = MixSchedule(counts)
    window = schedule.window
    assert window == sum(counts) <= MAX_WINDOW
    positions = np.arange(5 * window)
    folder, draw = schedule.locate(positions)
    for w in range(5):
        assert np.bincount(folder[w * window : (w + 1) * window], minlength=len(counts)).tolist() == counts
    for k in range(len(counts)):
        assert draw[folder == k].tolist() == list(range(5 * counts[k]))
    for end in (0, 1, window - 1, 3 * window + 2):
        assert schedule.drawn(end).tolist() == np.bincount(folder[:end], minlength=len(counts)).tolist()
    odd = positions[1::2]  # rank 1 of 2 with micro-batch 1
    assert [a.tolist() for a in schedule.locate(odd)] == [folder[1::2].tolist(), draw[1::2].tolist()]
    if window == 4:  # the stated order for 3:1
        assert folder[:4].tolist() == [0, 0, 1, 0]


@pytest.mark.slow  # preprocesses three folders
def test_a_mix_draws_each_folder_in_its_own_order_and_a_mix_of_one_is_the_folder(data_dir, mix_dirs):
    a, b = mix_dirs
    single = TrainingData(data_dir, 64, 0.15, 1234)
    alone = TrainingData([MixEntry(a, Fraction(1))], 64, 0.15, 1234)
    for key in ("input_ids", "labels", "mlm_positions", "mlm_labels"):
        assert torch.equal(single.batch(40, 8, 1, 2)[key], alone.batch(40, 8, 1, 2)[key])
    mix = TrainingData(parse_data_mix([f"{a}=0.75", f"{b}=0.25"]), 64, 0.15, 1234)
    n_b = len(mix.sources[1].train)
    total = 4 * (n_b + 3)  # B (the smaller folder) is 3 samples into its second epoch
    batch = mix.batch(0, total, 0, 1)
    source, sample = batch["source"].numpy(), batch["sample"].numpy()
    for k, n in enumerate(len(s.train) for s in mix.sources):
        expected = GlobalSampler(n, seed=1234, micro_batch_size=1, dp_rank=0, dp_size=1).take(
            0, int((source == k).sum())
        )
        assert sample[source == k].tolist() == expected.tolist()
        rows = mix.sources[k].train.get_batch(sample[source == k])  # (n, S) unmasked
        masked = batch["labels"].numpy()[source == k] >= 0  # where the batch predicts, it holds the original
        assert np.array_equal(np.where(masked, batch["labels"].numpy()[source == k], rows), rows)
    state = mix.sampler_state(total)["folders"]
    assert state["A"]["drawn"] == 3 * total // 4 and state["B"]["drawn"] == n_b + 3
    assert state["B"]["epoch"] == 1 and state["A"]["epoch"] == state["A"]["drawn"] // len(
        mix.sources[0].train
    )
    record = mix.mix_record(total)
    assert record["window"] == 4 and record["folders"]["B"]["per_window"] == 1
    assert record["folders"]["B"]["epochs_planned"] == pytest.approx((n_b + 3) / n_b)
    assert mix.fingerprint().startswith("A=3/4@") and " B=1/4@" in mix.fingerprint()


@pytest.mark.slow
def test_two_ranks_draw_3_to_1_in_every_window_from_sample_ids(mix_dirs, tmp_path):
    """Two real ranks read the mix through DataLoader workers; the folders of the samples they got,
    in stream order, are 3 of A and 1 of B in every window of 4, and each folder's samples are its
    own sampler order from its start: nothing drawn twice or skipped across the ranks."""
    a, b = mix_dirs
    out = tmp_path / "draws.json"
    result = launch(2, [str(out), f"{a}=0.75", f"{b}=0.25"], script="tests/scripts/mix_draws.py")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = sorted(json.loads(out.read_text()))
    assert [r[0] for r in rows] == list(range(96))  # 12 global batches of 2 ranks x 4
    folders = [r[1] for r in rows]
    for w in range(0, 96, 4):
        assert sorted(folders[w : w + 4]) == [0, 0, 0, 1], (w, folders[w : w + 4])
    mix = TrainingData(parse_data_mix([f"{a}=0.75", f"{b}=0.25"]), 64, 0.15, 1234)
    for k in (0, 1):
        got = [r[2] for r in rows if r[1] == k]
        n = len(mix.sources[k].train)
        assert (
            got
            == GlobalSampler(n, seed=1234, micro_batch_size=1, dp_rank=0, dp_size=1)
            .take(0, len(got))
            .tolist()
        )


def refused(argv: list[str], capsys) -> str:
    """`launchers/pretrain.py ARGV` in this process: exit status 2 before the run folder or a
    process group exists; returns the one line it printed."""
    from swbert.launchers.pretrain import main

    started = AssertionError("work started before the input was checked")
    with (
        mock.patch.dict(os.environ),
        mock.patch("swbert.training.build.open_run_folder", side_effect=started),
        pytest.raises(SystemExit) as exit_,
    ):
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_bad_mix_input_is_refused_naming_the_flag_or_folder(data_dir, mix_dirs, tmp_path, capsys):
    a, b = mix_dirs
    base = ["--config", "tiny_cpu", "--output-dir", str(tmp_path / "run"), "--mlflow", "false", "--data-mix"]
    for weight, why in (("0", "must be positive"), ("-1", "must be positive"), ("lots", "is not a number")):
        err = refused([*base, f"{a}=0.75", f"{b}={weight}"], capsys)
        assert f"--data-mix {b}={weight}: weight" in err and why in err
    assert "expected DIR=WEIGHT" in refused([*base, str(a)], capsys)
    err = refused([*base, f"{a}=0.5", f"{a}/=0.5"], capsys)
    assert f"folder {a}/ is listed twice" in err or f"folder {a} is listed twice" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    err = refused([*base, f"{a}=1", f"{empty}=1"], capsys)
    assert f"--data-mix: {empty} holds no manifest.json" in err
    err = refused([*base, f"{a}=1", "--data-dir", str(data_dir)], capsys)
    assert "--data-mix and --data-dir" in err and "keep one" in err
    other = make_second_folder(data_dir, tmp_path / "other", documents=50, own_tokenizer=True)
    err = refused([*base, f"{a}=1", f"{other}=1"], capsys)
    assert f"{a} and {other} were tokenized with different tokenizers" in err
