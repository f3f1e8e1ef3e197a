"""The pretraining loop: steps, skipped-step accounting, logged windows, saves and stopping.

The trainer (`swbert.training.trainer.Trainer`) does one step, one evaluation or one save; the
loop decides when, and keeps the running totals of the window between two logged steps.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from swbert.logs import status
from swbert.runtime.exits import PREEMPTED_EXIT
from swbert.runtime.monitor import memory_gib
from swbert.training import checkpoint as ckpt
from swbert.training.faults import kill_point

if TYPE_CHECKING:
    from swbert.training.trainer import Trainer

log = logging.getLogger("swbert.train")


class NonFiniteStop(RuntimeError):
    """Raised after `max_nonfinite_steps` skipped steps in a row."""


@dataclass
class Counts:
    """Sums over predicted tokens, kept on the device (read at log intervals only): the loss, how
    many tokens were predicted, how many correctly. float64, so sums over a window stay exact."""

    loss_sum: torch.Tensor
    predicted: torch.Tensor
    correct: torch.Tensor

    @classmethod
    def zeros(cls, device: torch.device) -> Counts:
        return cls(*torch.zeros(3, dtype=torch.float64, device=device))

    def __iadd__(self, other: Counts) -> Counts:
        self.loss_sum = self.loss_sum + other.loss_sum
        self.predicted = self.predicted + other.predicted
        self.correct = self.correct + other.correct
        return self


@dataclass
class StepResult:
    """One optimizer step: this rank's counts, whether the update was applied on every rank, and
    whether any rank was asked to stop (a signal)."""

    counts: Counts
    applied: bool
    stop: bool


@dataclass
class Window:
    """Running totals between two logged steps (this rank's; skipping is decided collectively).

    Time spent saving checkpoints is `paused`: throughput, TFLOP/s and MFU count training alone."""

    counts: Counts
    samples: int = 0  # the stream position when the window began (steps differ in a batch warm-up)
    skipped: int = 0
    steps: int = 0
    data_wait: float = 0.0  # seconds the loop waited for the next batch
    paused: float = 0.0  # seconds spent on checkpoints within the window
    started: float = field(default_factory=time.perf_counter)

    @property
    def seconds(self) -> float:
        """Wall time of the window's training: from its start to now, less the pauses."""
        return max(time.perf_counter() - self.started - self.paused, 1e-9)


class Loop:
    """The training loop of one `Trainer` (after its `setup`); `run` returns the run's status and its
    last complete checkpoint. It reads the trainer's frozen `Run` and its `state`, and acts through
    the trainer's public methods only (tests/project/test_architecture.py holds it to that)."""

    def __init__(self, trainer: Trainer) -> None:
        run = trainer.run
        assert run is not None, "Loop(trainer) after trainer.setup()"
        self.trainer = trainer
        self.window = self.new_window()
        self.skipped_in_a_row = 0
        self.first_logged: dict[str, Any] | None = None  # for the closing summary: did the loss fall?
        self.last_logged: dict[str, Any] | None = None
        self.totals = {"data_wait_s": 0.0, "step_s": 0.0}  # over the whole run, for the summary
        self.bar = None
        if run.is_main and run.config.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(
                total=run.total_steps,
                initial=trainer.state.step,
                desc=f"pretrain {run.folder.run_name}",
                unit="step",
                dynamic_ncols=True,
                file=sys.stdout,
            )

    @property
    def step(self) -> int:
        return self.trainer.state.step

    def new_window(self) -> Window:
        return Window(Counts.zeros(self.trainer.run.device), samples=self.trainer.state.samples_consumed)

    def run(self) -> tuple[str, Path | None]:
        t, r = self.trainer, self.trainer.run
        cfg = r.config
        last_saved, save_pending = None, False
        while self.step < r.total_steps:
            result = t.train_step()
            self.account(result)
            if self.bar is not None:
                self.bar.update(1)
            if self.step % cfg.log_interval == 0 or self.step == r.total_steps:
                self.log_window()
            if self.step % cfg.save_interval == 0 or save_pending:
                # never checkpoint in the middle of a run of skipped steps: wait for a good one
                save_pending = not result.applied
                if result.applied:
                    started = time.perf_counter()
                    last_saved = t.save()
                    t.export_if_due(last_saved)  # --export-every: rank 0, from this checkpoint
                    self.window.paused += time.perf_counter() - started
            kill_point("after_step", self.step, r.dims.rank)
            if result.stop:
                last_saved = t.checkpoint_now(last_saved)
                status.info(
                    "pre-empted: checkpoint saved at step %d (exit status %d); to continue, run the same "
                    "command with --resume auto", self.step, PREEMPTED_EXIT,
                )  # fmt: skip
                return "KILLED", last_saved
        return "FINISHED", t.checkpoint_now(last_saved)

    def account(self, result: StepResult) -> None:
        """Add a step to the window; a skipped step counts only as skipped (the trainer counts it in
        `state.skipped_total`; the loop counts the ones in a row, and stops after too many)."""
        r, w = self.trainer.run, self.window
        w.steps += 1
        w.data_wait += self.trainer.take_data_wait()
        if result.applied:
            w.counts += result.counts
            self.skipped_in_a_row = 0
            return
        w.skipped += 1
        self.skipped_in_a_row += 1
        if r.is_main:
            log.warning(
                "step %d skipped: non-finite loss or gradients (%d in a row)",
                self.step,
                self.skipped_in_a_row,
            )
        if self.skipped_in_a_row >= r.config.max_nonfinite_steps:
            raise NonFiniteStop(
                f"stopping at step {self.step}: {self.skipped_in_a_row} steps in a row had a non-finite loss "
                f"or gradients. The last good checkpoint is {ckpt.newest_complete(r.folder.ckpt_root) or 'none'} "
                f"in {r.folder.ckpt_root}; lower --lr, check the data, or raise --max-nonfinite-steps"
            )

    def record(self) -> dict[str, Any]:
        """The logged record of the window (counts summed over the data-parallel ranks and the
        gradient norm, read together: the one host sync of a logging step besides the step's own)."""
        t, r, w = self.trainer, self.trainer.run, self.window
        grad_norm = t.grad_norm()  # a device tensor under ZeRO, a float or None otherwise
        on_device = grad_norm if isinstance(grad_norm, torch.Tensor) else None
        loss_sum, predicted, correct, *read = t.reduce_counts(w.counts, also=on_device)
        if read:
            grad_norm = read[0]
        seconds = w.seconds
        samples = t.state.samples_consumed
        tokens_per_s = (samples - w.samples) * r.config.seq_len / seconds
        tflops = tokens_per_s * r.train_flops_per_token / r.dims.world / 1e12
        record = {
            "loss": loss_sum / predicted if predicted else float("nan"),
            "mlm_acc": correct / predicted if predicted else float("nan"),
            "lr": t.lr(),
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "skipped_steps": w.skipped,
            "skipped_total": t.state.skipped_total,
            "tokens_per_s": tokens_per_s,
            "samples_per_s": tokens_per_s / r.config.seq_len,
            "tflops_per_device": tflops,
            "tokens_seen": samples * r.config.seq_len,
            "data_wait_s": w.data_wait,
            "step_s": seconds,
            **memory_gib(),
        }
        if r.peak_tflops:
            record["mfu"] = tflops / r.peak_tflops
        self.totals["data_wait_s"] += w.data_wait
        self.totals["step_s"] += seconds
        return record

    def log_window(self) -> None:
        t, r = self.trainer, self.trainer.run
        record = self.record()
        if self.step % r.config.eval_interval == 0 or self.step == r.total_steps:
            record.update(t.evaluate())  # before the next window starts: not counted as training time
        t.log_metrics(record)
        if math.isfinite(record["loss"]):
            self.last_logged = {"step": self.step, **record}
            self.first_logged = self.first_logged or self.last_logged
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        elif r.is_main:  # without the bar (logs, batch jobs), a line per logged step says it trains
            status.info(window_line(self.step, r.total_steps, record))
        self.window = self.new_window()

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.totals)
        if self.first_logged is not None:
            out.update(first_logged=self.first_logged, last_logged=self.last_logged)
        return out

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def window_line(step: int, total: int, record: dict[str, Any]) -> str:
    """The status line of a logged step when no progress bar shows: where the run is and how it
    goes, in one line (every value is in metrics.jsonl too)."""
    line = (
        f"step {step}/{total}: loss {record['loss']:.4f}, MLM accuracy {record['mlm_acc']:.3f}, "
        f"lr {record['lr']:.3g}, {record['tokens_per_s']:,.0f} tokens/s"
    )
    if record.get("skipped_steps"):
        line += f", {record['skipped_steps']} step(s) skipped"
    if "val_loss" in record:
        line += f"; validation loss {record['val_loss']:.4f} (perplexity {record['val_ppl']:.2f})"
    return line
