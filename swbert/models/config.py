"""Model configuration: BERT's fields plus the attention variant, and the named sizes."""

from __future__ import annotations

import difflib
import inspect
import math
from typing import Any, Literal

from transformers import PretrainedConfig

from swbert.models.attention import attention_class

# The paper's four variants, for type hints and docs. Which names are valid is the registry's say
# (`swbert.models.attention.attention_types()`), so a registered fifth variant is accepted too.
AttentionType = Literal["standard", "shared", "symmetric", "pairwise"]
PositionEmbedding = Literal["learned", "rope"]
POSITION_EMBEDDINGS: tuple[str, ...] = ("learned", "rope")

HEAD_DIM = 64  # head width of the layers x width sizes below (BERT's)


class SizeTable(dict):
    """The named sizes, and any `LxW` name (L layers of width W, a multiple of 64: W/64 heads of
    64 dimensions, a 4W MLP) for ladders of a scaling study (ours). Iterating lists the named
    sizes only; `"4x256" in SIZES` and `SIZES["4x256"]` accept the pattern."""

    def __missing__(self, name: str) -> dict[str, int]:
        shape = layers_by_width(name)
        if shape is None:
            raise KeyError(name)
        return shape

    def __contains__(self, name: object) -> bool:
        return super().__contains__(name) or (isinstance(name, str) and layers_by_width(name) is not None)


def layers_by_width(name: str) -> dict[str, int] | None:
    """The shape `LxW` names (e.g. "4x256"), or None when `name` is not of that form."""
    layers, sep, width = name.partition("x")
    if not (sep and layers.isdigit() and width.isdigit()):
        return None
    L, W = int(layers), int(width)
    if L < 1 or W < HEAD_DIM or W % HEAD_DIM:
        return None
    return dict(
        hidden_size=W, num_hidden_layers=L, num_attention_heads=W // HEAD_DIM, intermediate_size=4 * W
    )


def check_size(name: str, flag: str = "size") -> None:
    """A ValueError naming `flag` unless `name` is a named size or an `LxW` one."""
    if name not in SIZES:
        raise ValueError(
            f"{flag} {name} is not one of {', '.join(SIZES)}, nor LxW (L layers of width W, a "
            f"multiple of {HEAD_DIM}: e.g. 4x256)"
        )


# Named sizes in one table: (hidden, layers, heads, intermediate). The vocabulary, sequence length
# and attention variant are independent of the size and come from the config defaults or overrides.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256),
    "mini": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024),
    "small": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=2048),
    "medium": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, intermediate_size=2048),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    # ~1.27B parameters with the standard attention at BERT's vocabulary: the scaling-study top end.
    "xl": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, intermediate_size=8192),
}
SIZES = SizeTable(SIZES)  # and the LxW sizes (see SizeTable)


