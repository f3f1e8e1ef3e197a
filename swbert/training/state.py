"""The two objects a pretraining run is made of, apart from the trainer's code.

`Run` is what `Trainer.setup` built: the config, the folder, the data, the model's engine, the
process layout, the tracking; frozen, set once, read by the trainer and the loop alike.

`TrainState` is what changes as the run goes, and exactly what a checkpoint saves and a resume
restores of it (DeepSpeed's client state, beside the model and optimizer states, which the engine
saves itself, and every rank's RNG streams, which `swbert.training.checkpoint` saves in files of
their own).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from swbert.models import SWBertConfig
    from swbert.runtime.ranks import ParallelDims
    from swbert.training.build import RunFolder, RunPlan
    from swbert.training.config import TrainConfig
    from swbert.training.data import TrainingData
    from swbert.training.metrics import MetricsLogger
    from swbert.training.resume import Resume


@dataclass(frozen=True)
class Run:
    """A pretraining run as `Trainer.setup` built it; nothing in it changes afterwards."""

    config: TrainConfig
    folder: RunFolder
    plan: RunPlan  # precision, batch shape, the filled DeepSpeed config
    data: TrainingData
    model_config: SWBertConfig
    record: dict[str, Any]  # what every checkpoint's swbert_meta.json records (`build.run_record`)
    resume: Resume | None  # the checkpoint this run continues from (None: a fresh start)
    dims: ParallelDims  # this process's rank, data- and tensor-parallel groups
    device: torch.device
    engine: Any  # DeepSpeed's engine around the model, its optimizer and LR schedule
    scheduler: Any
    guard: Any  # the optimizer whose `overflow` skips a step, where DeepSpeed checks no gradient
    metrics: MetricsLogger | None  # metrics.jsonl and MLflow, rank 0 only
    total_steps: int
    train_flops_per_token: float  # the model's training FLOPs per token (for TFLOP/s and MFU)
    peak_tflops: float | None  # the device's peak in the run's precision, when known

    @property
    def is_main(self) -> bool:
        return self.dims.is_main

    @property
    def tokens_per_step(self) -> int:
        return self.config.global_batch_size * self.config.seq_len


@dataclass
class TrainState:
    """The run's progress: what a checkpoint saves as DeepSpeed's client state, key for key, and
    what a resume restores.

    `sampler` and `tokens_seen` follow from the others (`at_save` fills them for a save): a
    resume recomputes the data position from `samples_consumed`; they are saved for people and
    tools reading the checkpoint."""

    step: int = 0  # optimizer steps taken, skipped ones included
    samples_consumed: int = 0  # the training stream's position, over every data-parallel rank
    sampler: dict[str, Any] = field(default_factory=dict)  # `TrainingData.sampler_state`
    tokens_seen: int = 0
    skipped_total: int = 0  # steps skipped for a non-finite loss or gradient

    def at_save(self, data: TrainingData, tokens_per_step: int) -> TrainState:
        """This state with its derived entries filled, as a checkpoint of this step saves it."""
        return replace(
            self, sampler=data.sampler_state(self.samples_consumed), tokens_seen=self.step * tokens_per_step
        )

    def to_dict(self) -> dict[str, Any]:
        """The client state a checkpoint saves (`engine.save_checkpoint(client_state=...)`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> TrainState:
        """The state a checkpoint saved; DeepSpeed's load returns its client state with other
        entries of its own, which are not the run's."""
        names = {f.name for f in fields(cls)}
        missing = {"step", "samples_consumed"} - set(saved)
        if missing:
            raise ValueError(
                f"a checkpoint's client state lacks {', '.join(sorted(missing))}: not saved by swbert"
            )
        return cls(**{k: v for k, v in saved.items() if k in names})
