"""The GPU path, ready for a machine with CUDA; skipped, with the reason, where there is none.

Every attention variant trains a bf16 step on the flash-attention kernel (static shapes, no
attention mask: what pretraining batches are), a compiled step gives the eager loss, the model
compiled per block as the trainer wraps it gives the eager loss and gradients in bf16, the fused
AdamW step gives the plain one's update, and a 1-GPU ZeRO-2 pretraining job runs 5 steps with MFU
logged. `make test-gpu` (benchmarks/gpu_window.py) runs this file as its last step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

from swbert.models import SWBertConfig, SWBertForMaskedLM
from swbert.models.attention import attention_types
from swbert.runtime.optim import build_optimizer, param_groups
from swbert.training.wrappers import wrap_model
from tests.launch_utils import job_env, launch, read_metrics
from tests.models.test_static_shapes import static_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")


def _model(attention_type: str, dropout: float = 0.1) -> SWBertForMaskedLM:
    torch.manual_seed(0)
    config = SWBertConfig.from_size(  # head_dim 16: a size every fused kernel takes
        "tiny",
        attention_type=attention_type,
        vocab_size=96,
        max_position_embeddings=16,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
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


def _loss_and_grads(model: SWBertForMaskedLM) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(**_inputs()).loss
    loss.backward()
    return loss.detach().float(), {
        n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("attention_type", ["standard", "shared"])
def test_compiled_per_block_bf16_step_equals_eager(attention_type):
    """What `--compile auto` runs on a GPU (each block's and the head's forward compiled, the hooks
    eager) gives the eager loss and every gradient, to bf16 rounding: inductor's fused kernels round
    at other points than eager's, so gradients compare by their relative error, not elementwise."""
    eager = _model(attention_type, dropout=0.0)  # no dropout: the same function in both
    compiled = wrap_model(copy.deepcopy(eager), compile=True, log_steps=False)
    for _ in range(2):  # the second call runs the compiled code as it stays
        loss, grads = _loss_and_grads(eager)
        loss_c, grads_c = _loss_and_grads(compiled)
    assert_close(loss_c, loss, rtol=2e-2, atol=2e-2)
    assert grads_c.keys() == grads.keys()
    for name, g in grads.items():
        error = (grads_c[name] - g).norm() / g.norm().clamp_min(1e-12)
        assert error < 5e-2, f"{name}: relative error {error:.3g}"


@pytest.mark.parametrize("kind", ["torch_adamw", "auto"])
def test_fused_adamw_step_equals_the_plain_step(kind):
    """The optimizer a GPU run builds (`torch_adamw` is torch's fused kernel there; `auto` is what
    `--optimizer auto` picks) updates the weights as torch's single-tensor AdamW does, over the same
    parameter groups (weight decay on matrices only), through three steps of moment state."""
    model = _model("shared", dropout=0.0)
    reference = copy.deepcopy(model)
    fused = build_optimizer(model, lr=1e-3, weight_decay=0.01, kind=kind, on_gpu=True)
    if kind == "torch_adamw":
        assert fused.defaults["fused"] is True
    plain = torch.optim.AdamW(param_groups(reference, 0.01), lr=1e-3, foreach=False, fused=False)
    for _ in range(3):
        fused.zero_grad(set_to_none=True)
        model(**_inputs()).loss.backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            q.grad = None if p.grad is None else p.grad.clone()  # the same gradients for both
        fused.step()
        plain.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_one_gpu_zero2_job(data_dir, tmp_path):
    out = tmp_path / "run"
    args = ["--config", "tiny_cpu", "--data-dir", str(data_dir), "--output-dir", str(out), "--mlflow", "false",
            "--precision", "bf16", "--train-steps", "5", "--log-interval", "1", "--compile", "auto"]  # fmt: skip
    result = launch(1, args, env=job_env(DS_ACCELERATOR="cuda"))
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2, 3, 4, 5] and all(m["loss"] > 0 for m in metrics.values())
    assert "tflops_per_device" in metrics[5]  # and "mfu" where the device is in the peak table
