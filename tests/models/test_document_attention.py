"""Document-aware attention in pretraining (ours, as ModernBERT): the documents packed into a sample
become the sequences of the variable-length path, so attention stays within each document. Held
equal to per-document attention: each document run alone, as a batch of one (logits, loss,
gradients, every variant; the head on every position and on the predicted rows only)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from swbert import SWBertForMaskedLM
from swbert.data.packing import document_seqlens
from swbert.data.tokenizer import CLS_ID, SEP_ID
from swbert.models.modeling import IGNORE_INDEX
from tests.models.test_unpadded import perturbed, tiny

VARIANTS = ("standard", "symmetric", "pairwise", "shared")
S = 12


def packed_batch() -> np.ndarray:
    """Two samples `[CLS] ... [SEP]`: three documents in the first (one of a single token), one in the
    second; words are ids >= 5 (the specials are below)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 101, size=(2, S))
    ids[:, 0], ids[:, -1] = CLS_ID, SEP_ID
    ids[0, 4] = ids[0, 6] = SEP_ID  # documents end at 4 and 6 in sample 0
    return ids


def test_the_documents_of_a_packed_batch_are_its_sequences():
    cu_seqlens, max_seqlen = document_seqlens(packed_batch())
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == [0, 5, 7, 12, 24] and max_seqlen == 12
    one = np.full((1, 6), 9)
    one[0, 0], one[0, -1] = CLS_ID, SEP_ID
    assert document_seqlens(one)[0].tolist() == [0, 6]  # a sample's own [SEP] starts nothing


def _model(variant: str) -> SWBertForMaskedLM:
    torch.manual_seed(0)
    return perturbed(SWBertForMaskedLM(tiny(variant)))


def _per_document(model: SWBertForMaskedLM, ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(B, S, vocab) logits, each document run alone as a batch of one."""
    flat = ids.reshape(-1)
    bounds = cu_seqlens.tolist()
    pieces = [
        model(input_ids=flat[a:b][None], masked_logits_only=False).logits[0]
        for a, b in zip(bounds, bounds[1:])
    ]
    return torch.cat(pieces).view(*ids.shape, -1)


def _labels(ids: torch.Tensor) -> torch.Tensor:
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[0, [1, 5, 9]] = ids[0, [1, 5, 9]]
    labels[1, [2, 10]] = ids[1, [2, 10]]
    return labels


@pytest.mark.parametrize("variant", VARIANTS)
def test_document_attention_equals_each_document_run_alone(variant):
    model = _model(variant).eval()
    ids = torch.from_numpy(packed_batch())
    cu_seqlens, max_seqlen = document_seqlens(packed_batch())
    labels = _labels(ids)

    out = model(
        input_ids=ids, labels=labels, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, masked_logits_only=False
    )
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    reference = _per_document(model, ids, cu_seqlens)
    rows = labels != IGNORE_INDEX
    ref_loss = torch.nn.functional.cross_entropy(reference[rows], labels[rows])
    ref_loss.backward()
    assert_close(out.logits, reference)
    assert_close(out.loss, ref_loss)
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert_close(grads[name], p.grad, msg=name)
    # and it is not the packed batch's plain attention, across documents
    assert not torch.allclose(model(input_ids=ids, masked_logits_only=False).logits, reference, atol=1e-4)


@pytest.mark.parametrize("variant", ["standard", "shared"])
def test_the_head_on_the_predicted_rows_reads_the_same_positions(variant):
    """Training's path: static positions, the last layer and the head on those rows only."""
    model = _model(variant).train()  # no dropout: the same function as in eval
    ids = torch.from_numpy(packed_batch())
    cu_seqlens, max_seqlen = document_seqlens(packed_batch())
    positions = torch.tensor([[1, 5, 9], [2, 10, 0]])
    targets = torch.tensor([[7, 8, 9], [10, 11, IGNORE_INDEX]])
    out = model(
        input_ids=ids,
        mlm_positions=positions,
        mlm_targets=targets,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
    )
    with torch.no_grad():
        reference = _per_document(model, ids, cu_seqlens)
    rows = reference[torch.arange(2).repeat_interleave(3), positions.reshape(-1)]
    assert_close(out.logits, rows)
    assert_close(out.loss, torch.nn.functional.cross_entropy(rows, targets.reshape(-1)))


def test_a_packed_batch_with_documents_takes_no_padding_mask():
    model = _model("shared")
    ids = torch.from_numpy(packed_batch())
    cu_seqlens, max_seqlen = document_seqlens(packed_batch())
    with pytest.raises(ValueError, match="has no padding: pass no attention_mask"):
        model(
            input_ids=ids, attention_mask=torch.ones_like(ids), cu_seqlens=cu_seqlens, max_seqlen=max_seqlen
        )
