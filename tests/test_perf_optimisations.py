"""Every performance optimisation computes what the plain path computes: outputs and gradients."""

import copy
import gc

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from benchmarks.train_step import activation_bytes
from swbert import ATTENTION_TYPES, SWBertConfig, SWBertForMaskedLM, SWBertForSequenceClassification
from swbert.models.attention import RebuildFromS, SelfAttention, SharedAttention, unfused_attention
from swbert.models.attention import dropout as attention_dropout
from swbert.models.modeling import Dropout, SWBertModel, key_padding_mask

TOL = dict(rtol=1e-5, atol=1e-5)


def tiny(**overrides) -> SWBertConfig:
    overrides = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, **overrides}
    return SWBertConfig.from_size("tiny", vocab_size=101, max_position_embeddings=64, **overrides)


def batch(B: int = 3, S: int = 12, padded: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 101, (B, S), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[-1, S // 2 :] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[:, ::3] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def randomise(model: torch.nn.Module) -> None:
    """Every parameter away from its initial value; the diagonals take both signs."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".dq", ".dk", ".dv")):
                p.copy_(torch.randn_like(p))
            else:
                p.add_(torch.randn_like(p) * 0.05)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def plain_shared(monkeypatch):
    """Switches SharedAttention to the paper's path: Q, K, V materialised, then the common forward."""

    def use_plain() -> None:
        monkeypatch.setattr(SharedAttention, "forward", SelfAttention.forward)

    return use_plain


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
        return (attention_dropout(probs, dropout, True).view(3, 4, 12, 12)) @ v

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


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_shared_layer_fast_path_equals_plain_path(kernel, padded, dropout):
    torch.manual_seed(0)
    attn = SharedAttention(
        tiny(attention_type="shared", attention_kernel=kernel, attention_probs_dropout_prob=dropout)
    )
    randomise(attn)
    x = torch.randn(3, 12, 64)
    mask = torch.ones(3, 12, dtype=torch.bool)
    if padded:
        mask[1, 7:] = False
    mask = mask[:, None, None, :]
    w = torch.randn(3, 12, 64)  # a loss that weighs every output differently
    results = []
    for forward in (SelfAttention.forward, SharedAttention.forward):
        xi = x.clone().requires_grad_()
        attn.zero_grad()
        torch.manual_seed(2)  # the same dropout mask on both paths
        y = forward(attn, xi, mask)
        (y * w).sum().backward()
        results.append((y.detach(), xi.grad, grads(attn)))
    (y0, gx0, g0), (y1, gx1, g1) = results
    assert_close(y1, y0, **TOL)
    assert_close(gx1, gx0, **TOL)
    assert g0.keys() == g1.keys() == {n for n, _ in attn.named_parameters()}
    for name in g0:
        assert_close(g1[name], g0[name], **TOL, msg=name)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_masked_lm_loss_and_gradients_equal_plain_path(plain_shared, checkpointing):
    torch.manual_seed(0)
    model = SWBertForMaskedLM(tiny(attention_type="shared"))
    randomise(model)
    if checkpointing:  # non-reentrant checkpointing composes with the rebuild hooks
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    inputs = batch()
    loss = model(**inputs).loss
    loss.backward()
    fast = grads(model)
    model.zero_grad()
    plain_shared()
    ref = model(**inputs).loss
    ref.backward()
    assert_close(loss, ref, **TOL)
    assert fast.keys() == grads(model).keys()
    for name, g in grads(model).items():
        assert_close(fast[name], g, **TOL, msg=name)


def test_shared_rebuild_composes_with_outer_saved_tensor_hooks(plain_shared):
    """Under CPU offload hooks, S goes through them and the gradients are unchanged."""
    torch.manual_seed(0)
    model = SWBertForMaskedLM(tiny(attention_type="shared"))
    randomise(model)
    inputs = batch()
    with torch.autograd.graph.save_on_cpu():
        model(**inputs).loss.backward()
    fast = grads(model)
    model.zero_grad()
    plain_shared()
    model(**inputs).loss.backward()
    for name, g in grads(model).items():
        assert_close(fast[name], g, **TOL, msg=name)


def test_dropout_is_inverted_dropout_with_a_bool_mask():
    """The cheaper CPU draw: every element kept with probability 1 - p and scaled by 1/(1-p)
    (p rounded to a multiple of 2^-16), gradients through the same mask, a bool kept for
    backward, reproducible from the seed."""
    x = torch.rand(400, 1000) + 0.5  # no zeros, so a zero output means dropped
    module = Dropout(0.1).train()
    torch.manual_seed(3)
    x.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t.detach(), lambda t: t):
        y = module(x)
    kept = y != 0
    assert abs(1 - kept.float().mean().item() - 0.1) < 0.003  # 400k draws: ~6 standard deviations
    p = round(0.1 * 2**16) / 2**16
    assert_close(y[kept], x[kept] / (1 - p))
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert_close(grad, kept.float() / (1 - p))
    assert saved == [torch.bool]
    torch.manual_seed(3)
    assert torch.equal(module(x), y)
    assert module.eval()(x) is x
    assert Dropout(0.0).train()(x) is x


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_shared_keeps_less_for_backward_than_standard_and_the_plain_path(plain_shared, dropout):
    """Shared keeps S (not Q, K, V): two (B, S, d) tensors per layer fewer than standard, which
    keeps its Q, K and V (the fused kernel), or copies of them (the unfused CPU path for dropout)."""
    inputs = batch(B=4, S=16, padded=False)
    inputs.pop("attention_mask")
    sizes = {}
    for variant in ("standard", "shared"):
        torch.manual_seed(0)
        config = tiny(attention_type=variant, attention_probs_dropout_prob=dropout)
        sizes[variant] = activation_bytes(SWBertForMaskedLM(config).train(), inputs)
    plain_shared()
    torch.manual_seed(0)
    config = tiny(attention_type="shared", attention_probs_dropout_prob=dropout)
    sizes["shared_plain"] = activation_bytes(SWBertForMaskedLM(config).train(), inputs)
    config = tiny()
    unit = 4 * 16 * config.hidden_size * 4  # one (B, S, d) fp32 activation
    layers = config.num_hidden_layers
    # (the shared layer keeps the d-vector dq*dk besides: a fraction of a unit)
    assert sizes["standard"] - sizes["shared"] > 1.9 * layers * unit
    assert sizes["shared_plain"] - sizes["shared"] > 2.9 * layers * unit


@pytest.mark.parametrize(
    ("variant", "signs"), [(v, "mixed") for v in ATTENTION_TYPES] + [("shared", "positive")]
)
def test_optimize_for_inference_keeps_outputs(variant, signs, tmp_path):
    torch.manual_seed(0)
    model = SWBertForMaskedLM(tiny(attention_type=variant))
    randomise(model)
    if signs == "positive":  # dq*dk > 0 everywhere: the fold moves everything into the projections
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith((".dq", ".dk", ".dv")):
                    p.abs_().add_(0.1)
    model.eval()
    inputs = batch()
    inputs.pop("labels")
    expected = model(**inputs).logits
    folded = copy.deepcopy(model).optimize_for_inference()
    assert not folded.training
    valid = inputs["attention_mask"].bool()
    assert_close(folded(**inputs).logits[valid], expected[valid], **TOL)
    assert folded.optimize_for_inference() is folded  # folding twice changes nothing
    assert_close(folded(**inputs).logits[valid], expected[valid], **TOL)
    # the folded parameters still describe the same model when loaded unfolded
    folded.save_pretrained(tmp_path)
    reloaded = SWBertForMaskedLM.from_pretrained(tmp_path).eval()
    assert_close(reloaded(**inputs).logits[valid], expected[valid], **TOL)
    if variant == "shared":
        attn = folded.bert.encoder.layers[0].attn
        assert attn.folded == {"mixed": "query", "positive": "projection"}[signs]
        assert torch.equal(attn.dk, torch.ones_like(attn.dk))
        assert torch.equal(attn.dv, torch.ones_like(attn.dv))
        assert torch.equal(attn.dq, torch.ones_like(attn.dq)) == (signs == "positive")


def test_optimize_for_inference_on_a_classifier():
    torch.manual_seed(0)
    model = SWBertForSequenceClassification(tiny(attention_type="shared", num_labels=3))
    randomise(model)
    model.eval()
    inputs = batch()
    inputs.pop("labels")
    expected = model(**inputs).logits
    assert_close(copy.deepcopy(model).optimize_for_inference()(**inputs).logits, expected, **TOL)


def test_an_all_ones_attention_mask_takes_the_unmasked_path():
    ones = torch.ones(2, 5, dtype=torch.long)
    assert key_padding_mask(ones) is None
    padded = ones.clone()
    padded[1, 3:] = 0
    assert key_padding_mask(padded).shape == (2, 1, 1, 5)
    torch.manual_seed(0)
    model = SWBertForMaskedLM(tiny()).eval()
    ids = batch()["input_ids"]
    assert torch.equal(
        model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, model(input_ids=ids).logits
    )


def test_rebuild_hooks_hold_nothing_after_the_kernel_call():
    """The unpack hooks live as long as the graph; S must reach them only through what was packed
    (under checkpointing that is checkpointing's handle, which frees S until recomputation)."""
    torch.manual_seed(0)
    model = SWBertForMaskedLM(tiny(attention_type="shared")).train()
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, RebuildFromS)}
    loss = model(**batch()).loss  # the graph is alive until backward
    gc.collect()
    live = [o for o in gc.get_objects() if isinstance(o, RebuildFromS) and id(o) not in before]
    assert len(live) == model.config.num_hidden_layers
    assert all(h.s is None for h in live)
    del loss, live  # a graph discarded without backward is freed, hooks included
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, RebuildFromS) and id(o) not in before]


