"""Rotary positions and local/global attention under tensor parallelism: TP=2 loss, logits and
gathered gradients equal TP=1's for every attention variant, with and without sequence parallelism
(the rotation and the band act per head on each rank's local heads, on the gathered sequence)."""

from __future__ import annotations

import pytest

from swbert.models.attention import attention_types
from tests.parallel.test_parallel_harness import run_ranks
from tests.parallel.test_parallel_model import _check_variant

# tiny has 2 layers: layer 0 global, layer 1 local with 2 keys each side of 16 tokens
OPTIONS = {
    "position_embedding": "rope",
    "rope_theta": 1000.0,
    "local_attention_window": 4,
    "global_attention_every": 2,
}


def _every_variant_with_rope_and_local_attention() -> None:
    for attention_type in attention_types():
        _check_variant(attention_type, False, **OPTIONS)
    for attention_type in ("shared", "pairwise"):  # the sequence gathered around attention
        _check_variant(attention_type, True, **OPTIONS)
    _check_variant("standard", False, position_embedding="rope")  # rope alone, every layer global
    _check_variant("shared", True, local_attention_window=4, global_attention_every=2)  # learned + local


@pytest.mark.slow
def test_tp2_equals_tp1_with_rope_and_local_attention_for_every_variant():
    run_ranks(_every_variant_with_rope_and_local_attention, 2)
