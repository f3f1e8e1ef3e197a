"""Unpadded execution (swbert.models.varlen) equals the padded path: logits, loss and gradients, for
every attention variant and head; attention never crosses sequences; bad input is named."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from swbert import SWBertConfig, SWBertForQuestionAnswering, SWBertForSequenceClassification
from swbert.models.attention import (
    ATTENTION_CLASSES,
    SelfAttention,
    register_attention,
    unregister_attention,
)
from swbert.models.varlen import SeqLens, pad_output, unpad_input, unpad_like
from swbert.runtime.cpu import optimize_for_cpu
from tests.model_helpers import with_eager_kernels

VARIANTS = ("standard", "symmetric", "pairwise", "shared")
LENGTHS = (1, 12, 5, 9)  # ragged: a length-1 sequence and a full-length one (S = 12)
S = max(LENGTHS)


def tiny(variant: str, **overrides) -> SWBertConfig:
    return SWBertConfig.from_size(
        "tiny",
        vocab_size=101,
        max_position_embeddings=16,
        attention_type=variant,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **overrides,
    )


def padded_batch(lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 101, (len(lengths), S), generator=g)
    mask = (torch.arange(S)[None] < torch.tensor(lengths)[:, None]).long()
    types = (torch.arange(S)[None] >= torch.tensor(lengths)[:, None] // 2).long() * mask
    return {"input_ids": ids * mask, "attention_mask": mask, "token_type_ids": types}


def unpadded(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | int]:
    flat = unpad_input(batch["input_ids"], batch["attention_mask"])
    return {
        "input_ids": flat.input_ids,
        "token_type_ids": unpad_like(batch["token_type_ids"], flat.indices),
        "cu_seqlens": flat.cu_seqlens,
        "max_seqlen": flat.max_seqlen,
    }


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Parameters away from their initial values (dq, dk, dv at ones, U the identity hide bugs)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def labels_for(head: str) -> dict[str, torch.Tensor]:
    if head == "classification":
        return {"labels": torch.tensor([0, 2, 1, 2])}
    if head == "regression":
        return {"labels": torch.tensor([0.5, -1.0, 2.0, 0.0])}
    return {"start_positions": torch.tensor([0, 3, 1, 8]), "end_positions": torch.tensor([0, 7, 4, 8])}


def build(variant: str, head: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if head == "qa":
        return perturbed(SWBertForQuestionAnswering(tiny(variant)))
    return perturbed(
        SWBertForSequenceClassification(tiny(variant, num_labels=1 if head == "regression" else 3))
    )


def run(model: torch.nn.Module, inputs: dict, labels: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Outputs and parameter gradients of one training-mode forward and backward."""
    model.zero_grad(set_to_none=True)
    out = model.train()(**inputs, **labels)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    keys = ("loss", "logits", "start_logits", "end_logits")
    return {k: out[k].detach() for k in keys if out.get(k) is not None}, grads


def assert_same(model: torch.nn.Module, head: str) -> None:
    batch = padded_batch()
    labels = labels_for(head)
    ref, ref_grads = run(model, batch, labels)
    got, got_grads = run(model, unpadded(batch), labels)
    assert ref.keys() == got.keys()
    for key in ref:
        assert_close(got[key], ref[key], msg=key)
    assert ref_grads.keys() == got_grads.keys() and ref_grads
    for name in ref_grads:
        assert_close(got_grads[name], ref_grads[name], msg=name)


