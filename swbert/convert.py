"""Conversion between transformers' BERT and swbert's `standard` variant (same numerics).

python -m swbert.convert from-hf HF_FOLDER OUT_FOLDER     # BertFor* -> SWBertFor* (standard)
python -m swbert.convert to-hf SWBERT_FOLDER OUT_FOLDER   # SWBertFor* (standard) -> BertFor*
"""

from __future__ import annotations

import copy
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import transformers
from torch import nn
from transformers import BertConfig

from swbert import cli
from swbert.models import (
    SWBertConfig,
    SWBertForMaskedLM,
    SWBertForQuestionAnswering,
    SWBertForSequenceClassification,
    SWBertModel,
)
from swbert.models.attention import (
    StandardAttention,
    attention_class,
    attention_types,
    pack_state_dict,
    unpack_state_dict,
)
from swbert.runtime.run_tokenizer import copy_tokenizer

# (transformers name, swbert name) of every parameter, `{i}` a layer's index, `^`/`$` anchors; the
# attention's those of `StandardAttention` in their separate form (q_proj, k_proj, v_proj), packed
# into `in_proj` (`fused_projections`). Both directions of the renaming are made from this list.
_NAMES: list[tuple[str, str]] = [
    ("embeddings.LayerNorm.", "embeddings.norm."),
    ("encoder.layer.{i}.attention.self.query.", "encoder.layers.{i}.attn.q_proj."),
    ("encoder.layer.{i}.attention.self.key.", "encoder.layers.{i}.attn.k_proj."),
    ("encoder.layer.{i}.attention.self.value.", "encoder.layers.{i}.attn.v_proj."),
    ("encoder.layer.{i}.attention.output.dense.", "encoder.layers.{i}.attn.out_proj."),
    ("encoder.layer.{i}.attention.output.LayerNorm.", "encoder.layers.{i}.attn_norm."),
    ("encoder.layer.{i}.intermediate.dense.", "encoder.layers.{i}.mlp.fc1."),
    ("encoder.layer.{i}.output.dense.", "encoder.layers.{i}.mlp.fc2."),
    ("encoder.layer.{i}.output.LayerNorm.", "encoder.layers.{i}.mlp_norm."),
    ("^cls.predictions.transform.dense.", "^mlm_head.dense."),
    ("^cls.predictions.transform.LayerNorm.", "^mlm_head.norm."),
    ("^cls.predictions.bias$", "^mlm_head.decoder.bias$"),
]


def _rule(source: str, target: str) -> tuple[str, str]:
    """(regex, replacement) renaming names of the form `source` to the form `target`."""
    core = source.strip("^$")
    pattern = re.escape(core).replace(re.escape("{i}"), r"(\d+)")
    anchors = ("^" if source.startswith("^") else "", "$" if source.endswith("$") else "")
    return anchors[0] + pattern + anchors[1], target.strip("^$").replace("{i}", r"\1")


_RENAMES = [_rule(hf, ours) for hf, ours in _NAMES]
_INVERSE = [_rule(ours, hf) for hf, ours in _NAMES]
# Keys that are views of others (tied decoder) or buffers, skipped when reading a state dict.
_SKIP = re.compile(
    r"(cls\.predictions\.decoder\.(weight|bias)|mlm_head\.decoder\.weight|position_ids|token_type_ids)$"
)

# transformers head class <-> swbert head class
_PAIRS: list[tuple[type[nn.Module], type[nn.Module]]] = [
    (transformers.BertForMaskedLM, SWBertForMaskedLM),
    (transformers.BertForSequenceClassification, SWBertForSequenceClassification),
    (transformers.BertForQuestionAnswering, SWBertForQuestionAnswering),
    (transformers.BertModel, SWBertModel),
]
_SHARED_FIELDS = (
    "vocab_size hidden_size num_hidden_layers num_attention_heads intermediate_size hidden_act "
    "hidden_dropout_prob attention_probs_dropout_prob max_position_embeddings type_vocab_size "
    "initializer_range layer_norm_eps pad_token_id classifier_dropout"
).split()
_LABEL_FIELDS = ("id2label", "label2id", "problem_type")


