"""Parameter and FLOP counts of the model for any attention variant.

The attention part is read off the variant's own layer built on the meta device (its parameters
and the weights of its column-split linears, plus any product it declares: pairwise's K = Q U^T),
so a new variant needs no formula here; the rest of the layer is common and written out.

FLOPs count a multiply-add as 2 and ignore elementwise work (softmax, GELU, LayerNorm, the shared
variant's d-vector scalings), as is usual for MFU. With f the MLP width, s the sequence length and
w the weight entries of the Q/K/V projections, one layer's forward FLOPs per token are

    2 w + 2 d^2 (output projection) + 4 d f (MLP) + 4 s d (Q K^T and A V)

which is 24 d^2 + 4 s d for `standard` and 20 d^2 + 4 s d for `shared` when f = 4d; for our
baselines, 20 d^2 + 4 s d for `qkv_single` (one d x d projection, as shared without its scalings)
and 22 d^2 + 4 s d for `kv_shared` (Wq and the shared Wkv, as symmetric's Wq and Wv).
"""

from __future__ import annotations

from dataclasses import dataclass

from swbert.models.attention import meta_attention
from swbert.models.config import SWBertConfig


def qkv_params(config: SWBertConfig) -> int:
    """Parameters that produce Q, K and V in one layer (the part the variants differ in)."""
    return meta_attention(config).qkv_parameters()


def layer_params(config: SWBertConfig) -> int:
    d, f = config.hidden_size, config.intermediate_size
    out_proj = d * d + d
    mlp = d * f + f + f * d + d
    norms = 2 * 2 * d
    return qkv_params(config) + out_proj + mlp + norms


def embedding_params(config: SWBertConfig) -> int:
    d = config.hidden_size
    # the word table's padded rows (config.pad_vocab_multiple) are parameters too, though never trained
    positions = config.max_position_embeddings if config.position_embedding == "learned" else 0  # rope: none
    tables = config.padded_vocab_size + positions + config.type_vocab_size
    return tables * d + 2 * d


def mlm_head_params(config: SWBertConfig) -> int:
    """Transform (dense + LayerNorm) and the decoder bias; the decoder weight is the tied embedding."""
    d = config.hidden_size
    return d * d + d + 2 * d + config.padded_vocab_size


def masked_lm_params(config: SWBertConfig) -> int:
    """Total parameters of `SWBertForMaskedLM` (no pooler, tied decoder counted once)."""
    return (
        embedding_params(config) + config.num_hidden_layers * layer_params(config) + mlm_head_params(config)
    )


@dataclass(frozen=True)
class FlopCount:
    """Forward FLOPs per input token of a masked-LM step, split by part."""

    encoder: float  # all layers
    mlm_head: float  # head on the predicted positions, averaged over all tokens

    @property
    def forward(self) -> float:
        return self.encoder + self.mlm_head

    @property
    def training(self) -> float:
        """Forward + backward (backward costs twice the forward), no activation recomputation."""
        return 3 * self.forward


def layer_forward_flops(config: SWBertConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one encoder layer."""
    d, f = config.hidden_size, config.intermediate_size
    attn = meta_attention(config)
    projections = 2 * attn.projection_weights() + attn.extra_flops_per_token()
    return projections + 2 * d * d + 4 * d * f + 4 * seq_len * d


def masked_lm_flops(
    config: SWBertConfig, seq_len: int, predicted_fraction: float = 0.15, last_layer_on_predicted: bool = True
) -> FlopCount:
    """FLOPs per token of `SWBertForMaskedLM` whose head runs on `predicted_fraction` of tokens.

    With `last_layer_on_predicted` (the model's `last_layer_on_labels`), the last layer's output
    projection and MLP also run on the predicted positions only; its Q/K/V projections and the
    attention products still cover every token (every position is a key and a value).
    """
    d, f = config.hidden_size, config.intermediate_size
    # the decoder GEMM runs over the padded rows too (config.pad_vocab_multiple): work done, as MFU counts
    head_per_predicted = 2 * d * d + 2 * d * config.padded_vocab_size
    layer = layer_forward_flops(config, seq_len)
    last = layer
    if last_layer_on_predicted:
        last -= (1.0 - predicted_fraction) * (2 * d * d + 4 * d * f)
    return FlopCount(
        encoder=(config.num_hidden_layers - 1) * layer + last,
        mlm_head=predicted_fraction * head_per_predicted,
    )
