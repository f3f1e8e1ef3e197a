"""Local/global attention (`local_attention_window`, `global_attention_every`; ours, ModernBERT's
definition): the model equals full attention under an explicit band-and-padding mask written here,
for every variant, with learned or rotary positions; the unpadded stream bands each document; the
fused variable-length kernels get the band as their window; bad input is one line naming the key."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from swbert.models import SWBertConfig, SWBertForMaskedLM, varlen as varlen_module
from swbert.models.attention import SelfAttention, attention_types
from swbert.models.varlen import SeqLens, per_sequence_attention, unpad_input, varlen_attention
from tests.model_helpers import with_eager_kernels
from tests.models.test_rope import perturbed

VOCAB, WINDOW, EVERY = 96, 4, 2  # tiny has 2 layers: layer 0 global, layer 1 local (2 keys each side)


def local_config(attention_type: str, **overrides: object) -> SWBertConfig:
    fields = dict(
        attention_type=attention_type,
        vocab_size=VOCAB,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        local_attention_window=WINDOW,
        global_attention_every=EVERY,
    )
    return SWBertConfig.from_size("tiny", **{**fields, **overrides})


class ExplicitMaskKernel(nn.Module):
    """Ignores the mask the model passes: softmax attention written out under this test's own mask
    (B, S, S) for its layer, True where a query may see a key."""

    def __init__(self, allowed: torch.Tensor) -> None:
        super().__init__()
        self.allowed = allowed

    def forward(self, q, k, v, _mask) -> torch.Tensor:
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, S, S)
        scores = scores.masked_fill(~self.allowed[:, None], float("-inf"))
        return scores.softmax(-1) @ v


def explicit_masks(padding: torch.Tensor, layers: int) -> list[torch.Tensor]:
    """Per layer: keys that are real tokens, and on local layers (i % EVERY != 0) within WINDOW / 2
    positions of the query, written with loops."""
    B, S = padding.shape
    out = []
    for layer in range(layers):
        allowed = torch.zeros(B, S, S, dtype=torch.bool)
        for b in range(B):
            for i in range(S):
                for j in range(S):
                    near = layer % EVERY == 0 or abs(i - j) <= WINDOW // 2
                    allowed[b, i, j] = bool(padding[b, j]) and near
        out.append(allowed)
    return out


def reference_of(model: SWBertForMaskedLM, padding: torch.Tensor) -> SWBertForMaskedLM:
    """A copy of `model` whose every layer runs `ExplicitMaskKernel` under `explicit_masks`."""
    ref = SWBertForMaskedLM(model.config).eval()
    ref.load_state_dict(model.state_dict())
    layers = [m for m in ref.modules() if isinstance(m, SelfAttention)]
    for attn, allowed in zip(layers, explicit_masks(padding, len(layers))):
        attn.kernel = ExplicitMaskKernel(allowed)
    return ref


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    return ids, mask


@pytest.mark.parametrize("position_embedding", ["learned", "rope"])
@pytest.mark.parametrize("attention_type", attention_types())
def test_local_layers_equal_full_attention_under_an_explicit_band_mask(attention_type, position_embedding):
    model = perturbed(SWBertForMaskedLM(local_config(attention_type, position_embedding=position_embedding)))
    assert model.bert.encoder.local_layers == [False, True]
    ids, mask = batch()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        expected = reference_of(model, mask)(input_ids=ids, attention_mask=mask).logits
        real = mask.bool()
        assert_close(got[real], expected[real], rtol=1e-4, atol=1e-5)
        # the band matters: the same weights attending globally compute something else
        full = SWBertForMaskedLM(
            local_config(attention_type, position_embedding=position_embedding, local_attention_window=None)
        ).eval()
        full.load_state_dict(model.state_dict())
        assert not torch.allclose(full(input_ids=ids, attention_mask=mask).logits[real], got[real], atol=1e-3)


def test_long_padding_stays_finite_in_the_written_out_kernel():
    """Padding queries beyond the band of every real token: the eager kernel (tensor parallelism's
    in training with dropout) stays finite over 4 layers and equals SDPA at the real tokens."""
    model = perturbed(SWBertForMaskedLM(local_config("shared", num_hidden_layers=4)))
    ids, mask = batch(2)
    with torch.no_grad():
        fused = model(input_ids=ids, attention_mask=mask).logits
        eager = with_eager_kernels(model)(input_ids=ids, attention_mask=mask).logits
    assert torch.isfinite(eager).all() and torch.isfinite(fused).all()
    assert_close(eager[mask.bool()], fused[mask.bool()], rtol=1e-4, atol=1e-5)


def test_modernbert_pattern_every_third_layer_global_from_layer_0():
    config = SWBertConfig.from_size("tiny", num_hidden_layers=7, local_attention_window=128)
    assert [config.attention_window(i) for i in range(7)] == [None, 64, 64, None, 64, 64, None]
    assert SWBertConfig.from_size("tiny", local_attention_window=0).local_attention_window is None
    off = SWBertConfig.from_size("tiny", num_hidden_layers=4)
    assert all(off.attention_window(i) is None for i in range(4)) and not off.bert_differences()


@pytest.mark.parametrize("position_embedding", ["learned", "rope"])
def test_unpadded_stream_bands_each_document(position_embedding):
    """The stream's local layers see their own document within the window, as the padded rows do."""
    model = perturbed(SWBertForMaskedLM(local_config("shared", position_embedding=position_embedding)))
    ids, mask = batch(1)
    with torch.no_grad():
        padded = model.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        stream = unpad_input(ids, mask)
        unpadded = model.bert(
            input_ids=stream.input_ids, cu_seqlens=stream.cu_seqlens, max_seqlen=stream.max_seqlen
        ).last_hidden_state
    assert_close(unpadded, padded.reshape(-1, padded.shape[-1])[stream.indices], rtol=1e-4, atol=1e-5)


