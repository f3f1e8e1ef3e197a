"""The GPU path, ready for a machine with CUDA; skipped, with the reason, where there is none.

Every attention variant trains a bf16 step on the flash-attention kernel (static shapes, no
attention mask: what pretraining batches are), a compiled step gives the eager loss, and a
1-GPU ZeRO-2 pretraining job runs 5 steps with MFU logged.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from swbert.models import SWBertConfig, SWBertForMaskedLM
from swbert.models.attention import attention_types
from tests.launch_utils import job_env, launch, read_metrics
from tests.test_static_shapes import static_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")


def _model(attention_type: str) -> SWBertForMaskedLM:
    torch.manual_seed(0)
    config = SWBertConfig.from_size(
        "tiny", attention_type=attention_type, vocab_size=96, max_position_embeddings=16
    )  # head_dim 16: a size every fused kernel takes
    return SWBertForMaskedLM(config).cuda().train()


def _inputs() -> dict[str, torch.Tensor]:
    batch = static_batch()
    return {"input_ids": batch["input_ids"].cuda(), "mlm_positions": batch["mlm_positions"].cuda(),
            "mlm_targets": batch["mlm_labels"].cuda()}  # fmt: skip


@pytest.mark.parametrize("attention_type", attention_types())
def test_bf16_step_on_the_flash_kernel(attention_type):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _model(attention_type)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(**_inputs()).loss  # flash only: an error here if the kernel refuses the inputs
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("attention_type", ["standard", "shared"])
def test_compiled_step_gives_the_eager_loss(attention_type):
    model = _model(attention_type).eval()  # no dropout: the same function in both runs
    inputs = _inputs()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = model(**inputs).loss
        compiled = torch.compile(model, fullgraph=True)(**inputs).loss
    compiled.backward()
    assert_close(compiled, eager, rtol=2e-2, atol=2e-2)


def test_one_gpu_zero2_job(data_dir, tmp_path):
    out = tmp_path / "run"
    args = ["--config", "tiny_cpu", "--data-dir", str(data_dir), "--output-dir", str(out), "--mlflow", "false",
            "--precision", "bf16", "--train-steps", "5", "--log-interval", "1", "--compile", "auto"]  # fmt: skip
    result = launch(1, args, env=job_env(DS_ACCELERATOR="cuda"))
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2, 3, 4, 5] and all(m["loss"] > 0 for m in metrics.values())
    assert "tflops_per_device" in metrics[5]  # and "mfu" where the device is in the peak table