def test_compiled_model_gives_the_eager_loss_and_gradients():
    """`torch.compile` (the benchmark's and the trainer's `--compile`) computes what eager mode does:
    the shared fast path, the masked-positions gather and padding included. `nn.Module.compile`
    works in place, so parameter names (checkpoints, exports) do not change."""
    torch._dynamo.reset()
    eager = SWBertForMaskedLM(tiny(attention_type="shared"))
    randomise(eager)
    compiled = copy.deepcopy(eager)
    compiled.compile()
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    data = batch()
    losses = []
    for model in (eager, compiled):
        loss = model(**data).loss
        loss.backward()
        losses.append(loss)
    assert_close(losses[1], losses[0], **TOL)
    for name, g in grads(eager).items():
        assert_close(grads(compiled)[name], g, **TOL, msg=name)


@pytest.mark.parametrize("shape", [(3, 5, 7), (1,)])
def test_dropout_draws_for_any_size_and_any_p_below_one(shape):
    """Four elements share one 64-bit draw: sizes that are not a multiple of four still get a
    mask of their own shape, and p just below 1 still keeps a finite scale."""
    x = torch.ones(shape, requires_grad=True)
    for p in (0.5, 0.999999):
        y = attention_dropout(x, p, True)
        assert y.shape == x.shape and torch.isfinite(y).all()
        (grad,) = torch.autograd.grad(y.sum(), x)
        assert torch.equal(grad, y.detach())  # the same mask and scale as the forward


