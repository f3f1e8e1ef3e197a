"""Robustness to input noise (the paper's Table 5): Gaussian noise on the word embeddings at each
noise level, under the two definitions of a level (`norm`, the paper's; `unit`, ours) that
docs/finetuning.md ("Robustness") gives. Level 0 registers no hook: the clean evaluation, exactly."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Literal

import torch
from torch import nn

DEFAULT_LEVELS = tuple(round(0.05 * i, 2) for i in range(9))  # 0%, 5%, ..., 40%
NoiseScale = Literal["unit", "norm"]
NOISE_SCALES: tuple[NoiseScale, ...] = ("unit", "norm")


@torch.no_grad()
def mean_embedding_norm(model: nn.Module, loader: torch.utils.data.DataLoader) -> float:
    """Mean L2 norm of the word embeddings of all non-padding tokens the loader yields."""
    emb = model.get_input_embeddings()
    device = emb.weight.device
    total, count = 0.0, 0
    for batch in loader:
        ids = batch["input_ids"].to(device)
        mask = batch.get("attention_mask", torch.ones_like(ids)).to(device).bool()  # none: no padding
        norms = emb(ids).float().norm(dim=-1)  # (B, S)
        total += norms[mask].sum().item()
        count += int(mask.sum().item())
    if count == 0:
        raise ValueError("no tokens to measure the embedding norm on (an empty evaluation split?)")
    return total / count


@contextlib.contextmanager
def embedding_noise(
    model: nn.Module, level: float, mean_norm: float, seed: int, scale: NoiseScale = "norm"
) -> Iterator[None]:
    """Within the block, the model's word embeddings get noise at ``level`` (``norm``: of RMS norm
    ``level * mean_norm``; ``unit``: of standard deviation ``level`` per coordinate), drawn on the CPU
    from ``seed``: the same perturbations on any device."""
    if scale not in NOISE_SCALES:
        raise ValueError(f"noise scale {scale!r} is not one of {', '.join(NOISE_SCALES)}")
    if level < 0:
        raise ValueError(f"noise level {level} must be >= 0")
    if level == 0:
        yield
        return
    emb = model.get_input_embeddings()
    # per coordinate: `unit` the level itself; `norm` so that the noise's RMS norm is level * mean_norm
    sigma = level if scale == "unit" else level * mean_norm / math.sqrt(emb.embedding_dim)
    gen = torch.Generator().manual_seed(seed)

    def add_noise(_module: nn.Module, _inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(output.shape, generator=gen, dtype=torch.float32) * sigma
        return output + noise.to(device=output.device, dtype=output.dtype)

    handle = emb.register_forward_hook(add_noise)
    try:
        yield
    finally:
        handle.remove()


def evaluate_under_noise(
    model: nn.Module,
    evaluate: Callable[[nn.Module], dict[str, float]],
    mean_norm: float,
    levels: tuple[float, ...] | list[float] = DEFAULT_LEVELS,
    seeds: tuple[int, ...] | list[int] = (0, 1, 2),
    scale: NoiseScale = "norm",
) -> dict[tuple[float, int], dict[str, float]]:
    """Run ``evaluate(model)`` at every (noise level, noise seed); level 0 runs once per seed, clean."""
    model.eval()
    out = {}
    for seed in seeds:
        for level in levels:
            with torch.no_grad(), embedding_noise(model, level, mean_norm, seed, scale):
                out[(level, seed)] = evaluate(model)
    return out