class SWBertConfig(PretrainedConfig):
    """Configuration of a BERT encoder with a selectable self-attention variant.

    Field names and defaults follow `transformers.BertConfig` (BERT-base), so BERT checkpoints map
    onto the `standard` variant one to one.
    """

    model_type = "swbert"

    def __init__(
        self,
        vocab_size: int = 30522,  # the tokenizer's vocabulary: the ids a model reads and predicts
        hidden_size: int = 768,  # d: width of the residual stream
        num_hidden_layers: int = 12,  # encoder blocks
        num_attention_heads: int = 12,  # heads; head_dim = hidden_size / heads
        intermediate_size: int = 3072,  # MLP inner width
        hidden_act: str = "gelu",  # MLP activation (exact erf GELU, as BERT)
        hidden_dropout_prob: float = 0.1,  # dropout on embeddings and on each residual branch
        attention_probs_dropout_prob: float = 0.1,  # dropout on attention probabilities
        max_position_embeddings: int = 512,  # learned positions' rows (rope: the longest sequence meant)
        type_vocab_size: int = 2,  # segment (token type) embeddings
        initializer_range: float = 0.02,  # std of the normal init of weights
        layer_norm_eps: float = 1e-12,  # LayerNorm epsilon (BERT's value)
        pad_token_id: int = 0,  # id of [PAD]
        classifier_dropout: float | None = None,  # dropout before classification heads (None: hidden)
        attention_type: AttentionType | str = "shared",  # a registered Q/K/V variant (attention.py)
        # shared attention's bias bs in S = X Ws + bs. Ours, not the paper's: its Table 3 counts Ws with
        # no bias (d^2 + 3d per layer), which False gives exactly. True keeps older checkpoints' bias.
        shared_bias: bool = True,
        # word embedding and MLM decoder rows: vocab_size rounded up to a multiple of this (1: none).
        # Pretraining pads to 128 (TrainConfig; our choice, the usual GPU one, Megatron's default):
        # GEMM-friendly decoder shapes, divisible by tensor-parallel sizes. Rows from vocab_size on
        # are never inputs and never predicted (logits end at vocab_size); exports drop them.
        pad_vocab_multiple: int = 1,
        # "learned" (BERT's table of max_position_embeddings rows) or "rope" (ours: rotary, no table;
        # each head's Q and K rotated by position, transformers' rotate-half; swbert.models.positions)
        position_embedding: PositionEmbedding | str = "learned",
        rope_theta: float = 10000.0,  # rotary base (ours; RoFormer's 10000): larger for longer contexts
        local_attention_window: int | None = None,  # ours, ModernBERT's: total window, W/2 each side; 0: off
        global_attention_every: int = 3,  # with a window: layer i global when i % this == 0 (ModernBERT: 3)
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        self.initializer_range = initializer_range
        self.layer_norm_eps = layer_norm_eps
        self.classifier_dropout = classifier_dropout
        self.attention_type = attention_type
        self.shared_bias = shared_bias
        self.pad_vocab_multiple = pad_vocab_multiple
        self.position_embedding, self.rope_theta = position_embedding, rope_theta
        self.local_attention_window = local_attention_window or None  # 0 is none: configs compare equal
        self.global_attention_every = global_attention_every
        kwargs.setdefault("tie_word_embeddings", True)
        # Older swbert wrote the inner attention kernel into every config (`"attention_kernel":
        # "sdpa"`); every kernel computes the same function and none is a setting now, so a folder
        # or checkpoint that has it loads as before and is saved without it.
        kwargs.pop("attention_kernel", None)
        super().__init__(pad_token_id=pad_token_id, **kwargs)
        self.check()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the word embedding and the tied MLM decoder: vocab_size rounded up to a multiple of
        `pad_vocab_multiple`. Rows from vocab_size on are padding: never read, never predicted."""
        m = self.pad_vocab_multiple
        return -(-self.vocab_size // m) * m

    def check(self) -> None:
        """Raise a ValueError naming the field and the allowed values when the config is invalid."""
        attention_class(self.attention_type)  # a ValueError listing the registered variants
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "pad_vocab_multiple",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.hidden_size % self.num_attention_heads != 0:
            divisors = [h for h in range(1, self.hidden_size + 1) if self.hidden_size % h == 0]
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}; num_attention_heads must divide it: one of "
                f"{', '.join(map(str, divisors))}"
            )
        if not isinstance(self.shared_bias, bool):
            raise ValueError(f"shared_bias={self.shared_bias!r} must be true or false")
        self._check_positions()
        self._check_local_attention()

    def _check_positions(self) -> None:
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(
                f"position_embedding={self.position_embedding!r} is not one of {', '.join(POSITION_EMBEDDINGS)}"
            )
        if self.position_embedding == "rope" and self.head_dim % 2:
            raise ValueError(
                f"position_embedding=rope needs an even head dimension, got hidden_size={self.hidden_size} / "
                f"num_attention_heads={self.num_attention_heads} = {self.head_dim}; change either, or use learned"
            )
        theta = self.rope_theta
        if (
            isinstance(theta, bool)
            or not isinstance(theta, (int, float))
            or not math.isfinite(theta)
            or theta <= 1
        ):
            raise ValueError(
                f"rope_theta={theta!r} must be a finite number above 1 (the rotary base, e.g. 10000)"
            )

    def _check_local_attention(self) -> None:
        window, every = self.local_attention_window, self.global_attention_every
        if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
            raise ValueError(
                f"global_attention_every={every!r} must be a positive integer (every Nth layer global, e.g. 3)"
            )
        if window is None:
            return
        if isinstance(window, bool) or not isinstance(window, int) or window < 0 or window % 2:
            raise ValueError(
                f"local_attention_window={window!r} must be an even number of tokens (a total window, half "
                "each side, as ModernBERT's 128), or 0/none for global attention only"
            )

    def attention_window(self, layer: int) -> int | None:
        """Keys each side that a query of encoder layer `layer` sees, or None where it attends globally
        (no window, or every `global_attention_every`th layer from layer 0, as ModernBERT)."""
        if not self.local_attention_window or layer % self.global_attention_every == 0:
            return None
        return self.local_attention_window // 2

    def bert_differences(self) -> list[str]:
        """The settings that take this model away from BERT's architecture beside its attention variant
        (a transformers BertModel has neither): empty for BERT's learned positions and global attention."""
        out = []
        if self.position_embedding != "learned":
            out.append(f"position_embedding={self.position_embedding}")
        if any(self.attention_window(i) is not None for i in range(self.num_hidden_layers)):
            out.append(f"local_attention_window={self.local_attention_window}")
        return out

    @classmethod
    def from_size(cls, name: str, **overrides: Any) -> SWBertConfig:
        """A config of a named size (see `SIZES`), with any field overridden by keyword.

        Unlike the constructor, which keeps unknown keywords as attributes (transformers' convention
        for configs), an override must name a field: a misspelt one would otherwise be ignored.
        """
        check_size(name)
        fields = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
        known = fields | set(cls().to_dict()) | {"num_labels"}  # num_labels: a property
        for key in overrides:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(fields), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; fields: {', '.join(sorted(fields))}"
                raise ValueError(f"unknown {cls.__name__} field {key!r}{hint}")
        return cls(**{**SIZES[name], **overrides})