def test_tied_word_embedding_gradient_equals_the_dense_lookup():
    """The masked-LM model looks words up with a sparse gradient, which the tied decoder's dense one
    absorbs: the parameter gets the dense gradient of the plain lookup, [PAD] rows included (zero);
    an untied model and the encoder-only models keep the dense lookup."""
    model = SWBertForMaskedLM(tiny())
    randomise(model)
    word = model.bert.embeddings.word_embeddings
    assert word.sparse
    inputs = batch()
    inputs["input_ids"][-1, -3:] = model.config.pad_token_id
    model(**inputs).loss.backward()
    fast = grads(model)
    model.zero_grad()
    word.sparse = False
    model(**inputs).loss.backward()
    plain = grads(model)
    assert fast.keys() == plain.keys()
    for name, g in plain.items():
        assert not fast[name].is_sparse, name
        assert_close(fast[name], g, **TOL, msg=name)
    assert not SWBertForMaskedLM(tiny(tie_word_embeddings=False)).bert.embeddings.word_embeddings.sparse
    assert not SWBertForSequenceClassification(tiny()).bert.embeddings.word_embeddings.sparse


STEPS = """
import resource
import torch
from swbert import SWBertConfig, SWBertForMaskedLM
from swbert.training.dist import keep_freed_memory
took = keep_freed_memory()
torch.manual_seed(0)
# a BERT-sized vocabulary: the (vocab, d) gradients and logits are blocks above glibc's mmap threshold
model = SWBertForMaskedLM(SWBertConfig.from_size("tiny", vocab_size=30522, max_position_embeddings=128))
optimizer = torch.optim.AdamW(model.parameters())
ids = torch.randint(5, 30522, (8, 128))
labels = ids.clone()
labels[:, ::2] = -100
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model(input_ids=ids, labels=labels).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(took, *faults)
"""


