"""SQuAD v1.1 / v2.0 fine-tuning sweeps (the paper's Table 2), with its "single + TriviaQA" rows: the
same trials as GLUE's (`swbert.finetune.sweep`), selected by dev F1; docs/finetuning.md."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from torch import nn

from swbert import SWBertForQuestionAnswering
from swbert.finetune.checkpoint import Checkpoint, load_tokenizer, uses_token_types
from swbert.finetune.glue_data import check_fits
from swbert.finetune.metrics import best_null_threshold, squad_scores
from swbert.finetune.results import Summary
from swbert.finetune.squad_data import (
    SquadEvalFeatures,
    SquadExample,
    Windows,
    encode_squad_eval,
    encode_squad_train,
    read_squad_hub,
    read_squad_json,
)
from swbert.finetune.squad_post import decode_spans
from swbert.finetune.sweep import SweepConfig, Trials, TrialTask
from swbert.finetune.trainer import predict
from swbert.finetune.triviaqa import load_triviaqa_hub, read_triviaqa_json

SPLIT = "validation"
TRIVIAQA = "triviaqa"  # its task name in MLflow and the suffix of the variants fine-tuned on it first
QAData = tuple[list[SquadExample], list[SquadExample]]  # a task's (train, dev) examples
Split = Literal["train", "validation"]


@dataclass(kw_only=True)
class SquadSweep(SweepConfig):
    """Everything one ``finetune_squad.py`` invocation does (its flags; see `SweepConfig` for the rest)."""

    LABEL = "SQuAD"
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
    max_seq_length: int = 384  # tokens per window (the question and a slice of the context)
    doc_stride: int = 128  # overlap, in tokens, between a context's windows
    n_best: int = 20  # start/end candidates per window in span decoding
    max_answer_length: int = 30  # longest answer span, in tokens
    null_threshold: float = 0.0  # v2.0: answer nothing when the no-answer score beats the best span by this
    # also Table 2's "single + TriviaQA" rows: fine-tune each checkpoint on TriviaQA first (same flags),
    # then on SQuAD from the kept TriviaQA model, as a row named NAME+triviaqa
    triviaqa: bool = False
    # TriviaQA train/dev: the official RC JSON (qa/wikipedia-train.json ...) or a SQuAD-format JSON;
    # without them, the Hub's mandarjoshi/trivia_qa (--triviaqa-hub-config)
    triviaqa_train_file: Path | None = None
    triviaqa_dev_file: Path | None = None  # TriviaQA dev, the same forms: picks the TriviaQA model kept
    triviaqa_evidence_dir: Path | None = None  # the release's evidence/ (default: beside its qa/)
    triviaqa_hub_config: str = "rc.wikipedia"  # configuration of mandarjoshi/trivia_qa
    triviaqa_context_words: int = 400  # each evidence document's first N words are a context (ours)

    def check(self) -> None:
        super().check()
        if unknown := [v for v in self.versions if v not in ("1.1", "2.0")]:
            raise ValueError(f"--version {' '.join(unknown)}: SQuAD versions are 1.1 and 2.0")
        self.train_files()
        self.dev_files()
        for path, flag in ((self.triviaqa_train_file, "train"), (self.triviaqa_dev_file, "dev")):
            if path is not None and not path.is_file():
                raise ValueError(f"--triviaqa-{flag}-file {path}: not found")
        if self.triviaqa_context_words <= 0:
            raise ValueError(f"--triviaqa-context-words {self.triviaqa_context_words} must be positive")

    def tasks_per_checkpoint(self) -> int:
        return len(self.versions) * (2 if self.triviaqa else 1) + (1 if self.triviaqa else 0)

    def train_files(self) -> dict[str, Path]:
        return self.version_files("--train-file", self.train_file)

    def dev_files(self) -> dict[str, Path]:
        return self.version_files("--dev-file", self.dev_file)

    def version_files(self, flag: str, specs: list[str]) -> dict[str, Path]:
        """``VERSION=PATH`` (a bare PATH when one version is run) -> {version: path}."""
        out, versions = {}, self.versions
        for spec in specs:
            version, sep, path = spec.partition("=")
            if not sep:
                if len(versions) != 1:
                    raise ValueError(
                        f"{flag} {spec}: with several versions write VERSION=PATH (e.g. 2.0={spec})"
                    )
                version, path = versions[0], spec
            if version not in versions:
                raise ValueError(f"{flag} {spec}: version {version} is not in --version {' '.join(versions)}")
            if not Path(path).is_file():
                raise ValueError(f"{flag} {spec}: {path} not found")
            out[version] = Path(path)
        return out

    def local_file(self, task: str, split: Split) -> Path | None:
        """The file of a split of SQuAD version `task` or of TriviaQA (`TRIVIAQA`); None: from the Hub."""
        if task == TRIVIAQA:
            return self.triviaqa_train_file if split == "train" else self.triviaqa_dev_file
        return (self.train_files() if split == "train" else self.dev_files()).get(task)

    def task_files(self, task: str) -> list[Path]:
        return [p for p in (self.local_file(task, "train"), self.local_file(task, "validation")) if p]

    def data_files(self) -> list[Path]:
        return [f for v in (*self.versions, *[TRIVIAQA] * self.triviaqa) for f in self.task_files(v)]


def load_examples(sweep: SquadSweep, task: str, split: Split) -> list[SquadExample]:
    """A split of SQuAD version `task` or of TriviaQA (`TRIVIAQA`): from its file, else from the Hub."""
    path = sweep.local_file(task, split)
    if task == TRIVIAQA:
        words = sweep.triviaqa_context_words
        if path is None:
            return load_triviaqa_hub(split, sweep.triviaqa_hub_config, words)
        return read_triviaqa_json(path, sweep.triviaqa_evidence_dir, words)
    return read_squad_json(path, task) if path else read_squad_hub(task, split)


def load_task(sweep: SquadSweep, task: str) -> QAData:
    """The (train, dev) examples of `task` (a SQuAD version or `TRIVIAQA`), cut as the sweep says."""
    train = load_examples(sweep, task, "train")[: sweep.max_train_samples]
    return train, load_examples(sweep, task, "validation")[: sweep.max_eval_samples]


def evaluate_squad(
    model: nn.Module,
    examples: list[SquadExample],
    features: SquadEvalFeatures,
    collate,
    sweep: SquadSweep,
    version: str,
) -> dict[str, float]:
    """Official EM/F1 (v2.0: with HasAns/NoAns and best-threshold scores), as ``validation/<metric>``."""
    logits = predict(model, features.dataset, collate, sweep.eval_batch_size, ("start_logits", "end_logits"))
    preds = decode_spans(
        examples, features, *logits, version, sweep.n_best, sweep.max_answer_length, sweep.null_threshold
    )
    refs = {ex.qid: ex.answers for ex in examples}
    scores = squad_scores(preds.answers, refs, version)
    if version == "2.0":
        scores |= best_null_threshold(preds.best_spans, preds.null_score_diffs, refs)
    return {f"{SPLIT}/{k}": v for k, v in scores.items()}


def qa_trials(
    trials: Trials, ckpt: Checkpoint, name: str, version: str, data: QAData, keep: str | None = None
) -> Summary:
    """Every (learning-rate setting, seed) of one checkpoint on QA task `name`, and their summary."""
    sweep, (train_ex, dev_ex) = trials.sweep, data
    tokenizer = load_tokenizer(ckpt.path, sweep.tokenizer, sweep.allow_tokenizer_change)
    windows = Windows(sweep.max_seq_length, sweep.doc_stride, uses_token_types(ckpt.config))
    train_set = encode_squad_train(train_ex, tokenizer, windows)
    check_fits(train_set, ckpt.config.max_position_embeddings, f"the {name} training windows")
    dev_features = encode_squad_eval(dev_ex, tokenizer, windows)
    collate = sweep.collate(tokenizer.pad_token_id)
    decoding = ("doc_stride", "n_best", "max_answer_length", "null_threshold")
    params = {name: getattr(sweep, name) for name in decoding} | {"train_windows": len(train_set)}
    work = TrialTask(
        ckpt,
        name,
        lambda: SWBertForQuestionAnswering.from_pretrained(ckpt.path, **sweep.dropout()),
        train_set,
        collate,
        lambda m: evaluate_squad(m, dev_ex, dev_features, collate, sweep, version),
        f"{SPLIT}/f1",
        tokenizer,
        params,
        tuple(sweep.task_files(TRIVIAQA if name == TRIVIAQA else version)),
    )
    return trials.task_trials(work, keep)


def run_squad(sweep: SquadSweep, trials: Trials) -> None:
    """The whole sweep. With --triviaqa, each checkpoint is fine-tuned on TriviaQA first; its median seed's
    model at the best setting (kept whatever --keep says) is the checkpoint of a variant ``NAME+triviaqa``."""
    sweep.check()
    checkpoints = sweep.checkpoints()
    squad = {version: load_task(sweep, version) for version in sweep.versions}
    trivia = load_task(sweep, TRIVIAQA) if sweep.triviaqa else None
    for ckpt in checkpoints:
        variants = [ckpt]
        if trivia is not None:
            first = qa_trials(trials, ckpt, TRIVIAQA, "1.1", trivia, keep="median")
            variants.append(Checkpoint(f"{ckpt.name}+{TRIVIAQA}", Path(first.median_trial.model_dir)))
        for variant in variants:
            for version, data in squad.items():
                qa_trials(trials, variant, f"squad{version}", version, data)
