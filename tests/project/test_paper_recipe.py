"""The paper's pretraining recipe holds the paper's values, and its token budget is 20 real epochs."""

from __future__ import annotations

import math

from swbert.data.corpus import open_corpus
from swbert.data.packing import PackedSequences
from swbert.training.budget import epochs_budget, main
from swbert.training.config import build_config


def test_paper_base_holds_the_papers_values():
    cfg = build_config("paper_base", [])
    assert (cfg.size, cfg.attention_type, cfg.seq_len, cfg.global_batch_size) == ("base", "shared", 512, 528)
    assert (cfg.adam_beta2, cfg.mlm_probability, cfg.hidden_dropout) == (0.999, 0.15, 0.1)
    assert (cfg.adam_beta1, cfg.attention_dropout) == (0.9, 0.1)  # section 2.5 states both too
    # four GPUs at 132 sequences each make the global batch with no accumulation
    assert cfg.batch_layout(4) == (528, 132, 1)
    # 20 epochs of the estimated corpus (3.3e9 tokens) as the trainer counts steps
    assert cfg.train_tokens == 20 * 3_300_000_000
    assert math.ceil(cfg.train_tokens / (528 * 512)) == 244_141
    # the values the paper leaves open are set (ours), not left at the tiny defaults
    assert (cfg.lr, cfg.warmup_steps, cfg.lr_schedule, cfg.weight_decay) == (1e-4, 10_000, "linear", 0.01)
    other = build_config("base_shared", [])
    assert (other.seq_len, other.global_batch_size) == (128, 4096)  # ours, for throughput


def test_budget_counts_the_sequences_the_trainer_packs(data_dir, capsys):
    sequences = len(PackedSequences(open_corpus(data_dir, "train"), 64))
    budget = epochs_budget(data_dir, 20, 64, 8)
    assert budget.sequences_per_epoch == sequences
    assert budget.train_tokens == 20 * sequences * 64
    assert budget.steps == math.ceil(20 * sequences / 8)  # 20 passes over every sequence
    assert main([str(data_dir), "--seq-len", "64", "--global-batch-size", "8"]) == 0
    assert f"--train-tokens {20 * sequences * 64}" in capsys.readouterr().out
    assert main([str(data_dir / "nowhere")]) == 2
    assert "manifest.json is missing" in capsys.readouterr().err
