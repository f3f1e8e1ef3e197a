"""The MLflow runs of fine-tuning: one parent run per sweep, one child run per trial or evaluation
(`swbert.studies.tracking`, the runs of every study).

Child runs carry the tags the report command reads: ``swbert.kind`` (``glue_trial``, ``squad_trial``,
``noise``, ``cross_domain``), ``swbert.variant``, ``swbert.task``.
"""

from __future__ import annotations

from swbert.studies import tracking
from swbert.studies.tracking import KIND

VARIANT, TASK, CHECKPOINT = "swbert.variant", "swbert.task", "swbert.checkpoint"
DEFAULT_EXPERIMENT = "swbert-finetune"


class Tracker(tracking.Tracker):
    """A study's tracker whose experiment is, unless given, the fine-tuning one."""

    def __init__(
        self,
        uri: str,
        experiment: str = DEFAULT_EXPERIMENT,
        enabled: bool = True,
        system_metrics: bool = True,
    ) -> None:
        super().__init__(uri, experiment, enabled, system_metrics)


__all__ = ["CHECKPOINT", "DEFAULT_EXPERIMENT", "KIND", "TASK", "VARIANT", "Tracker"]