@pytest.mark.parametrize("head", ["classification", "regression", "qa"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_unpadded_equals_padded(variant, head):
    assert_same(build(variant, head), head)


def test_unpadded_equals_padded_with_eager_and_cpu_kernels():
    torch.manual_seed(0)
    eager = perturbed(with_eager_kernels(SWBertForQuestionAnswering(tiny("shared"))))
    assert_same(eager, "qa")
    cpu = build("pairwise", "classification")
    assert optimize_for_cpu(cpu) == ["attention"]
    assert_same(cpu, "classification")


class _ScaledStandard(SelfAttention):
    """A variant from outside: standard-like attention with the queries halved."""

    qkv_plan = {"q_proj": "column", "kv_proj": "column"}

    def __init__(self, config: SWBertConfig) -> None:
        super().__init__(config)
        self.q_proj = torch.nn.Linear(config.hidden_size, config.hidden_size)
        self.kv_proj = torch.nn.Linear(config.hidden_size, 2 * config.hidden_size)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k, v = self.split_packed_heads(self.kv_proj(x), 2)
        return self.split_heads(self.q_proj(x) * 0.5), k, v


def test_registered_plugin_runs_unpadded():
    register_attention("scaled_test")(_ScaledStandard)
    try:
        assert "scaled_test" in ATTENTION_CLASSES
        assert_same(build("scaled_test", "regression"), "regression")
    finally:
        unregister_attention("scaled_test")


def seq0_outputs(model: torch.nn.Module, seed: int) -> torch.Tensor:
    """The QA logits of sequence 0 when sequence 1's tokens are drawn with `seed`."""
    batch = padded_batch(seed=0)
    other = padded_batch(seed=seed)
    batch["input_ids"][1] = other["input_ids"][1]
    with torch.no_grad():
        out = model.eval()(**unpadded(batch))
    return out.start_logits[0, : LENGTHS[0]]


@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_never_crosses_sequences(variant, monkeypatch):
    model = build(variant, "qa")
    seq0 = padded_batch()["input_ids"][0, 0]
    assert torch.equal(seq0_outputs(model, seed=1), seq0_outputs(model, seed=2))
    # the check catches a leak: a kernel that takes the stream for one sequence
    with monkeypatch.context() as m:
        m.setattr(SeqLens, "bounds", lambda self: [0, int(self.cu_seqlens[-1])])
        assert not torch.equal(seq0_outputs(model, seed=1), seq0_outputs(model, seed=2)), seq0


def test_positions_restart_and_token_types_follow():
    seqlens = SeqLens(torch.tensor([0, 1, 4, 6], dtype=torch.int32), 3)
    assert seqlens.position_ids(6).tolist() == [0, 0, 1, 2, 0, 1]
    assert seqlens.seq_index(6).tolist() == [0, 1, 1, 1, 2, 2]
    batch = padded_batch()
    flat = unpadded(batch)
    assert flat["cu_seqlens"].dtype == torch.int32 and flat["cu_seqlens"].tolist() == [0, 1, 13, 18, 27]
    assert flat["max_seqlen"] == S
    assert flat["token_type_ids"][1:13].tolist() == batch["token_type_ids"][1].tolist()


def test_pad_output_inverts_unpad_input():
    batch = padded_batch()
    flat = unpad_input(batch["input_ids"], batch["attention_mask"])
    back = pad_output(flat.input_ids, flat.indices, len(LENGTHS), S, fill=-1)
    assert torch.equal(back, batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -1))


def test_sequence_longer_than_positions_names_its_index():
    model = build("shared", "classification")
    batch = padded_batch()
    flat = unpadded(batch)
    long = torch.randint(5, 101, (20,))  # max_position_embeddings is 16
    ids = torch.cat([flat["input_ids"][:13], long])
    cu = torch.tensor([0, 1, 13, 33], dtype=torch.int32)
    with pytest.raises(
        ValueError, match=r"sequence 2 of the batch has 20 tokens, more than max_position_embeddings=16"
    ):
        model(input_ids=ids, cu_seqlens=cu, max_seqlen=20)


def test_left_padding_is_refused_by_row():
    batch = padded_batch()
    mask = batch["attention_mask"].flip(1)
    with pytest.raises(ValueError, match="attention_mask row 0 is not right-padded"):
        unpad_input(batch["input_ids"], mask)


def test_which_varlen_kernel_a_device_gets(monkeypatch):
    import swbert.models.varlen as varlen

    monkeypatch.setattr(varlen, "_has_flash_attn", lambda: False)
    assert varlen.varlen_kernel("cpu") is None
    assert varlen.varlen_kernel("cuda", 0.0) == "torch.nn.attention.varlen"  # torch 2.13 has it
    assert varlen.varlen_kernel("cuda", 0.1) is None  # torch's kernel has no dropout
    monkeypatch.setattr(varlen, "_has_flash_attn", lambda: True)
    assert varlen.varlen_kernel("cuda", 0.1) == "flash_attn"
    assert varlen.varlen_kernel("cpu", 0.0) is None
