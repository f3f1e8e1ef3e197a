"""SQuAD v1.1 / v2.0 fine-tuning sweeps (the paper's Table 2).

Same loop and bookkeeping as GLUE (:mod:`swbert.finetune.glue`): every (checkpoint, version, learning
rate setting, seed) is one MLflow child run; the reported number is the median over seeds at the best
setting by dev F1 (our aggregation). Scores are the official scripts' (percent). The defaults are the
paper's appendix for SQuAD (docs/paper.md).
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
from swbert.dist import ParallelDims
from swbert.finetune.checkpoint import Checkpoint, load_tokenizer, uses_token_types
from swbert.finetune.glue_data import EncodedDataset, pad_collate
from swbert.finetune.metrics import best_null_threshold, squad_scores
from swbert.finetune.results import Summary, Trial, prune_models, summarize
from swbert.finetune.squad_data import (
    SquadEvalFeatures,
    SquadExample,
    encode_squad_eval,
    encode_squad_train,
    read_squad_hub,
    read_squad_json,
)
from swbert.finetune.squad_post import decode_spans
from swbert.finetune.sweep import SweepConfig, TrialSpec, run_trial
from swbert.finetune.tracking import Tracker
from swbert.finetune.trainer import move, progress_bar

log = logging.getLogger(__name__)

SPLIT = "validation"


def task_name(version: str) -> str:
    return f"squad{version}"


@dataclass
class SquadSweep(SweepConfig):
    """Everything one ``finetune_squad.py`` invocation does (its flags; see `SweepConfig` for the rest)."""

    epochs: int = 5  # the appendix's SQuAD epochs (per stage with --lr-plan stepped)
    attention_dropout: float = 0.05  # the appendix's SQuAD attention dropout
    hidden_dropout: float | None = 0.2  # the appendix's SQuAD "dropout", read as hidden_dropout_prob
    # SQuAD versions to run
    versions: list[Literal["1.1", "2.0"]] = field(
        default_factory=lambda: ["1.1", "2.0"], metadata={"aliases": ("version",)}
    )
    # official SQuAD train JSON per version, [VERSION=]PATH; a version without one comes from the Hub
    train_file: list[str] = field(default_factory=list)
    dev_file: list[str] = field(default_factory=list)  # official SQuAD dev JSON per version, [VERSION=]PATH
    max_seq_length: int = 384  # tokens per window (question + a slice of the context)
    doc_stride: int = 128  # overlap, in tokens, between a context's windows
    n_best: int = 20  # start/end candidates per window in span decoding
    max_answer_length: int = 30  # longest answer span, in tokens
    null_threshold: float = 0.0  # v2.0: answer nothing when the no-answer score beats the best span by this

    def check(self) -> None:
        super().check()
        self.train_files()
        self.dev_files()

    def train_files(self) -> dict[str, Path]:
        return _version_files("--train-file", self.train_file, self.versions)

    def dev_files(self) -> dict[str, Path]:
        return _version_files("--dev-file", self.dev_file, self.versions)


def _version_files(flag: str, specs: list[str], versions: list[str]) -> dict[str, Path]:
    """``VERSION=PATH`` (or a bare PATH when only one version is run) -> {version: path}."""
    out = {}
    for spec in specs:
        version, sep, path = spec.partition("=")
        if not sep:
            if len(versions) != 1:
                raise ValueError(f"{flag} {spec}: with several versions write VERSION=PATH (e.g. 2.0={spec})")
            version, path = versions[0], spec
        if version not in versions:
            raise ValueError(f"{flag} {spec}: version {version} is not in --version {' '.join(versions)}")
        if not Path(path).is_file():
            raise ValueError(f"{flag} {spec}: {path} not found")
        out[version] = Path(path)
    return out


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
    start, end = predict_spans(model, features.dataset, collate, sweep.eval_batch_size)
    preds = decode_spans(
        examples, features, start, end, version, sweep.n_best, sweep.max_answer_length, sweep.null_threshold
    )
    refs = {ex.qid: ex.answers for ex in examples}
    scores = squad_scores(preds.answers, refs, version)
    if version == "2.0":
        scores |= best_null_threshold(preds.best_spans, preds.null_score_diffs, refs)
    return {f"{SPLIT}/{k}": v for k, v in scores.items()}


def squad_trial(
    sweep: SquadSweep,
    ckpt: Checkpoint,
    version: str,
    tokenizer,
    train_set: EncodedDataset,
    dev_ex: list[SquadExample],
    dev_feats: SquadEvalFeatures,
    lrs: tuple[float, ...],
    seed: int,
    tracker: Tracker,
) -> Trial:
    """Fine-tune one (checkpoint, version, learning-rate setting, seed) and log it as a child run."""
    collate = pad_collate(tokenizer.pad_token_id)
    params = {
        "max_seq_length": sweep.max_seq_length,
        "doc_stride": sweep.doc_stride,
        "n_best": sweep.n_best,
        "max_answer_length": sweep.max_answer_length,
        "null_threshold": sweep.null_threshold,
        "attention_dropout": sweep.attention_dropout,
        "hidden_dropout": sweep.hidden_dropout,
        "train_windows": len(train_set),
    }
    dropout = {"attention_probs_dropout_prob": sweep.attention_dropout}
    if sweep.hidden_dropout is not None:
        dropout["hidden_dropout_prob"] = sweep.hidden_dropout
    return run_trial(
        sweep,
        TrialSpec(ckpt, task_name(version), lrs, seed, "squad_trial", params),
        tracker,
        build_model=lambda: SWBertForQuestionAnswering.from_pretrained(ckpt.path, **dropout),
        train_set=train_set,
        collate=collate,
        evaluate=lambda m: evaluate_squad(m, dev_ex, dev_feats, collate, sweep, version),
        select=f"{SPLIT}/f1",
        tokenizer=tokenizer,
    )


def run_squad(sweep: SquadSweep, tracker: Tracker) -> tuple[list[Trial], list[Summary]]:
    """The whole sweep; returns every trial and the per-(variant, version) summaries."""
    sweep.check()
    checkpoints, train_files, dev_files = sweep.checkpoints(), sweep.train_files(), sweep.dev_files()
    trials: list[Trial] = []
    runs = len(checkpoints) * len(sweep.versions) * len(sweep.lr_settings()) * len(sweep.seeds)
    bar = progress_bar(runs, "SQuAD sweep", unit="run")
    for ckpt in checkpoints:
        tokenizer = load_tokenizer(ckpt.path, sweep.tokenizer)
        token_types = uses_token_types(ckpt.config)
        for version in sweep.versions:
            train_ex = load_squad(version, "train", train_files.get(version))[: sweep.max_train_samples]
            dev_ex = load_squad(version, "validation", dev_files.get(version))[: sweep.max_eval_samples]
            train_set = encode_squad_train(
                train_ex, tokenizer, sweep.max_seq_length, sweep.doc_stride, token_types
            )
            dev_feats = encode_squad_eval(
                dev_ex, tokenizer, sweep.max_seq_length, sweep.doc_stride, token_types
            )
            name = task_name(version)
            version_trials = []
            for lrs in sweep.lr_settings():
                for seed in sweep.seeds:
                    version_trials.append(
                        squad_trial(
                            sweep, ckpt, version, tokenizer, train_set, dev_ex, dev_feats, lrs, seed, tracker
                        )
                    )
                    bar.update(1)
            trials += version_trials
            (summary,) = squad_summaries(version_trials)
            log.info("%s %s: lr %s, median %s", ckpt.name, name, summary.lr_label, summary.median)
            if sweep.keep == "median" and ParallelDims.from_env().is_main:
                prune_models(version_trials, summary.median_trial)
    bar.close()
    return trials, squad_summaries(trials)


def squad_summaries(trials: list[Trial]) -> list[Summary]:
    tasks = {t.task for t in trials}
    return summarize(trials, {n: SPLIT for n in tasks}, {n: "f1" for n in tasks})
