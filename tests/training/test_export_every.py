"""Checkpoints as models (ours): `--export-every N` writes a Hugging Face folder from the checkpoint
of every N-th step to `exports/step_*/`, listed in MLflow; `swbert.training.export --average K`
writes the uniform fp32 average of a run's last K complete checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from swbert.training import checkpoint as ckpt
from swbert.training.config import TrainConfig
from swbert.training.export import AVERAGE_RECORD, export_due, main as export_main

STEPS, EVERY = 4, 2


def checkpoint_weights(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The module's weights as the engine saved them (one rank, ZeRO-2, fp32): the reference."""
    return torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)[
        "module"
    ]


def assert_weights(model: torch.nn.Module, reference: dict[str, torch.Tensor]) -> None:
    """Every weight of `model` equals the reference's (whose vocabulary rows are padded: cut to size)."""
    state = model.state_dict()
    assert set(state) <= set(reference) | {"mlm_head.decoder.weight"}
    for name, value in state.items():
        ref = reference.get(name, reference["bert.embeddings.word_embeddings.weight"])
        assert_close(value, ref[tuple(slice(0, n) for n in value.shape)], msg=name)


@pytest.fixture(scope="module")
def run(data_dir, tmp_path_factory) -> Path:
    """A tiny run of 4 steps that saves and exports every 2, with MLflow in its folder."""
    from tests.e2e.test_pretrain import check_ok, tiny_args
    from tests.launch_utils import run_single

    out = tmp_path_factory.mktemp("export-every") / "run"
    args = tiny_args(data_dir, out, "--train-steps", str(STEPS), "--save-interval", str(EVERY))
    args = [a if a != "false" else "true" for a in args]  # --mlflow true: the exports are listed there
    args += [
        "--export-every",
        str(EVERY),
        "--eval-batches",
        "0",
        "--num-workers",
        "0",
        "--system-metrics",
        "false",
    ]
    check_ok(run_single(args))
    return out


@pytest.mark.slow
def test_export_every_writes_loadable_folders_equal_to_their_checkpoints(run):
    from mlflow import MlflowClient
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    import swbert  # noqa: F401  (registers the Auto classes)

    tags = [ckpt.tag_for(step) for step in range(EVERY, STEPS + 1, EVERY)]
    assert sorted(p.name for p in (run / "exports").iterdir()) == tags
    client = MlflowClient(tracking_uri=f"sqlite:///{run.parent / 'mlflow.db'}")
    (mlflow_run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    for tag in tags:
        folder = run / "exports" / tag
        assert_weights(
            AutoModelForMaskedLM.from_pretrained(str(folder)), checkpoint_weights(run / "checkpoints" / tag)
        )
        assert AutoTokenizer.from_pretrained(str(folder)).mask_token == "[MASK]"
        assert mlflow_run.data.tags[f"exports/{tag}"] == str(folder.resolve())


@pytest.mark.slow
def test_average_of_the_last_two_checkpoints_is_their_mean(run, tmp_path, capsys):
    from transformers import AutoModelForMaskedLM

    import swbert  # noqa: F401

    export_main([str(run), "--output", str(tmp_path / "avg"), "--average", "2"])
    assert "the average of step_00000002, step_00000004" in capsys.readouterr().out
    a, b = (checkpoint_weights(run / "checkpoints" / ckpt.tag_for(s)) for s in (2, 4))
    mean = {name: (a[name].float() + b[name].float()) / 2 for name in a if a[name].is_floating_point()}
    assert not torch.equal(
        a["bert.embeddings.word_embeddings.weight"], b["bert.embeddings.word_embeddings.weight"]
    )
    assert_weights(AutoModelForMaskedLM.from_pretrained(str(tmp_path / "avg")), mean)
    assert (tmp_path / "avg" / AVERAGE_RECORD).is_file()


def _fake_checkpoints(root: Path, steps: list[int]) -> Path:
    for step in steps:
        tag_dir = root / "checkpoints" / ckpt.tag_for(step)
        tag_dir.mkdir(parents=True)
        (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"x")
        ckpt.mark_complete(tag_dir, step, {"step": step})
    return root


@pytest.mark.parametrize("k", ["3", "0"])
def test_average_of_more_checkpoints_than_complete_is_refused_in_one_line(tmp_path, capsys, k):
    root = _fake_checkpoints(tmp_path / "run", [2, 4])
    (root / "checkpoints" / "step_00000006.partial").mkdir()  # a cut-off save does not count
    with pytest.raises(SystemExit) as exit_info:
        export_main([str(root), "--output", str(tmp_path / "avg"), "--average", k])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --average {k}:") and "2 complete checkpoint(s)" in err and "\n" not in err
    assert not (tmp_path / "avg").exists()


def test_exports_follow_the_first_save_at_or_past_each_multiple():
    """A save put off by a skipped step (5, not 4) is the one exported: none is missed or doubled."""
    saves, every, interval = [2, 5, 6, 8, 10, 13, 14], 4, 2
    expected = {min(s for s in saves if s >= m) for m in range(every, max(saves) + 1, every)}
    assert {s for s in saves if export_due(s, every, interval)} == expected == {5, 8, 13}
    assert not any(export_due(s, 0, interval) for s in saves)  # 0: off


def test_export_every_must_be_a_multiple_of_save_interval():
    TrainConfig(export_every=1000, save_interval=500).check()
    with pytest.raises(ValueError, match="export_every=300 must be 0 .* multiple of save_interval=500"):
        TrainConfig(export_every=300, save_interval=500).check()
