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
from swbert.training.metrics import MetricsWriteError

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
    """The training loop of one `Trainer`; `run` returns the run's status and its last complete
    checkpoint."""

    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer
        self.window = Window(Counts.zeros(trainer.device))
        self.skipped_in_a_row = 0
        self.first_logged: dict[str, Any] | None = None  # for the closing summary: did the loss fall?
        self.last_logged: dict[str, Any] | None = None
        self.totals = {"data_wait_s": 0.0, "step_s": 0.0}  # over the whole run, for the summary
        self.bar = None
        if trainer.is_main and trainer.config.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(
                total=trainer.total_steps,
                initial=trainer.step,
                desc=f"pretrain {trainer.run_name}",
                unit="step",
                dynamic_ncols=True,
                file=sys.stdout,
            )

    def run(self) -> tuple[str, Path | None]:
        t, cfg = self.t, self.t.config
        last_saved, save_pending = None, False
        while t.step < t.total_steps:
            result = t.train_step()
            self.account(result)
            if self.bar is not None:
                self.bar.update(1)
            if t.step % cfg.log_interval == 0 or t.step == t.total_steps:
                self.log_window()
            if t.step % cfg.save_interval == 0 or save_pending:
                # never checkpoint in the middle of a run of skipped steps: wait for a good one
                save_pending = not result.applied
                if result.applied:
                    started = time.perf_counter()
                    last_saved = t.save()
                    self.window.paused += time.perf_counter() - started
            kill_point("after_step", t.step, t.dims.rank)
            if result.stop:
                last_saved = t._checkpoint_now(last_saved)
                status.info(
                    "pre-empted: checkpoint saved at step %d (exit status %d); to continue, run the same "
                    "command with --resume auto", t.step, PREEMPTED_EXIT,
                )  # fmt: skip
                return "KILLED", last_saved
        return "FINISHED", t._checkpoint_now(last_saved)

    def account(self, result: StepResult) -> None:
        """Add a step to the window; a skipped step counts only as skipped."""
        t, w = self.t, self.window
        w.steps += 1
        w.data_wait += t.data_wait
        t.data_wait = 0.0
        if result.applied:
            w.counts += result.counts
            self.skipped_in_a_row = 0
            return
        w.skipped += 1
        t.skipped_total += 1
        self.skipped_in_a_row += 1
        if t.is_main:
            log.warning(
                "step %d skipped: non-finite loss or gradients (%d in a row)", t.step, self.skipped_in_a_row
            )
        if self.skipped_in_a_row >= t.config.max_nonfinite_steps:
            raise NonFiniteStop(
                f"stopping at step {t.step}: {self.skipped_in_a_row} steps in a row had a non-finite loss "
                f"or gradients. The last good checkpoint is {ckpt.newest_complete(t.ckpt_root) or 'none'} "
                f"in {t.ckpt_root}; lower --lr, check the data, or raise --max-nonfinite-steps"
            )

    def record(self) -> dict[str, Any]:
        """The logged record of the window (counts summed over the data-parallel ranks and the
        gradient norm, read together: the one host sync of a logging step besides the step's own)."""
        t, w = self.t, self.window
        grad_norm = t.engine.get_global_grad_norm()  # a device tensor under ZeRO, a float or None otherwise
        on_device = grad_norm if isinstance(grad_norm, torch.Tensor) else None
        loss_sum, predicted, correct, *read = t._all_reduce(w.counts, also=on_device)
        if read:
            grad_norm = read[0]
        seconds = w.seconds
        tokens_per_s = t.tokens_per_step * w.steps / seconds
        tflops = tokens_per_s * t.train_flops_per_token / t.dims.world / 1e12
        record = {
            "loss": loss_sum / predicted if predicted else float("nan"),
            "mlm_acc": correct / predicted if predicted else float("nan"),
            "lr": t.scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "skipped_steps": w.skipped,
            "skipped_total": t.skipped_total,
            "tokens_per_s": tokens_per_s,
            "samples_per_s": tokens_per_s / t.config.seq_len,
            "tflops_per_device": tflops,
            "tokens_seen": t.step * t.tokens_per_step,
            "data_wait_s": w.data_wait,
            "step_s": seconds,
            **memory_gib(),
        }
        if t.peak_tflops:
            record["mfu"] = tflops / t.peak_tflops
        self.totals["data_wait_s"] += w.data_wait
        self.totals["step_s"] += seconds
        return record

    def log_window(self) -> None:
        t = self.t
        record = self.record()
        if t.step % t.config.eval_interval == 0 or t.step == t.total_steps:
            record.update(t.evaluate())  # before the next window starts: not counted as training time
        if t.metrics is not None:
            try:
                t.metrics.log(t.step, record)
            except MetricsWriteError as err:  # every rank stops at the next agreement (`Trainer._agree`)
                t.write_failure = str(err)
        if math.isfinite(record["loss"]):
            self.last_logged = {"step": t.step, **record}
            self.first_logged = self.first_logged or self.last_logged
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        elif t.is_main:  # without the bar (logs, batch jobs), a line per logged step says it trains
            status.info(window_line(t.step, t.total_steps, record))
        self.window = Window(Counts.zeros(t.device))

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
