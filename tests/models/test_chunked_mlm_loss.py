"""The chunked masked-LM cross entropy (ours, swbert.models.mlm_loss) equals the plain formula,
`F.cross_entropy(logits.float(), ...)` on the full (N, vocab) logits: loss, gradients and predicted
ids, in fp32 and in bf16 (a stated bound), with the vocabulary padding left out; it compiles with
the head in one graph (aot_eager, fullgraph) and saves no (N, vocab) logits for the backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from swbert.models import SWBertConfig, SWBertForMaskedLM
from swbert.models.mlm_loss import logit_stats, vocab_chunks
from swbert.models.modeling import IGNORE_INDEX, mlm_loss_from_stats

N, D, VOCAB, PADDED = 48, 32, 500, 512


def _inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(PADDED, D, generator=g) * 0.2).to(dtype).requires_grad_()
    bias = torch.randn(PADDED, generator=g).to(dtype).requires_grad_()
    target = torch.randint(0, VOCAB, (N,), generator=g)
    target[::5] = IGNORE_INDEX  # a static batch's padding rows
    return x, weight, bias, target


def _plain(x, weight, bias, target):
    """Today's formula: the whole (N, vocab) logits, their fp32 cross entropy, their argmax."""
    logits = F.linear(x, weight, bias)[:, :VOCAB]
    losses = F.cross_entropy(logits.float(), target, reduction="none")
    return losses.sum() / (target != IGNORE_INDEX).sum(), logits.argmax(-1)


def _chunked(x, weight, bias, target, chunk_bytes):
    lse, picked, _, predicted = logit_stats(x, weight, bias, target, VOCAB, chunk_bytes)
    return mlm_loss_from_stats(lse, picked, target), predicted


def _loss_grads_predictions(fn, inputs, *args):
    loss, predicted = fn(*inputs, *args)
    return loss, torch.autograd.grad(loss, inputs[:3]), predicted


@pytest.mark.parametrize("chunks", [1, 3, 9])
def test_fp32_equals_the_plain_cross_entropy(chunks):
    inputs = _inputs(torch.float32)
    chunk_bytes = 4 * N * -(-VOCAB // chunks)
    assert len(vocab_chunks(N, VOCAB, chunk_bytes)) == chunks
    want, want_grads, want_pred = _loss_grads_predictions(_plain, inputs)
    got, got_grads, got_pred = _loss_grads_predictions(_chunked, inputs, chunk_bytes)
    assert_close(got, want)
    for name, g, w in zip(("x", "weight", "bias"), got_grads, want_grads, strict=True):
        assert_close(g, w, msg=lambda m, n=name: f"{n}: {m}")
    assert torch.equal(got_pred, want_pred)
    assert not got_grads[1][VOCAB:].any() and not got_grads[2][VOCAB:].any()  # padding rows


def test_bf16_within_the_stated_bound():
    """Logits in bf16, their softmax in fp32, as the plain formula: the loss and the weight and bias
    gradients agree to fp32 rounding. The input gradient is a sum over chunks of bf16 products
    (each rounded to bf16, summed in fp32) where the plain one rounds one GEMM: the bound is
    (chunks + 1) bf16 half-ulps (2^-9) of its largest element."""
    chunks = 3
    inputs = _inputs(torch.bfloat16)
    chunk_bytes = 4 * N * -(-VOCAB // chunks)
    want, want_grads, want_pred = _loss_grads_predictions(_plain, inputs)
    got, got_grads, got_pred = _loss_grads_predictions(_chunked, inputs, chunk_bytes)
    assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_pred, want_pred)
    dx, want_dx = got_grads[0].float(), want_grads[0].float()
    assert_close(dx, want_dx, rtol=0, atol=(chunks + 1) * 2**-9 * want_dx.abs().max().item())
    for g, w in zip(got_grads[1:], want_grads[1:], strict=True):  # one rounding each, as the plain
        assert_close(g.float(), w.float(), rtol=2**-8, atol=1e-6)


def _config(**overrides: object) -> SWBertConfig:
    fields = dict(vocab_size=100, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return SWBertConfig.from_size("tiny", **{**fields, **overrides})


def _batch(vocab: int = 100) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    targets = torch.randint(5, vocab, (3, 4), generator=g)
    targets[2, 2:] = IGNORE_INDEX
    return {
        "input_ids": torch.randint(5, vocab, (3, 12), generator=g),
        "mlm_positions": torch.randint(0, 12, (3, 4), generator=g),
        "mlm_targets": targets,
    }


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("pad", [1, 64])
def test_the_model_without_logits_equals_the_model_with_them_compiled_in_one_graph(pad):
    """`return_logits=False` (the trainer's path): the same loss and every gradient as the logits
    path, the logits' argmax as predictions; the head's forward, loss included, in one graph."""
    torch.manual_seed(0)
    model = SWBertForMaskedLM(_config(pad_vocab_multiple=pad)).train()
    batch = _batch()
    plain = model(**batch)
    plain.loss.backward()
    want = _grads(model)
    model.mlm_head.chunk_bytes = 4 * 12 * 30  # 4 chunks of the 100 ids
    model.mlm_head.forward = torch.compile(model.mlm_head.forward, backend="aot_eager", fullgraph=True)
    out = model(**batch, return_logits=False)
    out.loss.backward()
    assert out.logits is None
    assert_close(out.loss, plain.loss)
    assert torch.equal(out.predictions, plain.logits.argmax(-1))
    got = _grads(model)
    assert got.keys() == want.keys()
    for name, g in got.items():
        assert_close(g, want[name], msg=lambda m, n=name: f"{n}: {m}")


def _saved_bytes(fn, weights: tuple[torch.Tensor, ...]) -> int:
    """Bytes of the tensors autograd saves for the backward while `fn()` runs, `weights` (which
    exist anyway, as parameters) excluded."""
    total, skip = 0, {w.data_ptr() for w in weights}

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if t.data_ptr() not in skip:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_no_logits_are_saved_for_the_backward():
    """The plain formula keeps the (N, vocab) logits (and more) for its backward; the chunked loss
    keeps x and one fp32 number a row: under an eighth of the logits here."""
    inputs = _inputs(torch.float32)
    logits_bytes = N * VOCAB * 4
    assert _saved_bytes(lambda: _plain(*inputs), inputs[1:3]) >= logits_bytes
    assert _saved_bytes(lambda: _chunked(*inputs, 4 * N * 100), inputs[1:3]) < logits_bytes / 8


def test_a_target_outside_the_vocabulary_is_refused():
    model = SWBertForMaskedLM(_config()).train()
    batch = _batch()
    batch["mlm_targets"][0, 0] = 100  # vocab_size: one past the last id
    with pytest.raises(RuntimeError, match="MLM targets must be token ids below vocab_size or IGNORE_INDEX"):
        model(**batch, return_logits=False)
