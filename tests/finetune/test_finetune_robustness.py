"""Embedding-noise robustness: level 0 is the clean evaluation; the noise has the stated scale."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader

from swbert.finetune.glue import GlueSweep, evaluate_task, load_classifier, load_task_data
from swbert.finetune.glue_data import pad_collate
from swbert.finetune.robustness import (
    DEFAULT_LEVELS,
    embedding_noise,
    evaluate_under_noise,
    mean_embedding_norm,
)
from swbert.finetune.synthetic import write_glue_fixture
from swbert.finetune.tasks import get_task
from swbert.finetune.trainer import predict
from tests.finetune_fixtures import make_checkpoint, make_tokenizer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend
    root = tmp_path_factory.mktemp("noise")
    write_glue_fixture(root / "glue", ["sst2"], n_train=8, n_dev=96)
    ckpt = make_checkpoint(root / "ckpt")
    task = get_task("sst2")
    tok = make_tokenizer()
    model = load_classifier(ckpt, task).eval()
    sweep = GlueSweep(checkpoint=[str(ckpt)], output_dir=root, data_dir=root / "glue", max_seq_length=32)
    data = load_task_data(task, tok, sweep, model.config, with_train=False)
    collate = pad_collate(tok.pad_token_id)
    yield model, data, collate
    torch.set_num_threads(threads)


def test_paper_levels():
    assert DEFAULT_LEVELS == (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4)


def test_level_zero_is_the_clean_evaluation(setup):
    model, data, collate = setup
    _, enc = data.dev["validation"]
    (clean,) = predict(model, enc, collate)
    with embedding_noise(model, 0.0, mean_norm=1.0, seed=0):
        assert torch.equal(torch.from_numpy(predict(model, enc, collate)[0]), torch.from_numpy(clean))
    with embedding_noise(model, 0.3, mean_norm=1.0, seed=0):
        assert not torch.equal(torch.from_numpy(predict(model, enc, collate)[0]), torch.from_numpy(clean))
    assert not model.get_input_embeddings()._forward_hooks  # the hook is removed on exit
    results = evaluate_under_noise(
        model, lambda m: evaluate_task(m, data, collate), 1.0, levels=[0.0, 0.2], seeds=[0, 1]
    )
    assert results[(0.0, 0)] == results[(0.0, 1)] == evaluate_task(model, data, collate)


def test_mean_norm_is_over_real_tokens(setup):
    model, data, collate = setup
    _, enc = data.dev["validation"]
    got = mean_embedding_norm(model, DataLoader(enc, batch_size=7, collate_fn=collate))
    weight = model.get_input_embeddings().weight.detach()
    ids = torch.tensor([t for i in range(len(enc)) for t in enc[i]["input_ids"]])  # unpadded
    assert got == pytest.approx(weight[ids].norm(dim=-1).mean().item(), rel=1e-5)
    assert got != pytest.approx(weight.norm(dim=-1).mean().item(), rel=1e-3)  # not the vocabulary mean


def added_noise(model, enc, collate, level: float, mean_norm: float, scale: str) -> torch.Tensor:
    """(tokens, d): what `embedding_noise` added to the word embeddings of the whole dev split."""
    emb = model.get_input_embeddings()
    batch = collate([enc[i] for i in range(len(enc))])
    clean = emb(batch["input_ids"]).detach()
    seen = []
    with torch.no_grad(), embedding_noise(model, level, mean_norm, seed=3, scale=scale):
        handle = emb.register_forward_hook(lambda m, i, out: seen.append(out.detach()))
        model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
        handle.remove()
    return (seen[0] - clean).reshape(-1, clean.shape[-1])


@pytest.mark.parametrize("level", [0.05, 0.4])
def test_noise_scale_is_the_stated_fraction_of_the_mean_norm(setup, level):
    model, data, collate = setup
    _, enc = data.dev["validation"]
    mean_norm = mean_embedding_norm(model, DataLoader(enc, batch_size=32, collate_fn=collate))
    noise = added_noise(model, enc, collate, level, mean_norm, "norm")
    rms = noise.norm(dim=-1).pow(2).mean().sqrt().item()
    assert rms == pytest.approx(level * mean_norm, rel=0.03)
    # spherical: every coordinate has the same spread
    per_dim = noise.std(dim=0)
    assert per_dim.std().item() / per_dim.mean().item() < 0.1
    sigma = level * mean_norm / math.sqrt(noise.shape[-1])
    assert noise.mean().abs().item() < 0.05 * sigma  # zero-mean


def test_noise_seeds_are_reproducible_and_distinct(setup):
    model, data, collate = setup
    _, enc = data.dev["validation"]

    def logits(seed):
        with embedding_noise(model, 0.2, 1.0, seed=seed):
            return predict(model, enc, collate)[0]

    assert (logits(1) == logits(1)).all()
    assert not (logits(1) == logits(2)).all()


@pytest.mark.parametrize("level", [0.05, 0.4])
def test_unit_noise_has_the_papers_standard_deviation_times_the_level(setup, level):
    """The paper's definition: each coordinate N(0, 1) scaled by the level, whatever the embeddings' size."""
    model, data, collate = setup
    _, enc = data.dev["validation"]
    noise = added_noise(model, enc, collate, level, 123.0, "unit")
    assert noise.std().item() == pytest.approx(level, rel=0.03)  # the mean norm plays no part
    with pytest.raises(ValueError, match="noise scale 'other' is not one of unit, norm"):
        with embedding_noise(model, level, 1.0, seed=0, scale="other"):  # type: ignore[arg-type]
            pass
