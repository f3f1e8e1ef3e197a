"""`launchers/pretrain.py --tensor-parallel 2` end to end: the TP=1 losses, and an export that
reloads with the engine's logits."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("data_prep.train_tokenizer", reason="the pretraining job needs the data pipeline")
pytest.importorskip("swbert.data", reason="the pretraining job needs the data pipeline")

from swbert.models import SWBertForMaskedLM  # noqa: E402
from tests.launch_utils import launch, read_metrics  # noqa: E402


def _args(data_dir, out, *extra: str) -> list[str]:
    common = ["--config", "tiny_cpu", "--data-dir", str(data_dir), "--output-dir", str(out)]
    return [*common, "--mlflow", "false", "--train-steps", "10", *extra]


def _ok(result) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


@pytest.mark.slow
def test_pretrain_tensor_parallel_2_matches_tp1_and_exports(data_dir, tmp_path):
    logits_file = tmp_path / "logits.pt"
    # TP=2 x DP=1 under ZeRO-1, TP=1 x DP=1 under the recipe's ZeRO-2: the same global batches
    tp2 = _args(
        data_dir, tmp_path / "tp2", "--tensor-parallel", "2", "--deepspeed-config", "ds_configs/zero1.json"
    )
    _ok(launch(2, [*tp2, "--dump-logits", str(logits_file)], script="tests/scripts/pretrain_and_dump.py"))
    _ok(launch(1, _args(data_dir, tmp_path / "tp1")))

    tp1_metrics, tp2_metrics = read_metrics(tmp_path / "tp1"), read_metrics(tmp_path / "tp2")
    assert sorted(tp2_metrics) == sorted(tp1_metrics) and len(tp1_metrics) >= 2
    for step in tp1_metrics:
        for key in ("loss", "grad_norm"):
            assert_close(tp2_metrics[step][key], tp1_metrics[step][key], rtol=1e-5, atol=1e-6)

    model = SWBertForMaskedLM.from_pretrained(tmp_path / "tp2" / "export").eval()
    dumped = torch.load(logits_file)
    with torch.no_grad():
        assert_close(model(input_ids=dumped["input_ids"]).logits, dumped["logits"], rtol=1e-5, atol=1e-5)
