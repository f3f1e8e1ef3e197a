"""SQuAD v1.1 / v2.0 fine-tuning sweeps (the paper's Table 2).

Same loop and bookkeeping as GLUE (:mod:`swbert.finetune.glue`): every (checkpoint, version, learning
rate, seed) is one MLflow child run; the reported number is the median over seeds at the best
learning rate by dev F1. Scores are the official scripts' (percent).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from swbert import SWBertForQuestionAnswering
from swbert.finetune.checkpoint import Checkpoint, load_tokenizer, save_finetuned, uses_token_types
from swbert.finetune.glue_data import EncodedDataset, pad_collate
from swbert.finetune.metrics import best_null_threshold, squad_scores
from swbert.finetune.results import Summary, Trial, nest_metrics, prune_models, summarize
from swbert.finetune.squad_data import (
    SquadEvalFeatures,
    SquadExample,
    encode_squad_eval,
    encode_squad_train,
    read_squad_hub,
    read_squad_json,
)
from swbert.finetune.squad_post import decode_spans
from swbert.finetune.tracking import CHECKPOINT, KIND, TASK, VARIANT, Tracker
from swbert.finetune.trainer import TrainConfig, dist_info, fit, move, progress_bar, set_seed

log = logging.getLogger(__name__)

SPLIT = "validation"


def task_name(version: str) -> str:
    return f"squad{version}"


@dataclass
class SquadSweep:
    """Everything one ``finetune_squad.py`` invocation does."""

    checkpoints: list[Checkpoint]
    versions: list[str] = field(default_factory=lambda: ["1.1", "2.0"])
    train_files: dict[str, Path] = field(default_factory=dict)
    """version -> official train JSON; a version without one comes from the Hub."""
    dev_files: dict[str, Path] = field(default_factory=dict)
    output_dir: Path = Path("runs/squad")
    learning_rates: list[float] = field(default_factory=lambda: [1e-4])
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=3))
    max_seq_length: int = 384
    doc_stride: int = 128
    n_best: int = 20
    max_answer_length: int = 30
    null_threshold: float = 0.0
    attention_dropout: float = 0.1
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    keep: Literal["none", "median", "all"] = "median"
    tokenizer: Path | None = None


def load_squad(version: str, split: Literal["train", "validation"], path: Path | None) -> list[SquadExample]:
    if version not in ("1.1", "2.0"):
        raise ValueError(f"--version {version}: SQuAD versions are 1.1 and 2.0")
    return read_squad_json(path, version) if path else read_squad_hub(version, split)


@torch.no_grad()
def predict_spans(
    model: nn.Module, dataset: EncodedDataset, collate, batch_size: int = 128
) -> tuple[np.ndarray, np.ndarray]:
    device = next(model.parameters()).device
    starts, ends = [], []
    for batch in DataLoader(dataset, batch_size=batch_size, collate_fn=collate):
        out = model(**move(batch, device))
        starts.append(out.start_logits.float().cpu())
        ends.append(out.end_logits.float().cpu())
    return torch.cat(starts).numpy(), torch.cat(ends).numpy()


def evaluate_squad(
    model: nn.Module,
    examples: list[SquadExample],
    features: SquadEvalFeatures,
    collate,
    sweep: SquadSweep,
    version: str,
) -> dict[str, float]:
    """Official EM/F1 (plus v2.0's HasAns/NoAns and best-threshold scores), flat as ``validation/<metric>``."""
    start, end = predict_spans(model, features.dataset, collate, sweep.train.eval_batch_size)
    preds = decode_spans(
        examples, features, start, end, version, sweep.n_best, sweep.max_answer_length, sweep.null_threshold
    )
    refs = {ex.qid: ex.answers for ex in examples}
    scores = squad_scores(preds.answers, refs, version)
    if version == "2.0":
        scores |= best_null_threshold(preds.best_spans, preds.null_score_diffs, refs)
    return {f"{SPLIT}/{k}": v for k, v in scores.items()}


def run_squad_trial(
    sweep: SquadSweep,
    ckpt: Checkpoint,
    version: str,
    tokenizer,
    train_set: EncodedDataset,
    dev_ex: list[SquadExample],
    dev_feats: SquadEvalFeatures,
    lr: float,
    seed: int,
    tracker: Tracker,
) -> Trial:
    """Fine-tune one (checkpoint, version, learning rate, seed) and log it as a child run."""
    name = task_name(version)
    collate = pad_collate(tokenizer.pad_token_id)
    cfg = TrainConfig(**{**vars(sweep.train), "learning_rate": lr, "seed": seed})
    tags = {KIND: "squad_trial", VARIANT: ckpt.name, TASK: name, CHECKPOINT: str(ckpt.path)}
    params = {
        **vars(cfg),
        "max_seq_length": sweep.max_seq_length,
        "doc_stride": sweep.doc_stride,
        "n_best": sweep.n_best,
        "max_answer_length": sweep.max_answer_length,
        "null_threshold": sweep.null_threshold,
        "attention_dropout": sweep.attention_dropout,
        "train_windows": len(train_set),
    }
    with tracker.run(f"{ckpt.name}/{name}/lr{lr:g}/seed{seed}", tags, params) as run_id:
        set_seed(seed)  # the span head's initialisation depends on it
        model = SWBertForQuestionAnswering.from_pretrained(
            ckpt.path, attention_probs_dropout_prob=sweep.attention_dropout
        )
        result = fit(
            model,
            train_set,
            collate,
            evaluate=lambda m: evaluate_squad(m, dev_ex, dev_feats, collate, sweep, version),
            select=f"{SPLIT}/f1",
            cfg=cfg,
            log_metrics=lambda m, step: tracker.log(run_id, m, step),
            desc=f"{ckpt.name} {name} lr {lr:g} seed {seed}",
        )
        best = {k: v for k, v in result.best_metrics.items() if k != "epoch"}
        tracker.log(
            run_id,
            {f"best/{k}": v for k, v in best.items()}
            | {"best_epoch": result.best_epoch, "train_seconds": result.train_seconds, "steps": result.steps},
        )
        model_dir = ""
        if sweep.keep != "none":
            model_dir = str(sweep.output_dir / ckpt.name / name / f"lr{lr:g}-seed{seed}")
            save_finetuned(model, tokenizer, model_dir)
    return Trial(ckpt.name, name, lr, seed, nest_metrics(best), model_dir)


def run_squad(sweep: SquadSweep, tracker: Tracker) -> tuple[list[Trial], list[Summary]]:
    """The whole sweep; returns every trial and the per-(variant, version) summaries."""
    trials: list[Trial] = []
    runs = len(sweep.checkpoints) * len(sweep.versions) * len(sweep.learning_rates) * len(sweep.seeds)
    bar = progress_bar(runs, "SQuAD sweep", unit="run")
    for ckpt in sweep.checkpoints:
        tokenizer = load_tokenizer(ckpt.path, sweep.tokenizer)
        token_types = uses_token_types(ckpt.config)
        for version in sweep.versions:
            train_ex = load_squad(version, "train", sweep.train_files.get(version))[: sweep.max_train_samples]
            dev_ex = load_squad(version, "validation", sweep.dev_files.get(version))[: sweep.max_eval_samples]
            train_set = encode_squad_train(
                train_ex, tokenizer, sweep.max_seq_length, sweep.doc_stride, token_types
            )
            dev_feats = encode_squad_eval(
                dev_ex, tokenizer, sweep.max_seq_length, sweep.doc_stride, token_types
            )
            name = task_name(version)
            version_trials = []
            for lr in sweep.learning_rates:
                for seed in sweep.seeds:
                    version_trials.append(
                        run_squad_trial(
                            sweep, ckpt, version, tokenizer, train_set, dev_ex, dev_feats, lr, seed, tracker
                        )
                    )
                    bar.update(1)
            trials += version_trials
            (summary,) = squad_summaries(version_trials)
            log.info("%s %s: lr %g, median %s", ckpt.name, name, summary.learning_rate, summary.median)
            if sweep.keep == "median" and dist_info().is_main:
                prune_models(version_trials, summary.median_trial)
    bar.close()
    return trials, squad_summaries(trials)


def squad_summaries(trials: list[Trial]) -> list[Summary]:
    tasks = {t.task for t in trials}
    return summarize(trials, {n: SPLIT for n in tasks}, {n: "f1" for n in tasks})
