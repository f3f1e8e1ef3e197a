"""Every model-level optimisation (the same on every device) computes what the plain path computes:
outputs and gradients. The CPU kernels applied from outside are tested in test_cpu_kernels.py."""

import copy
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from benchmarks.train_step import activation_bytes
from swbert import SWBertConfig, SWBertForMaskedLM, SWBertForSequenceClassification
from swbert.models.attention import SelfAttention, SharedAttention
from swbert.models.modeling import SWBertModel, key_padding_mask
from swbert.training.wrappers import wrap_model
from tests.model_helpers import PAPER_VARIANTS, with_eager_kernels

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


def paper_forward(attn: SelfAttention, x: torch.Tensor, mask=None, rows=None) -> torch.Tensor:
    """The reference: the paper's Q, K, V materialised (`paper_qkv`), the kernel, the projection."""
    q, k, v = attn.paper_qkv(x)
    return attn.out_proj(attn.merge_heads(attn.kernel(q, k, v, mask), rows))


@pytest.fixture
def plain_shared(monkeypatch):
    """Switches SharedAttention to the paper's path: Q, K, V materialised, no output scale."""

    def use_plain() -> None:
        monkeypatch.setattr(SharedAttention, "forward", paper_forward)

    return use_plain


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_shared_layer_fast_path_equals_plain_path(kernel, padded, dropout):
    torch.manual_seed(0)
    attn = SharedAttention(tiny(attention_type="shared", attention_probs_dropout_prob=dropout))
    if kernel == "eager":
        with_eager_kernels(attn)
    randomise(attn)
    x = torch.randn(3, 12, 64)
    mask = torch.ones(3, 12, dtype=torch.bool)
    if padded:
        mask[1, 7:] = False
    mask = mask[:, None, None, :]
    w = torch.randn(3, 12, 64)  # a loss that weighs every output differently
    results = []
    for forward in (paper_forward, SharedAttention.forward):
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
    if checkpointing:  # recomputation in backward takes the same path
        wrap_model(model, activation_checkpointing="full", log_steps=False)
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


def test_shared_keeps_less_for_backward_than_standard_and_the_plain_path(plain_shared):
    """With a fused kernel (SDPA without dropout here; flash on a GPU, dropout included), shared keeps
    S and Q for backward where standard keeps Q, K and V, and the paper's form keeps S and all of
    Q, K, V. The output projection keeps its dv-scaled d x d weight besides (a quarter of a
    (B, S, d) unit at this shape)."""
    inputs = batch(B=8, S=32, padded=False)
    inputs.pop("attention_mask")
    sizes = {}
    for variant in ("standard", "shared"):
        torch.manual_seed(0)
        sizes[variant] = activation_bytes(SWBertForMaskedLM(tiny(attention_type=variant)).train(), inputs)
    plain_shared()
    torch.manual_seed(0)
    sizes["shared_plain"] = activation_bytes(SWBertForMaskedLM(tiny(attention_type="shared")).train(), inputs)
    config = tiny()
    unit = 8 * 32 * config.hidden_size * 4  # one (B, S, d) fp32 activation
    layers = config.num_hidden_layers
    assert sizes["standard"] - sizes["shared"] > 0.7 * layers * unit
    assert sizes["shared_plain"] - sizes["shared"] > 1.7 * layers * unit


@pytest.mark.parametrize(
    ("variant", "signs"), [(v, "mixed") for v in PAPER_VARIANTS] + [("shared", "positive")]
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
        assert type(attn).__name__ == {"mixed": "_FoldedQuery", "positive": "_FoldedProjection"}[signs]
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


def test_masks_cost_no_host_sync_and_unpadded_batches_carry_none():
    """The model uses a mask as given (no device read to drop an all-ones one); the collate, which
    knows the lengths on the host, leaves the mask out of a batch of equal lengths."""
    from swbert.finetune.glue_data import pad_collate

    ones = torch.ones(2, 5, dtype=torch.long)
    assert key_padding_mask(ones).shape == (2, 1, 1, 5) and key_padding_mask(None) is None
    with mock.patch.object(torch.Tensor, "__bool__", side_effect=AssertionError("host sync")):
        key_padding_mask(ones)
    item = {"input_ids": [2, 7, 3], "attention_mask": [1, 1, 1], "label": 1}
    assert "attention_mask" not in pad_collate(0)([item, dict(item)])
    short = {"input_ids": [2, 3], "attention_mask": [1, 1], "label": 0}
    assert pad_collate(0)([item, short])["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    window = {"input_ids": [2, 7, 0], "attention_mask": [1, 1, 0], "label": 0}  # padded before (SQuAD)
    assert pad_collate(0)([item, window])["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    torch.manual_seed(0)
    model = SWBertForMaskedLM(tiny()).eval()
    ids = batch()["input_ids"]
    assert torch.equal(
        model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, model(input_ids=ids).logits
    )


@pytest.mark.slow
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
@pytest.mark.parametrize("variant", PAPER_VARIANTS)
def test_last_layer_on_labels_equals_the_full_last_layer(variant, padded, checkpointing):
    """With labels the last layer computes only the labelled positions: loss, logits and every
    gradient are those of computing all positions and selecting after."""
    torch.manual_seed(0)
    model = SWBertForMaskedLM(tiny(attention_type=variant))
    randomise(model)
    if checkpointing:  # per block, as pretraining applies it
        wrap_model(model, activation_checkpointing="full", log_steps=False)
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