def _flash_window_semantics(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, -1)):
    """What the fused kernels document for window_size=(left, right): query i of a sequence sees its
    keys j with i - left <= j <= i + right ((-1, -1): all). Inputs (T, H, Dh)."""
    out = torch.empty_like(q)
    left, right = window_size
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        i = torch.arange(b - a)[:, None]
        j = torch.arange(b - a)[None]
        seen = torch.ones(b - a, b - a, dtype=torch.bool) if left < 0 else (j >= i - left) & (j <= i + right)
        qs, ks, vs = (t[a:b].transpose(0, 1).float() for t in (q, k, v))  # (H, L, Dh)
        scores = (qs @ ks.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~seen, float("-inf"))
        out[a:b] = (scores.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
    return out


def test_the_fused_varlen_kernel_gets_the_band_as_its_window(monkeypatch):
    """The kernels themselves need a GPU; here one that follows their documented window semantics
    stands in, and the fused call must equal the per-sequence reference with the band."""
    monkeypatch.setattr(varlen_module, "varlen_kernel", lambda *_: "torch.nn.attention.varlen")
    monkeypatch.setattr(varlen_module, "_torch_varlen", lambda: _flash_window_semantics)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 13, 8, dtype=torch.bfloat16) for _ in range(3))
    seqlens = SeqLens(torch.tensor([0, 6, 13], dtype=torch.int32), 7)

    def dense(q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=mask
        )

    for windowed in (seqlens, seqlens.windowed(2)):
        fused = varlen_attention(q, k, v, windowed, 0.0, dense)
        assert_close(fused.float(), per_sequence_attention(q, k, v, windowed, dense), rtol=2e-2, atol=2e-2)
    banded, full = (varlen_attention(q, k, v, s, 0.0, dense) for s in (seqlens.windowed(2), seqlens))
    assert not torch.allclose(banded.float(), full.float(), atol=1e-2)


def test_bad_input_is_one_line_naming_the_key():
    from swbert.training.config import build_config

    with pytest.raises(ValueError, match=r"^local_attention_window=256 is wider than seq_len=128;") as err:
        build_config(None, ["--local-attention-window", "256", "--seq-len", "128"])
    assert "\n" not in str(err.value)
    assert (
        build_config(None, ["--local-attention-window", "128", "--seq-len", "128"]).local_attention_window
        == 128
    )
    for window in (7, -2, 2.5, "wide"):
        with pytest.raises(ValueError, match=r"^local_attention_window=.* must be an even number of tokens"):
            local_config("shared", local_attention_window=window)
    for every in (0, -1, 1.5):
        with pytest.raises(ValueError, match=r"^global_attention_every=.* must be a positive integer"):
            local_config("shared", global_attention_every=every)
    from swbert.convert import to_hf_bert

    with pytest.raises(ValueError, match="local_attention_window=4 has no transformers BERT equivalent"):
        to_hf_bert(SWBertForMaskedLM(local_config("standard")))
