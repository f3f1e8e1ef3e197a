"""Pretraining: configuration, DeepSpeed engine loop, checkpoints, metrics and export."""

from swbert.training.config import TrainConfig, build_config

__all__ = ["TrainConfig", "build_config"]