@pytest.mark.parametrize("setting", ["keep", "system"])
def test_cpu_training_steps_reuse_freed_memory_without_page_faults(setting):
    """The trainer's CPU allocator setting: once warm, a training step takes the memory the last
    step freed from the heap instead of tens of thousands of fresh pages (now and then one block
    does not fit where it was, hence the median); SWBERT_CPU_MALLOC=system leaves glibc's default
    (and its faults) alone."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "SWBERT_CPU_MALLOC": setting, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", STEPS], env=env, capture_output=True, text=True, check=True)
    took, *faults = out.stdout.split()
    steady = sorted(int(f) for f in faults[2:])
    median = steady[len(steady) // 2]
    if setting == "keep":
        assert took == "True" and median < 1000, out.stdout
    else:
        assert took == "False" and median > 10_000, out.stdout


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(10, 16), (2, 5, 16)])
def test_vocab_blocked_decoder_equals_linear(shape, bias):
    """The CPU decoder computes its forward in vocabulary blocks (here 7 columns, 101 = 14 * 7 + 3):
    logits and the gradients of input, weight and bias are F.linear's."""
    from swbert.models.modeling import VocabDecoder

    torch.manual_seed(0)
    decoder = VocabDecoder(16, 101, bias=bias)
    decoder.block = 7
    x = torch.randn(shape, requires_grad=True)
    target = torch.randn(*shape[:-1], 101)
    plain = F.linear(x, decoder.weight, decoder.bias)
    blocked = decoder(x)
    assert blocked.grad_fn.name().endswith("_VocabBlockedLinearBackward")  # the blocked path ran
    assert_close(blocked, plain, **TOL)
    params = [x, decoder.weight] + ([decoder.bias] if bias else [])
    for got, want in zip(
        torch.autograd.grad((blocked * target).sum(), params),
        torch.autograd.grad((plain * target).sum(), params),
    ):
        assert_close(got, want, **TOL)


def test_out_projection_scales_its_input_through_the_weight():
    """Shared attention's dv rides on the output projection's weight: the output and the gradients
    of input, weight, scale and bias are those of scaling the input first; under bf16 autocast the
    parameter gradients come back in fp32, close to the fp32 ones."""
    from swbert.models.attention import OutProjection

    torch.manual_seed(0)
    proj = OutProjection(16, 12)
    scale = torch.nn.Parameter(torch.rand(16) + 0.5)
    x = torch.randn(3, 5, 16, requires_grad=True)
    target = torch.randn(3, 5, 12)
    params = [x, proj.weight, scale, proj.bias]
    folded = proj(x, input_scale=scale)
    plain = F.linear(x * scale, proj.weight, proj.bias)
    assert_close(folded, plain, **TOL)
    want = torch.autograd.grad((plain * target).sum(), params)
    for got, expected in zip(torch.autograd.grad((folded * target).sum(), params), want):
        assert_close(got, expected, **TOL)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = proj(x, input_scale=scale)
    assert low.dtype == torch.bfloat16
    got = torch.autograd.grad((low.float() * target).sum(), params)
    for g, p, expected in zip(got, params, want):
        assert g.dtype == p.dtype
        assert_close(g, expected, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("variant", ATTENTION_TYPES)
def test_last_layer_on_labels_equals_the_full_last_layer(variant, padded, checkpointing):
    """With labels the last layer computes only the labelled positions: loss, logits and every
    gradient are those of computing all positions and selecting after."""
    torch.manual_seed(0)
    model = SWBertForMaskedLM(tiny(attention_type=variant))
    randomise(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    inputs = batch(padded=padded)
    n_labelled = int((inputs["labels"] != -100).sum())
    rows_seen = []
    last_mlp = model.bert.encoder.layers[-1].mlp
    last_mlp.register_forward_hook(lambda m, args, out: rows_seen.append(args[0].shape[:-1]))
    results = []
    for on_labels in (True, False):
        model.zero_grad()
        model.last_layer_on_labels = on_labels
        out = model(**inputs)
        out.loss.backward()
        results.append((out.loss.detach(), out.logits.detach(), grads(model)))
    # the pruned pass ran the MLP on the labelled rows only (twice with checkpointing: recomputed)
    assert set(rows_seen) == {torch.Size([n_labelled]), inputs["labels"].shape}
    (loss, logits, g), (loss0, logits0, g0) = results
    assert logits.shape == logits0.shape == (n_labelled, 101)
    assert_close(loss, loss0, **TOL)
    assert_close(logits, logits0, **TOL)
    assert g.keys() == g0.keys() == {n for n, _ in model.named_parameters()}
    for name in g0:
        assert_close(g[name], g0[name], **TOL, msg=name)


def test_last_layer_on_labels_with_no_labelled_position_and_with_hidden_states():
    torch.manual_seed(0)
    model = SWBertForMaskedLM(tiny())
    inputs = batch()
    # nothing labelled: a zero loss that still backpropagates
    empty = dict(inputs, labels=torch.full_like(inputs["labels"], -100))
    out = model(**empty)
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.logits.shape == (0, 101)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    # hidden states need every position of the last layer: the full layer runs
    out = model(**inputs, output_hidden_states=True)
    assert out.hidden_states[-1].shape == (*inputs["labels"].shape, 64)
    model.last_layer_on_labels = False
    assert_close(out.logits, model(**inputs).logits, **TOL)
    with pytest.raises(ValueError, match="output_rows"):
        SWBertModel(tiny())(inputs["input_ids"], output_rows=inputs["labels"] != -100)  # with a pooler
