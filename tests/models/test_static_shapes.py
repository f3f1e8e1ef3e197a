"""The static-shape masked-LM path: P predictions per sequence (`mlm_positions`, `mlm_labels`).

It computes what the label-mask path computes (loss, logits at the predicted rows, every
gradient), for every attention variant and at TP=2; and a training forward and backward compile
with no graph break (`fullgraph=True`), which the label-mask path cannot (its shapes depend on
the data).
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from swbert.models import SWBertConfig, SWBertForMaskedLM
from swbert.models.attention import attention_types
from swbert.models.modeling import IGNORE_INDEX

VOCAB, B, S, P = 96, 3, 16, 4


def _config(attention_type: str) -> SWBertConfig:
    return SWBertConfig.from_size(
        "tiny",
        attention_type=attention_type,
        vocab_size=VOCAB,
        max_position_embeddings=S,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def static_batch(seed: int = 0, counts: tuple[int, ...] = (4, 2, 1)) -> dict[str, torch.Tensor]:
    """Token ids, the (B, S) labels, and the same predictions as (B, P) positions and labels,
    padded with position 0 and IGNORE_INDEX; row b predicts counts[b] tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (B, S), generator=g)
    labels = torch.full((B, S), IGNORE_INDEX)
    positions = torch.zeros(B, P, dtype=torch.long)
    mlm_labels = torch.full((B, P), IGNORE_INDEX)
    for b, k in enumerate(counts):
        picked = torch.randperm(S - 2, generator=g)[:k].sort().values + 1
        labels[b, picked] = ids[b, picked]
        positions[b, :k] = picked
        mlm_labels[b, :k] = ids[b, picked]
    return {"input_ids": ids, "labels": labels, "mlm_positions": positions, "mlm_labels": mlm_labels}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_batch_with_no_prediction_gives_a_zero_loss_that_backpropagates():
    model = SWBertForMaskedLM(_config("shared")).train()
    batch = static_batch()
    out = model(
        input_ids=batch["input_ids"],
        mlm_positions=batch["mlm_positions"],
        mlm_targets=torch.full_like(batch["mlm_labels"], IGNORE_INDEX),
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and all(
        torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None
    )


@pytest.mark.slow
@pytest.mark.parametrize("attention_type", attention_types())
def test_training_step_compiles_without_graph_breaks(attention_type):
    """`fullgraph=True` fails on any graph break in the forward; AOTAutograd traces the backward of
    that one graph (the `aot_eager` backend needs no C++ compiler, so this runs on any CPU)."""
    torch.manual_seed(0)
    config = SWBertConfig.from_size(
        "tiny", attention_type=attention_type, vocab_size=VOCAB, max_position_embeddings=S
    )  # dropout on: it must trace too
    model = SWBertForMaskedLM(config).train()
    batch = static_batch()
    inputs = {
        "input_ids": batch["input_ids"],
        "mlm_positions": batch["mlm_positions"],
        "mlm_targets": batch["mlm_labels"],
    }
    explanation = torch._dynamo.explain(lambda **kw: model(**kw).loss)(**inputs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()

    def loss_of(m: torch.nn.Module) -> torch.Tensor:
        torch.manual_seed(1)  # the same dropout masks in both runs
        return m(**inputs).loss

    eager = loss_of(model)
    eager.backward()
    expected = _grads(model)
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got = loss_of(compiled)
    got.backward()
    assert_close(got, eager)
    for name, grad in _grads(model).items():
        assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
    torch._dynamo.reset()


def _tp_static(attention_type: str) -> None:
    from swbert.parallel import destroy, gather_tensors, initialize, parallelize
    from tests.parallel.test_parallel_harness import reference_model

    config = _config(attention_type)
    ref = reference_model(config)
    model = SWBertForMaskedLM(config)
    model.load_state_dict(ref.state_dict())
    initialize(2)
    parallelize(model, 2)
    full = static_batch()
    batch = {
        "input_ids": full["input_ids"],
        "mlm_positions": full["mlm_positions"],
        "mlm_targets": full["mlm_labels"],
    }
    expected, got = ref(**batch), model(**batch)
    expected.loss.backward()
    got.loss.backward()
    assert_close(got.loss, expected.loss)
    assert_close(got.logits, expected.logits)
    grads = gather_tensors({n: p.grad for n, p in model.named_parameters()}, config)
    for name, grad in grads.items():
        assert_close(grad, dict(ref.named_parameters())[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    destroy()


@pytest.mark.slow
def test_static_path_at_tp2_equals_tp1():
    """The vocab-parallel loss ignores the padding rows as the TP=1 loss does."""
    from tests.parallel.test_parallel_harness import run_ranks

    run_ranks(_tp_static, 2, "shared")


def test_transformers_trainer_still_finds_only_labels():
    """transformers' Trainer treats every forward argument with "label" in its name as a label:
    the static path's targets must not be one, or Trainer.evaluate would find no labels."""
    from transformers.utils import find_labels

    assert find_labels(SWBertForMaskedLM) == ["labels"]
