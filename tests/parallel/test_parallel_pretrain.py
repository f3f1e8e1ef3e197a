"""`launchers/pretrain.py --tensor-parallel 2` end to end: the TP=1 losses, per-TP-rank checkpoint
shards, an export that reloads with the engine's logits, and a TP=1 checkpoint that continues at
TP=2 after conversion (refused, with the command to run, before it)."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("data_prep.train_tokenizer", reason="the pretraining job needs the data pipeline")
pytest.importorskip("swbert.data", reason="the pretraining job needs the data pipeline")

from swbert.models import SWBertForMaskedLM  # noqa: E402
from swbert.parallel.convert import to_universal  # noqa: E402
from tests.golden import check_golden  # noqa: E402
from tests.launch_utils import launch, read_metrics  # noqa: E402


def _args(data_dir, out, *extra: str) -> list[str]:
    common = ["--config", "tiny_cpu", "--data-dir", str(data_dir), "--output-dir", str(out)]
    common += ["--cpu-kernels", "off"]  # exactly the model path a GPU runs
    return [*common, "--mlflow", "false", "--train-steps", "10", "--log-interval", "1", *extra]


def _ok(result) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


def _refused_as_rank0_of_2(argv: list[str], capsys) -> str:
    """The launcher in this process as rank 0 of 2: it must stop (status 2) before any process group
    exists; returns what it printed."""
    from swbert.launchers.pretrain import main

    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    with mock.patch.dict(os.environ, env), pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    return err


def _assert_same_steps(got: dict[int, dict], expected: dict[int, dict], steps: list[int]) -> None:
    assert sorted(got) == steps, sorted(got)
    for step in steps:
        for key in ("loss", "grad_norm"):
            assert_close(got[step][key], expected[step][key], rtol=1e-5, atol=1e-6, msg=f"{key} at {step}")


@pytest.mark.slow
@pytest.mark.golden
def test_pretrain_tensor_parallel_2_matches_tp1_and_exports(data_dir, tmp_path, capsys):
    logits_file = tmp_path / "logits.pt"
    # TP=2 x DP=1 under ZeRO-1, TP=1 x DP=1 under the recipe's ZeRO-2: the same global batches
    tp2 = _args(
        data_dir, tmp_path / "tp2", "--tensor-parallel", "2", "--deepspeed-config", "ds_configs/zero1.json"
    )
    result = launch(2, [*tp2, "--dump-logits", str(logits_file)], script="tests/scripts/pretrain_and_dump.py")
    _ok(result)
    assert "model path: plain PyTorch ops, the path a GPU runs" in result.stderr
    _ok(launch(1, _args(data_dir, tmp_path / "tp1", "--save-interval", "5")))

    tp1_metrics, tp2_metrics = read_metrics(tmp_path / "tp1"), read_metrics(tmp_path / "tp2")
    _assert_same_steps(tp2_metrics, tp1_metrics, list(range(1, 11)))
    check_golden("tiny_cpu-tp1-zero2-1rank", tp1_metrics)  # every logged loss, bit for bit
    check_golden("tiny_cpu-tp2-zero1-2ranks", tp2_metrics)
    shards = sorted(p.name for p in (tmp_path / "tp2" / "checkpoints" / "step_00000010").glob("mp_rank_*"))
    assert shards == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]  # one per TP rank

    model = SWBertForMaskedLM.from_pretrained(tmp_path / "tp2" / "export").eval()
    dumped = torch.load(logits_file)
    with torch.no_grad():
        assert_close(model(input_ids=dumped["input_ids"]).logits, dumped["logits"], rtol=1e-5, atol=1e-5)

    # TP=1's step-5 checkpoint at TP=2: refused as it is, with the command that converts it ...
    saved = tmp_path / "tp1" / "checkpoints" / "step_00000005"
    resumed = tmp_path / "tp2_resumed"
    err = _refused_as_rank0_of_2(
        [*_args(data_dir, resumed, "--tensor-parallel", "2", "--resume", str(saved))], capsys
    )
    assert "saved with --tensor-parallel 1 but this run uses 2" in err
    assert f"python -m swbert.parallel.convert universal {saved.parent} NEW_DIR --tag step_00000005" in err
    # ... and after that command, steps 6-10 continue with TP=1's losses and gradient norms
    universal = to_universal(saved.parent, tmp_path / "universal", tag=saved.name)
    _ok(launch(2, _args(data_dir, resumed, "--tensor-parallel", "2", "--resume", str(universal))))
    _assert_same_steps(read_metrics(resumed), tp1_metrics, list(range(6, 11)))
