"""The CPU kernels of `swbert.runtime.cpu` compute what the plain model path computes (outputs and every
gradient), swap in and out without touching a parameter, and stay out of the plain path."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from swbert import SWBertForMaskedLM
from swbert.models.attention import SDPAKernel
from swbert.runtime.cpu import (
    CPU_KERNELS,
    CPUAttentionKernel,
    bool_mask_dropout,
    optimize_for_cpu,
    resolve_cpu_kernels,
    unfused_attention,
)
from tests.model_helpers import PAPER_VARIANTS
from tests.models.test_perf_optimisations import batch, grads, randomise, tiny

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_unfused_kernel_equals_attention(dropout, padded):
    """The CPU path for attention dropout computes SDPA's attention; with dropout, the probabilities
    are dropped with the mask `dropout` draws from the same seed."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, 12, 16) for _ in range(3))
    mask = None
    if padded:
        mask = torch.ones(3, 1, 1, 12, dtype=torch.bool)
        mask[1, ..., 7:] = False

    def reference(q, k, v):
        if dropout == 0.0:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        scores = q @ k.transpose(-1, -2) / 4.0
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = scores.softmax(-1).reshape(12, 12, 12)  # the (B*H, S, S) layout the kernel draws in
        return (bool_mask_dropout(probs, dropout, True).view(3, 4, 12, 12)) @ v

    w = torch.randn(3, 4, 12, 16)
    results = []
    for attend in (lambda q, k, v: unfused_attention(q, k, v, mask, dropout), reference):
        qi, ki, vi = (t.clone().requires_grad_() for t in (q, k, v))
        torch.manual_seed(1)
        y = attend(qi, ki, vi)
        (y * w).sum().backward()
        results.append((y.detach(), qi.grad, ki.grad, vi.grad))
    for got, expected in zip(*results):
        assert_close(got, expected, **TOL)


