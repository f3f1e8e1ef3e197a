"""Hugging Face folders keep the attention projections separate: q_proj, k_proj, v_proj.

In memory (and in DeepSpeed checkpoints) a variant's projections that read the same input are one
head-interleaved matrix (`SelfAttention.packed`, e.g. standard's `in_proj` = Wq, Wk, Wv). A
`model.safetensors` written by `save_pretrained` stores them as the separate matrices instead: the
one documented on-disk form of an exported folder, whose tensors are BERT's query/key/value under
swbert's names (an interchange format, not a compatibility path: the fused matrix is a layout of
our kernels, the separate ones are what the paper and BERT write).

transformers 5 loads and saves through its weight-conversion mapping (not through
`load_state_dict` hooks), so the packing is registered there for the `swbert` model type: on load
the separate tensors are packed, on save the fused one is unpacked. This module is part of the
model code copied into exported folders (`swbert.models.remote_code`), so a folder loaded with
`trust_remote_code` registers the same conversion.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import ConversionOps, WeightConverter

from swbert.models.attention import ATTENTION_CLASSES, attention_class, pack_heads, unpack_heads
from swbert.models.config import SWBertConfig

BLOCK = "attn"  # the attention module's attribute in an encoder block (swbert.models.modeling.Block)


def _first(tensors: Any) -> torch.Tensor:
    return tensors[0] if isinstance(tensors, list) else tensors


class _HeadsOp(ConversionOps):
    """A fused, head-interleaved projection `fused` and the separate ones it packs (`parts`: every
    name any variant packs into it, in the order of the source patterns)."""

    def __init__(self, fused: str, parts: tuple[str, ...]) -> None:
        self.fused = fused
        self.parts = parts

    @torch.no_grad()
    def convert(
        self,
        input_dict: dict[str, Any],
        source_patterns: list[str],
        target_patterns: list[str],
        **kwargs: Any,
    ) -> dict[str, torch.Tensor]:
        return self.transform(input_dict, source_patterns, target_patterns, kwargs["config"])

    def transform(
        self, input_dict: dict[str, Any], sources: list[str], targets: list[str], config: SWBertConfig
    ) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    @property
    def reverse_op(self) -> ConversionOps:
        return (UnpackHeads if isinstance(self, PackHeads) else PackHeads)(self.fused, self.parts)


class PackHeads(_HeadsOp):
    """Load: the separate projections present (in `parts` order) -> the fused one; which of them a
    model has is its attention class's say (symmetric: q_proj, v_proj)."""

    def transform(
        self, input_dict: dict[str, Any], sources: list[str], targets: list[str], config: SWBertConfig
    ) -> dict[str, torch.Tensor]:
        expected = attention_class(config.attention_type).packed.get(self.fused, ())
        found = [part for part, pattern in zip(self.parts, sources) if pattern in input_dict]
        if found != list(expected):
            raise ValueError(
                f"attention_type={config.attention_type!r} packs {list(expected)} into {self.fused}, "
                f"the checkpoint holds {found}: it is not this variant's"
            )
        tensors = [_first(input_dict.pop(p)) for p in sources if p in input_dict]
        return {targets[0]: pack_heads(tensors, config.head_dim)}


class UnpackHeads(_HeadsOp):
    """Save: the fused projection -> the separate ones its attention class packs into it."""

    def transform(
        self, input_dict: dict[str, Any], sources: list[str], targets: list[str], config: SWBertConfig
    ) -> dict[str, torch.Tensor]:
        names = attention_class(config.attention_type).packed[self.fused]
        fused = _first(next(iter(input_dict.values())))
        pieces = unpack_heads(fused, len(names), config.head_dim)
        return {targets[self.parts.index(name)]: t for name, t in zip(names, pieces)}


def weight_conversions() -> list[WeightConverter]:
    """One converter per fused projection name and weight/bias, over the registered variants."""
    parts: dict[str, list[str]] = {}
    for cls in ATTENTION_CLASSES.values():
        for fused, separate in cls.packed.items():
            known = parts.setdefault(fused, [])
            known += [p for p in separate if p not in known]
    return [
        WeightConverter(
            source_patterns=[f"{BLOCK}.{p}.{kind}" for p in separate],
            target_patterns=f"{BLOCK}.{fused}.{kind}",
            operations=[PackHeads(fused, tuple(separate))],
        )
        for fused, separate in parts.items()
        for kind in ("weight", "bias")
    ]


def register_hf_weight_conversions() -> None:
    """Register the packing of the variants registered now with transformers, for the `swbert` model
    type. Every model calls it when it is built (`SWBertPreTrainedModel.__init__`), before
    transformers reads the mapping to load or save it, so a variant registered later (a plugin's,
    which may pack other names) is converted too."""
    register_checkpoint_conversion_mapping(SWBertConfig.model_type, weight_conversions(), overwrite=True)