def _rename(state: dict, rules: list[tuple[str, str]]) -> dict:
    out = {}
    for key, value in state.items():
        if _SKIP.search(key):
            continue
        for pattern, repl in rules:
            key = re.sub(pattern, repl, key)
        out[key] = value
    return out


def _load(model: nn.Module, state: dict, source: str) -> None:
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not _SKIP.search(k)]
    if missing or unexpected:
        raise ValueError(
            f"cannot convert {source} into {type(model).__name__}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )


def config_from_hf(hf_config: BertConfig, **overrides: object) -> SWBertConfig:
    """An SWBertConfig (standard attention) with the BERT config's fields."""
    pos = getattr(hf_config, "position_embedding_type", "absolute")
    if pos != "absolute":
        raise ValueError(f"position_embedding_type={pos!r} is not supported; swbert uses absolute positions")
    fields = {name: getattr(hf_config, name) for name in _SHARED_FIELDS if hasattr(hf_config, name)}
    fields.update(
        {name: getattr(hf_config, name) for name in _LABEL_FIELDS if getattr(hf_config, name, None)}
    )
    return SWBertConfig(**fields, attention_type=StandardAttention.attention_type, **overrides)


def from_hf_bert(hf_model: nn.Module, vocab_size: int | None = None) -> nn.Module:
    """Build the swbert `standard` model equivalent to a transformers BERT model.

    `vocab_size`, when given (e.g. the tokenizer's size), must match the checkpoint's embedding.
    """
    emb_rows = hf_model.get_input_embeddings().weight.shape[0]
    if vocab_size is not None and vocab_size != emb_rows:
        raise ValueError(
            f"vocab_size mismatch: the tokenizer has {vocab_size} tokens but the BERT checkpoint's "
            f"word embedding has {emb_rows} rows; convert with the tokenizer the checkpoint was trained with"
        )
    target = next((ours for theirs, ours in _PAIRS if type(hf_model) is theirs), None)
    if target is None:
        raise ValueError(
            f"no swbert equivalent for {type(hf_model).__name__}; supported: {[p[0].__name__ for p in _PAIRS]}"
        )
    model = target(config_from_hf(hf_model.config))
    state = fused_projections(_rename(hf_model.state_dict(), _RENAMES), model.config)
    _load(model, state, type(hf_model).__name__)
    return model


def to_hf_bert(model: nn.Module) -> nn.Module:
    """The transformers BERT model equivalent to a swbert `standard` model."""
    config: SWBertConfig = model.config
    if not attention_class(config.attention_type).bert_equivalent:
        convertible = [v for v in attention_types() if attention_class(v).bert_equivalent]
        raise ValueError(
            f"attention_type={config.attention_type!r} has no transformers BERT equivalent; only "
            f"{', '.join(map(repr, convertible))} converts (the other variants load with swbert or "
            "AutoModel after `import swbert`)"
        )
    if config.bert_differences():
        raise ValueError(
            f"{', '.join(config.bert_differences())} has no transformers BERT equivalent; this model "
            "loads with swbert or with AutoModel and trust_remote_code (its exported folder)"
        )
    target = next((theirs for theirs, ours in _PAIRS if type(model) is ours), None)
    if target is None:
        raise ValueError(f"no transformers equivalent for {type(model).__name__}")
    if config.padded_vocab_size != config.vocab_size:  # BERT's tables have vocab_size rows
        model = copy.deepcopy(model).trim_vocab_padding()
    fields = {name: getattr(config, name) for name in _SHARED_FIELDS}
    fields.update({name: getattr(config, name) for name in _LABEL_FIELDS if getattr(config, name, None)})
    hf_model = target(BertConfig(**fields))
    _load(hf_model, _rename(separate_projections(model), _INVERSE), type(model).__name__)
    hf_model.tie_weights()
    return hf_model


def fused_projections(state: dict, config: SWBertConfig) -> dict:
    """In place: the inverse of `separate_projections` (BERT's query, key and value -> `in_proj`)."""
    packed = attention_class(config.attention_type).packed
    suffixes = tuple(f".{part}.weight" for parts in packed.values() for part in parts)
    prefixes = {k[: k.rindex(".", 0, k.rindex("."))] + "." for k in state if k.endswith(suffixes)}
    for prefix in prefixes:
        pack_state_dict(state, prefix, packed, config.head_dim)
    return state


def separate_projections(model: nn.Module) -> dict:
    """The model's state dict with each fused attention projection as the separate ones it packs
    (standard: `in_proj` -> q_proj, k_proj, v_proj, BERT's query, key and value)."""
    config: SWBertConfig = model.config
    packed = attention_class(config.attention_type).packed
    state = dict(model.state_dict())
    suffixes = tuple(f".{fused}.{kind}" for fused in packed for kind in ("weight", "bias"))
    prefixes = {k[: k.rindex(".", 0, k.rindex("."))] + "." for k in state if k.endswith(suffixes)}
    for prefix in prefixes:
        unpack_state_dict(state, prefix, packed, config.head_dim)
    return state


def _check_tokenizer(folder: Path, vocab_size: int) -> None:
    """A tokenizer in the folder must fit the model's embedding (a model's table may be padded)."""
    if not any(
        (folder / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json", "vocab.txt")
    ):
        return  # no tokenizer: the converted folder gets none either
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise ValueError(f"its tokenizer files do not load ({e})") from e
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's word embedding has {vocab_size} "
            "rows; the folder holds the tokenizer of another model"
        )


def _convert(direction: str, folder: Path) -> nn.Module:
    if direction == "from-hf":
        hf_config = transformers.AutoConfig.from_pretrained(folder)
        _check_tokenizer(folder, hf_config.vocab_size)
        arch = (hf_config.architectures or ["BertForMaskedLM"])[0]
        return from_hf_bert(getattr(transformers, arch).from_pretrained(folder))
    config = SWBertConfig.from_pretrained(folder)
    _check_tokenizer(folder, config.vocab_size)
    arch = (config.architectures or ["SWBertForMaskedLM"])[0]
    classes = {cls.__name__: cls for _, cls in _PAIRS}
    return to_hf_bert(classes[arch].from_pretrained(folder))


@dataclass
class ConvertConfig:
    """The flags of `python -m swbert.convert`."""

    direction: Literal["from-hf", "to-hf"] = field(metadata={"positional": True})  # conversion direction
    input: Path = field(metadata={"positional": True})  # folder holding config.json and the weights
    output: Path = field(metadata={"positional": True})  # folder to write (created)

    def check(self) -> None:
        if not (self.input / "config.json").is_file():
            raise ValueError(f"{self.input} holds no config.json: pass a Hugging Face model folder")


def main(argv: list[str] | None = None) -> None:
    args = cli.parse_or_exit(ConvertConfig, argv, __doc__, recipes=False)
    try:
        converted = _convert(args.direction, args.input)
    except ValueError as e:  # a model that cannot be converted: say why, without a traceback
        print(f"error: {args.input}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.direction == "from-hf":  # loadable without swbert too (trust_remote_code), a README.md
        from swbert.models.remote_code import save_loadable

        save_loadable(converted, args.output)
    else:
        args.output.mkdir(parents=True, exist_ok=True)
        converted.save_pretrained(args.output)
    copy_tokenizer(args.input, args.output)  # tokenizer files only (the export's allow-list)
    print(f"wrote {type(converted).__name__} to {args.output}")


if __name__ == "__main__":
    main()