def test_unfused_kernel_masks_under_bf16_autocast():
    """The additive mask stays finite in the dtype the product runs in: fp32 inputs under bf16
    autocast give SDPA's result, and a sequence whose keys are all masked gets uniform weights
    (the mean of its values), not NaN."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 12, 16) for _ in range(3))
    mask = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    mask[0, ..., 7:] = False
    mask[1] = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = unfused_attention(q, k, v, mask, 0.0)
    assert y.dtype == torch.bfloat16
    expected = F.scaled_dot_product_attention(q[:1], k[:1], v[:1], attn_mask=mask[:1])
    assert_close(y[:1].float(), expected, atol=3e-2, rtol=3e-2)
    assert_close(y[1].float(), v[1].mean(dim=-2, keepdim=True).expand_as(v[1]), atol=3e-2, rtol=3e-2)


def test_dropout_is_inverted_dropout_with_a_bool_mask():
    """The cheaper CPU draw: every element kept with probability 1 - p and scaled by 1/(1-p)
    (p rounded to a multiple of 2^-16), gradients through the same mask, a bool kept for
    backward, reproducible from the seed."""
    x = torch.rand(400, 1000) + 0.5  # no zeros, so a zero output means dropped
    torch.manual_seed(3)
    x.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t.detach(), lambda t: t):
        y = bool_mask_dropout(x, 0.1)
    kept = y != 0
    assert abs(1 - kept.float().mean().item() - 0.1) < 0.003  # 400k draws: ~6 standard deviations
    p = round(0.1 * 2**16) / 2**16
    assert_close(y[kept], x[kept] / (1 - p))
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert_close(grad, kept.float() / (1 - p))
    assert saved == [torch.bool]
    torch.manual_seed(3)
    assert torch.equal(bool_mask_dropout(x, 0.1), y)
    assert bool_mask_dropout(x, 0.1, training=False) is x
    assert bool_mask_dropout(x, 0.0) is x


@pytest.mark.parametrize("shape", [(3, 5, 7), (1,)])
def test_dropout_draws_for_any_size_and_any_p_below_one(shape):
    """Four elements share one 64-bit draw: sizes that are not a multiple of four still get a
    mask of their own shape, and p just below 1 still keeps a finite scale."""
    x = torch.ones(shape, requires_grad=True)
    for p in (0.5, 0.999999):
        y = bool_mask_dropout(x, p, True)
        assert y.shape == x.shape and torch.isfinite(y).all()
        (grad,) = torch.autograd.grad(y.sum(), x)
        assert torch.equal(grad, y.detach())  # the same mask and scale as the forward


STEPS = """
import resource
import torch
from swbert import SWBertConfig, SWBertForMaskedLM
from swbert.runtime.cpu import keep_freed_memory
took = keep_freed_memory()
torch.manual_seed(0)
# a BERT-sized vocabulary: the (vocab, d) gradients and logits are blocks above glibc's mmap threshold
model = SWBertForMaskedLM(SWBertConfig.from_size("tiny", vocab_size=30522, max_position_embeddings=128))
optimizer = torch.optim.AdamW(model.parameters())
ids = torch.randint(5, 30522, (8, 128))
labels = ids.clone()
labels[:, ::2] = -100
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model(input_ids=ids, labels=labels).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(took, *faults)
"""


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["keep", "system"])
def test_cpu_training_steps_reuse_freed_memory_without_page_faults(setting):
    """The trainer's CPU allocator setting: once warm, a training step takes the memory the last
    step freed from the heap instead of tens of thousands of fresh pages; SWBERT_CPU_MALLOC=system
    leaves glibc's default (and its faults) alone. Faults only ever add up (a block that does not fit
    where it was, the kernel reclaiming pages while other jobs run: half the steps of one CI run),
    so the quiet quarter of the steady steps is compared: without the setting every step faults."""
    env = {**os.environ, "SWBERT_CPU_MALLOC": setting, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", STEPS], env=env, capture_output=True, text=True, check=True)
    took, *faults = out.stdout.split()
    steady = sorted(int(f) for f in faults[2:])
    quiet = steady[len(steady) // 4]
    if setting == "keep":
        assert took == "True" and quiet < 1000, out.stdout
    else:
        assert took == "False" and quiet > 10_000, out.stdout


def count_modules(model: nn.Module) -> dict[type, int]:
    counts: dict[type, int] = {}
    for m in model.modules():
        counts[type(m)] = counts.get(type(m), 0) + 1
    return counts


def custom_autograd_nodes(loss: torch.Tensor) -> set[str]:
    """Names of the graph's nodes that are Python `autograd.Function`s (none on the plain path)."""
    seen, stack, custom = set(), [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            custom.add(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return custom


@pytest.mark.parametrize("variant", PAPER_VARIANTS)
def test_plain_model_runs_pytorch_ops_only(variant):
    """What a GPU runs: in training on this CPU the model calls SDPA and PyTorch's dropout (the op
    that dispatches to the fused `native_dropout` on CUDA; on a CPU it draws with `bernoulli_`), and
    its graph holds no Python autograd Function. With the CPU kernels swapped in, it does."""
    torch.manual_seed(0)
    model = SWBertForMaskedLM(
        tiny(attention_type=variant, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    )
    model.train()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss = model(**batch()).loss
        assert custom_autograd_nodes(loss) == set()
        loss.backward()
    ops = {e.name for e in prof.events()}
    assert {"aten::scaled_dot_product_attention", "aten::dropout"} <= ops, sorted(ops)
    assert optimize_for_cpu(model) == list(CPU_KERNELS)
    loss = model(**batch()).loss
    assert custom_autograd_nodes(loss) == {"_BoolMaskDropoutBackward"}  # in the attention kernel


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("variant", PAPER_VARIANTS)
def test_cpu_kernels_give_the_plain_models_loss_and_gradients(variant, padded):
    """The whole model with every CPU kernel against the plain model, in training. Dropout
    probabilities of 1e-9 run every dropout path (the unfused attention kernel included) while
    keeping every element, so the two paths must agree to float rounding."""
    torch.manual_seed(0)
    config = tiny(attention_type=variant, hidden_dropout_prob=1e-9, attention_probs_dropout_prob=1e-9)
    plain = SWBertForMaskedLM(config).train()
    randomise(plain)
    fast = SWBertForMaskedLM(config).train()
    fast.load_state_dict(plain.state_dict())
    assert optimize_for_cpu(fast) == list(CPU_KERNELS)
    inputs = batch(padded=padded)
    results = []
    for model in (plain, fast):
        torch.manual_seed(1)
        out = model(**inputs)
        out.loss.backward()
        results.append(
            (out.loss.detach(), out.logits.detach(), grads(model), custom_autograd_nodes(out.loss))
        )
    (loss0, logits0, g0, nodes0), (loss1, logits1, g1, nodes1) = results
    assert nodes0 == set() and "_BoolMaskDropoutBackward" in nodes1
    assert_close(loss1, loss0, **TOL)
    assert_close(logits1, logits0, **TOL)
    assert g0.keys() == g1.keys() == {n for n, _ in plain.named_parameters()}
    for name in g0:
        assert_close(g1[name], g0[name], **TOL, msg=name)


def test_cpu_kernels_keep_every_parameter_and_load_both_ways(tmp_path):
    """The swap changes classes only: the same parameter tensors and state-dict keys, the tied decoder
    still tied; a checkpoint saved with the kernels loads into the plain model (and back) with
    identical outputs."""
    torch.manual_seed(0)
    model = SWBertForMaskedLM(
        tiny(attention_type="shared", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    )
    randomise(model)
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    plain_counts = count_modules(model)
    optimize_for_cpu(model)
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before
    assert model.mlm_head.decoder.weight is model.bert.embeddings.word_embeddings.weight
    counts = count_modules(model)
    assert counts.get(SDPAKernel, 0) == 0 and counts[CPUAttentionKernel] == plain_counts[SDPAKernel]
    assert optimize_for_cpu(model) == []  # nothing left to swap
    model.eval()
    inputs = batch()
    expected = model(**inputs).logits
    model.save_pretrained(tmp_path / "with_kernels")
    plain = SWBertForMaskedLM.from_pretrained(tmp_path / "with_kernels").eval()
    assert SDPAKernel in count_modules(plain) and CPUAttentionKernel not in count_modules(plain)
    assert torch.equal(plain(**inputs).logits, expected)
    plain.save_pretrained(tmp_path / "plain")
    again = SWBertForMaskedLM.from_pretrained(tmp_path / "plain")
    optimize_for_cpu(again)
    assert torch.equal(again.eval()(**inputs).logits, expected)


def test_cpu_kernels_setting_is_checked():
    assert resolve_cpu_kernels("auto", on_gpu=False, compile=False)
    assert not resolve_cpu_kernels("auto", on_gpu=True, compile=False)
    assert not resolve_cpu_kernels("auto", on_gpu=False, compile=True)  # the compiler's own kernels
    assert not resolve_cpu_kernels("off", on_gpu=False, compile=False)
    assert resolve_cpu_kernels("on", on_gpu=False, compile=False)
    with pytest.raises(ValueError, match="cpu_kernels: on, but this run is on a GPU.*--cpu-kernels auto"):
        resolve_cpu_kernels("on", on_gpu=True, compile=False)
    with pytest.raises(ValueError, match="cpu_kernels: on with compile: true"):
        resolve_cpu_kernels("on", on_gpu=False, compile=True)
    with pytest.raises(ValueError, match="unknown CPU kernels \\['dropuot'\\]"):
        optimize_for_cpu(SWBertForMaskedLM(tiny()), ["dropuot"])
