"""The training configuration: one dataclass, a recipe file, and `--key value` overrides.

A recipe is a YAML (or TOML) file whose keys are the fields below; command-line `--key value`
pairs override it (dashes and underscores are the same). Unknown keys are errors with a
suggestion, never silently ignored. The resolved config is printed and saved with every run.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from swbert import cli
from swbert.data.corpus import check_tokenizer_matches
from swbert.data.masking import resolve_max_predictions
from swbert.data.mix import check_mix_folders, parse_data_mix
from swbert.data.tokenizer import special_ids
from swbert.models.attention import attention_class
from swbert.models.config import check_size
from swbert.models.plugins import load_plugins

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


# The optimizer's settings a checkpoint records (see build.run_record and optim.apply_hyperparameters).
OPTIMIZER_SETTINGS = (
    "lr",
    "min_lr",
    "lr_schedule",
    "lr_decay_fraction",
    "warmup_steps",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
)
# Settings a checkpoint records that `--allow-resume-change` may override (see checkpoint.py).
RESUME_CHANGEABLE = (
    "data",
    "seed",
    "seq_len",
    "mlm_probability",
    "mlm_probability_final",
    "max_predictions_per_seq",
    "global_batch_size",
    "batch_size_warmup_steps",
    "batch_size_start",
    "precision",
    "document_attention",
    "rope_theta",  # context extension: a longer seq_len with a larger rotary base
    *OPTIMIZER_SETTINGS,  # applied to the restored optimizer and schedule (Trainer._apply_optimizer_settings)
)


@dataclass
class TrainConfig:
    """Everything a pretraining run needs. Batch sizes and LR live here only (see ds_config.py)."""

    # model
    size: str = "mini"  # named size, see swbert.models.config.SIZES
    attention_type: str = "shared"  # standard | shared | symmetric | pairwise, or a plugin's variant
    # modules imported first, in every rank, that register attention variants (ours; see
    # swbert.models.plugins): dotted module names or .py files
    plugins: list[str] = field(default_factory=list)
    shared_bias: bool = True  # shared attention's bias bs (ours; false: the paper's form, d^2 + 3d per layer)
    # embedding/decoder rows padded to a multiple of this (our choice, the usual GPU one; 1: none);
    # padded ids are never read nor predicted, and the export trims them
    pad_vocab_multiple: int = 128
    hidden_dropout: float = 0.1  # dropout on embeddings and residual branches
    # positions (ours beyond BERT's learned table): learned | rope (rotary, no position table)
    position_embedding: Literal["learned", "rope"] = "learned"
    # rotary base (ours; 10000 as RoFormer): a resume at a longer seq_len may raise it (context
    # extension, docs/pretraining.md; --allow-resume-change rope_theta)
    rope_theta: float = 10000.0
    # local attention (ours, ModernBERT's definition): a total window of this many tokens, half each
    # side (128: 64 each side); 0 or none: global attention in every layer
    local_attention_window: int | None = None
    global_attention_every: int = 3  # with a window: layers 0, N, 2N, ... global, the others local
    attention_dropout: float = 0.1  # dropout on attention probabilities
    # data
    data_dir: str | None = None  # shards from data_prep.preprocess; None: the embedded default corpus
    # several folders of shards with weights, DIR=WEIGHT each (--data-mix wiki=0.75 books=0.25), in
    # place of data_dir: every aligned window of samples meets the weights exactly (docs/data.md,
    # "Mixtures of corpora"); the folders must share the tokenizer
    data_mix: list[str] = field(default_factory=list, metadata={"commas": False})
    seq_len: int = 128  # tokens per packed sequence, [CLS] and [SEP] included
    mlm_probability: float = 0.15  # fraction of tokens to predict (80% [MASK], 10% random, 10% kept)
    # the masking rate at the run's last step (ours; None: mlm_probability throughout): a sample is
    # masked at the rate of the step that draws it, linear from mlm_probability (0.30 -> 0.15, as some
    # 2024-25 encoders); validation masks at this rate
    mlm_probability_final: float | None = None
    # predicted positions per sequence, a static shape (the model gathers this many rows); each
    # sequence predicts round(mlm_probability x its maskable tokens) of them, the rest is padding.
    # None: round(seq_len x mlm_probability), as NVIDIA's BERT (the larger rate with mlm_probability_final)
    max_predictions_per_seq: int | None = None
    num_workers: int = 2  # loader worker processes per rank; 0 builds batches on the training thread
    # batch: global = micro x data-parallel ranks x accumulation; give any two of the three
    global_batch_size: int = 32  # sequences per optimizer step, over all ranks
    # the most sequences per forward pass on one data-parallel rank; a rank whose share of the global
    # batch is smaller runs its share in one pass (lowered, logged; see batch_layout)
    micro_batch_size: int = 16
    grad_accum_steps: int | None = None  # derived from the other two when None
    # batch-size warm-up (ours): the global batch rises linearly from batch_size_start at step 0 to
    # global_batch_size at this step, rounded down to whole micro-batches per rank (fewer accumulated
    # micro-batches per step; swbert.data.steps); 0: off
    batch_size_warmup_steps: int = 0
    batch_size_start: int | None = None  # sequences of step 0, over all ranks (with batch_size_warmup_steps)
    # optimisation
    optimizer: Literal["auto", "torch_adamw", "fused_adam", "cpu_adam"] = "auto"  # auto: fused AdamW on GPU
    lr: float = 1e-3  # peak learning rate, reached after the warm-up
    min_lr: float = 0.0  # floor of the decay
    # decay after the warm-up, to min_lr; wsd (warmup-stable-decay, linear) and one_minus_sqrt (ours)
    # hold lr until the last lr_decay_fraction of the steps (swbert.runtime.optim)
    lr_schedule: Literal["linear", "cosine", "constant", "wsd", "one_minus_sqrt"] = "linear"
    lr_decay_fraction: float = 0.2  # wsd / one_minus_sqrt: the last fraction of steps that decays (ours)
    warmup_steps: int = 100  # linear warm-up from 0 to lr
    weight_decay: float = 0.01  # not applied to biases, norms and the shared-attention diagonals
    adam_beta1: float = 0.9  # AdamW first-moment decay
    adam_beta2: float = 0.98  # AdamW second-moment decay
    adam_eps: float = 1e-6  # AdamW denominator epsilon
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping (negative values are refused)
    # length of the run: steps, or a token budget (converted to steps)
    train_steps: int = 1000  # optimizer steps (ignored when train_tokens is set)
    train_tokens: int | None = None  # token budget, converted to steps of global_batch_size x seq_len
    # precision and parallelism
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    deepspeed_config: str = "ds_configs/zero2.json"  # ZeRO stage and offload; batch/LR are filled here
    tensor_parallel: int = 1  # megatron-core tensor-parallel size (divides the world size)
    # split the activations outside the tensor-parallel regions along the sequence (Megatron's
    # sequence parallelism: less activation memory, same results); needs tensor_parallel > 1
    sequence_parallel: bool = False
    # recompute activations in the backward, per encoder block: none; full (the whole block);
    # selective (all but the matrix products and the attention kernel, torchtitan's op policy)
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    # bookkeeping
    output_dir: str | None = None  # default: runs/<run_name>; one run per folder (--resume auto continues it)
    run_name: str | None = None  # MLflow run name; default: <size>-<attention_type>
    seed: int = 1234  # initial weights, data order and masks
    log_interval: int = 10  # steps between logged metrics
    eval_interval: int = 200  # steps between validations (on a logging step)
    eval_batches: int = 10  # validation micro-batches per evaluation; 0: no validation (nothing logged)
    save_interval: int = 500  # steps between checkpoints (and one at the end)
    keep_checkpoints: int = 3  # newest complete checkpoints kept on disk
    resume: str = "none"  # none | auto (newest complete checkpoint in output_dir) | a checkpoint path
    max_nonfinite_steps: int = 5  # stop after this many skipped (non-finite) steps in a row
    export: bool = True  # write a Hugging Face folder at the end
    # also write one from the checkpoint of every N-th step, to exports/step_N/ in the run folder (rank 0,
    # listed in MLflow; ours); 0: off. A multiple of save_interval (an export is made from a checkpoint)
    export_every: int = 0
    # a tokenizer folder (Hugging Face tokenizer.json and/or WordPiece vocab.txt, or one data_prep.
    # train_tokenizer wrote): without --data-dir, the default corpus is tokenized with it; with
    # --data-dir (--data-mix), it must be the tokenizer the shards were made with. None: the data's
    tokenizer: str | None = None
    mlflow: bool = True  # log to MLflow (MLFLOW_TRACKING_URI, else mlflow.db beside output_dir)
    system_metrics: bool = True  # MLflow's system metrics (CPU, memory, disk, network; GPUs when present)
    progress_bar: bool = True  # a tqdm bar on rank 0
    num_threads: int | None = None  # CPU: torch threads per rank (default: cores / local ranks)
    # torch.compile per unit (each encoder block, the MLM head; the embeddings stay eager), so ZeRO's
    # gradient reduce overlaps the backward (weights and checkpoints unchanged); auto = on for CUDA
    # runs, off on CPU (where eager with the CPU kernels is faster) and with document_attention
    compile: Literal["auto", "on", "off"] = "auto"
    # attention within each packed document only (ours, as ModernBERT; the paper packs without it):
    # the documents of a batch become the sequences of the variable-length attention path; eager
    # only for now (compile auto is then off), without tensor parallelism
    document_attention: bool = False
    compile_backend: str = "inductor"  # torch.compile's backend (a name torch._dynamo.list_backends() gives)
    # the CPU attention kernel from swbert.runtime.cpu (same results, faster in training with attention
    # dropout): auto = on for CPU runs in eager mode; off = exactly the model path a GPU runs; on =
    # required (an error on a GPU or with compile)
    cpu_kernels: Literal["auto", "on", "off"] = "auto"
    # what a resume may change on purpose (comma-separated): data, seed, seq_len, mlm_probability,
    # max_predictions_per_seq, global_batch_size, precision, rope_theta, and the optimizer's lr, min_lr,
    # lr_schedule, lr_decay_fraction, warmup_steps, weight_decay, adam_beta1, adam_beta2, adam_eps
    # (applied to the restored optimizer); the schedules' mlm_probability_final,
    # batch_size_warmup_steps, batch_size_start (from the checkpoint's step on); a change of any other recorded setting (the optimizer kind too) is refused
    allow_resume_change: list[str] = field(default_factory=list)

    def check(self) -> None:
        """Raise a ValueError naming the field when a value cannot work."""
        check_size(self.size, "--size")
        load_plugins(self.plugins)
        attention_class(self.attention_type)  # a ValueError listing the registered variants
        cli.check_choices(self)
        self._check_counts()
        self._check_optimisation()
        self._check_data_mix()
        self._check_document_attention()
        self._check_exports_and_tokenizer()
        self._check_positions()
        for key in self.allow_resume_change:
            if key not in RESUME_CHANGEABLE:
                close = difflib.get_close_matches(key, RESUME_CHANGEABLE, n=1)
                hint = (
                    f"did you mean {close[0]!r}?" if close else f"choose from {', '.join(RESUME_CHANGEABLE)}"
                )
                raise ValueError(f"allow_resume_change: {key!r} is not a setting a resume may change; {hint}")
        for name in ("mlm_probability", "mlm_probability_final"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 1:
                raise ValueError(f"{name}={value} must be in (0, 1)")
        rates = (self.mlm_probability, self.mlm_probability_final or 0.0)
        resolve_max_predictions(self.seq_len, max(rates), self.max_predictions_per_seq)
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError(
                "sequence_parallel: true needs tensor_parallel > 1 (it splits the activations between "
                "the tensor-parallel regions); set --tensor-parallel or drop --sequence-parallel"
            )
        if self.activation_checkpointing == "selective" and self.tensor_parallel > 1:
            raise ValueError(
                "activation_checkpointing: selective cannot run with tensor_parallel > 1 (megatron's "
                "all-reduce works in place on the matrix products selective checkpointing keeps, so the "
                "recompute would sum them twice); use --activation-checkpointing full"
            )
        if self.num_workers < 0:
            raise ValueError(
                f"num_workers={self.num_workers} must be 0 (batches on the training thread) or more"
            )

    def _check_positions(self) -> None:
        """The model's position and local-attention fields, checked by the model config at this run's
        size before any process starts, and a window no wider than the sequence."""
        from swbert.models.config import SWBertConfig

        SWBertConfig.from_size(
            self.size,
            attention_type=self.attention_type,
            position_embedding=self.position_embedding,
            rope_theta=self.rope_theta,
            local_attention_window=self.local_attention_window,
            global_attention_every=self.global_attention_every,
        )
        if self.local_attention_window and self.local_attention_window > self.seq_len:
            raise ValueError(
                f"local_attention_window={self.local_attention_window} is wider than seq_len={self.seq_len}; "
                "give a window up to seq_len, or 0 for global attention"
            )

    def _check_exports_and_tokenizer(self) -> None:
        if self.export_every < 0 or (self.export_every and self.export_every % self.save_interval):
            raise ValueError(
                f"export_every={self.export_every} must be 0 (off) or a multiple of save_interval="
                f"{self.save_interval} (each export is made from the checkpoint of its step)"
            )
        if self.tokenizer is not None:  # a folder without a mask token fails here, before any work
            special_ids(self.tokenizer, "--tokenizer")
            folders = [e.path for e in parse_data_mix(self.data_mix)] if self.data_mix else [self.data_dir]
            check_tokenizer_matches(self.tokenizer, [f for f in folders if f is not None])

    def _check_document_attention(self) -> None:
        if not self.document_attention:
            return
        if self.compile == "on":
            raise ValueError(
                "--document-attention runs eager (each batch has its own number of documents, a new "
                "shape for torch.compile); pass --compile off (or auto)"
            )
        if self.tensor_parallel > 1:
            raise ValueError("--document-attention does not run with --tensor-parallel > 1 yet; drop one")

    def _check_data_mix(self) -> None:
        """--data-mix: well-formed weights, each folder once, with a manifest, one tokenizer for all;
        checked here so bad input fails before any work (reading the manifests is cheap)."""
        if not self.data_mix:
            return
        if self.data_dir is not None:
            raise ValueError(
                f"--data-mix and --data-dir {self.data_dir} were both given: --data-dir trains on one folder, "
                "--data-mix on several with weights; keep one (a recipe's data_dir: pass --data-dir none)"
            )
        check_mix_folders(parse_data_mix(self.data_mix))

    def _check_counts(self) -> None:
        """Counts that must be positive (None: derived or unset), and those that may be 0."""
        for name in (
            "seq_len",
            "global_batch_size",
            "micro_batch_size",
            "train_steps",
            "log_interval",
            "eval_interval",
            "save_interval",
            "keep_checkpoints",
            "tensor_parallel",
            "pad_vocab_multiple",
            "max_nonfinite_steps",
            "grad_accum_steps",
            "num_threads",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name}={value} must be positive")
        if self.train_tokens is not None and self.train_tokens <= 0:
            raise ValueError(
                f"train_tokens={self.train_tokens} must be positive (a token budget); leave it out to "
                "train --train-steps steps"
            )
        for name in ("eval_batches", "warmup_steps", "batch_size_warmup_steps"):  # 0: none
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be 0 or more")
        start, full = self.batch_size_start, self.global_batch_size
        if self.batch_size_warmup_steps and not (start is not None and 0 < start <= full):
            raise ValueError(
                f"batch_size_start={start} must be between 1 and global_batch_size={full}: the global "
                "batch of step 0 of the batch-size warm-up; give --batch-size-start one"
            )

    def _check_optimisation(self) -> None:
        """Rates and optimizer settings in the ranges where AdamW and the schedule mean something:
        finite first (inf passes `> 0`, and NaN fails every range with a misleading message)."""
        import math

        finite = ("lr", "min_lr", "lr_decay_fraction", "weight_decay", "grad_clip", "adam_eps")
        for name in (*finite, "adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if isinstance(value, (int, float)) and not math.isfinite(value):
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{name}={value} must be a finite number: give {flag} one")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be positive (the peak learning rate)")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(
                f"min_lr={self.min_lr} must be between 0 and lr={self.lr} (the floor of the decay)"
            )
        if not 0 < self.lr_decay_fraction <= 1:
            raise ValueError(
                f"lr_decay_fraction={self.lr_decay_fraction} must be in (0, 1]: the last fraction of the "
                "steps in which wsd and one_minus_sqrt decay; give --lr-decay-fraction one"
            )
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be 0 or more")
        if not self.grad_clip >= 0:
            raise ValueError(f"grad_clip={self.grad_clip} must be 0 or more (0 disables clipping)")
        if not self.adam_eps > 0:
            raise ValueError(f"adam_eps={self.adam_eps} must be positive")
        for name in ("adam_beta1", "adam_beta2", "hidden_dropout", "attention_dropout"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1)")

    def batch_layout(self, dp_size: int) -> tuple[int, int, int]:
        """(global, micro, accumulation) for `dp_size` data-parallel ranks, with global = micro x
        `dp_size` x accumulation; errors say what to change.

        `micro_batch_size` is the most sequences one rank runs per forward pass: a rank whose share of
        the global batch (global / `dp_size`) is smaller runs its whole share in one pass (the
        micro-batch lowered to it, no accumulation), so a recipe keeps its global batch, which sets
        the numerics, on any data-parallel size that divides it (base_shared's 4096 on 64 ranks: 64
        each). A larger share must be a whole number of micro-batches, and a global batch that does
        not split evenly between the ranks is refused, naming the nearest global batches that run.
        With `grad_accum_steps` given, all three must agree exactly: nothing is derived or lowered.
        """
        per_step = self.micro_batch_size * dp_size
        if self.grad_accum_steps is not None:
            expected = per_step * self.grad_accum_steps
            if expected != self.global_batch_size:
                raise ValueError(
                    f"global_batch_size={self.global_batch_size} != micro_batch_size={self.micro_batch_size} x "
                    f"{dp_size} data-parallel ranks x grad_accum_steps={self.grad_accum_steps} (= {expected}); "
                    "drop --grad-accum-steps to derive it, or fix one of the three"
                )
            return self.global_batch_size, self.micro_batch_size, self.grad_accum_steps
        nearest = " or ".join(
            f"--global-batch-size {g}"
            for g in nearest_global_batches(self.global_batch_size, self.micro_batch_size, dp_size)
        )
        if self.global_batch_size % dp_size:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not divisible by {dp_size} data-parallel ranks "
                f"(GPUs / --tensor-parallel): every rank takes the same number of sequences per step; the "
                f"nearest global batches that run on {dp_size} ranks: {nearest} (or launch a data-parallel "
                f"size that divides {self.global_batch_size})"
            )
        share = self.global_batch_size // dp_size  # sequences per rank per step
        if share < self.micro_batch_size:  # the whole share in one pass
            return self.global_batch_size, share, 1
        if share % self.micro_batch_size:
            fits = max(d for d in range(1, self.micro_batch_size + 1) if share % d == 0)
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not divisible by micro_batch_size="
                f"{self.micro_batch_size} x {dp_size} data-parallel ranks (= {per_step}): {share} sequences "
                f"per rank are not a whole number of micro-batches; keep the global batch with "
                f"--micro-batch-size {fits}, or take the nearest global batches that run: {nearest}"
            )
        return self.global_batch_size, self.micro_batch_size, share // self.micro_batch_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def nearest_global_batches(global_batch: int, micro_batch: int, dp_size: int) -> list[int]:
    """The global batches nearest `global_batch` that `dp_size` ranks of at most `micro_batch`
    sequences per pass can make (`TrainConfig.batch_layout`): the one below it (none when there is
    none) and the one above. A rank's share s is one pass when s < micro_batch, else a multiple of
    micro_batch."""
    out = []
    below = (global_batch - 1) // dp_size  # the largest share under global_batch
    if below >= micro_batch:
        below -= below % micro_batch
    if below >= 1:
        out.append(below * dp_size)
    above = global_batch // dp_size + 1  # the smallest share over global_batch
    if above > micro_batch:
        above = -(-above // micro_batch) * micro_batch
    out.append(above * dp_size)
    return out


def build_config(recipe: str | Path | None, overrides: list[str]) -> TrainConfig:
    """Recipe values, then `--key value` overrides, checked (see `swbert.cli`)."""
    return cli.build_config(TrainConfig, recipe, overrides, RECIPES_DIR)


def field_descriptions() -> dict[str, str]:
    """Each field's description: the comment on its line in `TrainConfig`, else the lines above it."""
    return cli.field_descriptions(TrainConfig)


def dump_config(config: TrainConfig) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
