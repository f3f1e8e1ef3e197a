"""Special token ids and the tokenizer folders preprocessing and training read.

A folder written by `data_prep.train_tokenizer` (its `spm.model` beside the Hugging Face files)
puts the BERT specials at fixed ids, the defaults below. Any other Hugging Face tokenizer folder
(`tokenizer.json` and/or a WordPiece `vocab.txt`, with its `tokenizer_config.json` or
`special_tokens_map.json`) has its own: `special_ids` maps them from the folder, preprocessing
records them in the shard manifest, and training and masking read them from there (ours: the
paper names BERT-base-uncased's setting, not its vocabulary nor how it was read).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers takes seconds to import; only load_tokenizer needs it
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

PAD_ID = 0
UNK_ID = 1
CLS_ID = 2
SEP_ID = 3
MASK_ID = 4
SPECIAL_TOKENS: tuple[str, ...] = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
"""The special pieces, in id order: `SPECIAL_TOKENS[MASK_ID] == "[MASK]"`."""
SPECIAL_IDS: tuple[int, ...] = (PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID)

SPM_MODEL_NAME = "spm.model"
"""File name of the raw SentencePiece model inside a tokenizer folder."""
TOKENIZER_INFO_NAME = "swbert_tokenizer.json"
"""How the tokenizer was trained (inputs, sample size, model type) and its hash."""
HF_TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
)
"""The files of a Hugging Face tokenizer folder: what decides how it encodes, and what is copied."""
TRAIN_HINT = "python -m data_prep.train_tokenizer --input PATH --output DIR --vocab-size N"

# Where a role's token is named: tokenizer_config.json / special_tokens_map.json keys, in order, and
# the usual tokens looked up in the vocabulary when no key names one (WordPiece's, then BPE's).
_ROLE_KEYS = {
    "cls": ("cls_token", "bos_token"),
    "sep": ("sep_token", "eos_token"),
    "mask": ("mask_token",),
    "pad": ("pad_token",),
    "unk": ("unk_token",),
}
_ROLE_TOKENS = {
    "cls": ("[CLS]", "<s>", "<cls>"),
    "sep": ("[SEP]", "</s>", "<sep>"),
    "mask": ("[MASK]", "<mask>"),
    "pad": ("[PAD]", "<pad>"),
    "unk": ("[UNK]", "<unk>"),
}


@dataclass(frozen=True)
class SpecialIds:
    """The ids packing writes (`cls`, `sep`), masking writes (`mask`) and never predicts (all five),
    and the model pads with (`pad`). The defaults are those of swbert's own tokenizers; `unk` is
    None for a tokenizer without one (a byte-level BPE)."""

    cls: int = CLS_ID
    sep: int = SEP_ID
    mask: int = MASK_ID
    pad: int = PAD_ID
    unk: int | None = UNK_ID

    @property
    def ids(self) -> tuple[int, ...]:
        """Every special id, for the masking collator's never-masked set."""
        return tuple(i for i in (self.pad, self.unk, self.cls, self.sep, self.mask) if i is not None)

    def to_dict(self) -> dict[str, int | None]:
        return asdict(self)


def is_swbert_tokenizer(tokenizer_dir: str | Path) -> bool:
    """Whether the folder was written by `data_prep.train_tokenizer` (it holds `spm.model`)."""
    return (Path(tokenizer_dir) / SPM_MODEL_NAME).is_file()


def is_tokenizer_folder(tokenizer_dir: str | Path) -> bool:
    """Whether the folder holds a tokenizer preprocessing can use: swbert's or a Hugging Face one."""
    path = Path(tokenizer_dir)
    return any((path / name).is_file() for name in (SPM_MODEL_NAME, "tokenizer.json", "vocab.txt"))


def _check_folder(tokenizer_dir: Path, flag: str) -> None:
    if not is_tokenizer_folder(tokenizer_dir):
        what = (
            "does not exist"
            if not tokenizer_dir.exists()
            else "holds no spm.model, tokenizer.json or vocab.txt"
        )
        raise ValueError(
            f"{flag} {tokenizer_dir} {what}: pass a Hugging Face tokenizer folder (tokenizer.json or a "
            f"WordPiece vocab.txt), or train one with: {TRAIN_HINT}"
        )


def _read_json(path: Path, flag: str) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(
            f"{flag} {path.parent}: {path.name} is not readable JSON ({err}); fix or remove it"
        ) from err
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or `{"content": ...}`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _named_tokens(tokenizer_dir: Path, flag: str) -> dict[str, str]:
    """Each role's token as the folder's own configuration names it (tokenizer_config.json first)."""
    named: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins: read last
        config = _read_json(tokenizer_dir / name, flag)
        for role, keys in _ROLE_KEYS.items():
            token = next((t for key in keys if (t := _token_text(config.get(key)))), None)
            if token is not None:
                named[role] = token
    return named


def _wordpiece(tokenizer_dir: Path, flag: str) -> Tokenizer:
    """A `vocab.txt` as transformers' BertTokenizer reads it (its BertConverter's pipeline), with the
    lower-casing and accent settings of tokenizer_config.json (BertTokenizer's defaults without it)."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    config = _read_json(tokenizer_dir / "tokenizer_config.json", flag)
    lines = (tokenizer_dir / "vocab.txt").read_text(encoding="utf-8").split("\n")
    vocab = {token.rstrip("\r"): i for i, token in enumerate(lines[:-1] if lines[-1] == "" else lines)}
    named = _named_tokens(tokenizer_dir, flag)
    tokenizer = Tokenizer(WordPiece(vocab, unk_token=named.get("unk", "[UNK]"), max_input_chars_per_word=100))
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=config.get("tokenize_chinese_chars", True),
        strip_accents=config.get("strip_accents"),
        lowercase=config.get("do_lower_case", True),
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    cls, sep = named.get("cls", "[CLS]"), named.get("sep", "[SEP]")
    if cls in vocab and sep in vocab:  # else special_tokens names the missing one
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{cls}:0 $A:0 {sep}:0",
            pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
            special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
        )
    specials = {*named.values(), *(t[0] for t in _ROLE_TOKENS.values())}  # BertTokenizer's defaults
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in sorted(specials) if t in vocab]
    )
    return tokenizer


def hf_encoder(tokenizer_dir: str | Path, flag: str = "--tokenizer") -> Tokenizer:
    """The `tokenizers.Tokenizer` of a Hugging Face folder (`tokenizer.json`, else `vocab.txt`), with
    no truncation nor padding: preprocessing encodes whole pieces of documents with it."""
    from tokenizers import Tokenizer

    path = Path(tokenizer_dir)
    _check_folder(path, flag)
    if (path / "tokenizer.json").is_file():
        try:
            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as err:  # tokenizers raises its own Exception type for a bad file
            raise ValueError(f"{flag} {path}: tokenizer.json does not load ({err})") from err
    else:
        tokenizer = _wordpiece(path, flag)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def special_tokens(tokenizer_dir: str | Path, flag: str = "--tokenizer") -> dict[str, str | None]:
    """Each role's token (cls, sep, mask, pad, unk) of a Hugging Face folder: the one its
    configuration names, else the usual token its vocabulary holds ([CLS] or <s>, ...). A one-line
    ValueError naming `flag` when a role other than unk has none, or a named token is not in the
    vocabulary."""
    path = Path(tokenizer_dir)
    tokenizer = hf_encoder(path, flag)
    named = _named_tokens(path, flag)
    out: dict[str, str | None] = {}
    for role, usual in _ROLE_TOKENS.items():
        if role in named:
            if tokenizer.token_to_id(named[role]) is None:
                raise ValueError(
                    f"{flag} {path}: its {role} token {named[role]!r} (named in its configuration) is not "
                    "in its vocabulary; fix tokenizer_config.json or special_tokens_map.json"
                )
            out[role] = named[role]
            continue
        out[role] = next((t for t in usual if tokenizer.token_to_id(t) is not None), None)
        if out[role] is None and role != "unk":
            raise ValueError(
                f"{flag} {path}: the tokenizer has no {role} token (none named by {_ROLE_KEYS[role][0]} in "
                f"tokenizer_config.json or special_tokens_map.json, and none of {', '.join(usual)} in its "
                f"vocabulary); masked-LM pretraining needs one: add it to the tokenizer and name it there"
            )
    return out


def special_ids(tokenizer_dir: str | Path, flag: str = "--tokenizer") -> SpecialIds:
    """The special ids of a tokenizer folder: the fixed ones of swbert's own, else mapped from a
    Hugging Face folder's own special tokens (`special_tokens`)."""
    path = Path(tokenizer_dir)
    _check_folder(path, flag)
    if is_swbert_tokenizer(path):
        return SpecialIds()
    tokenizer = hf_encoder(path, flag)
    tokens = special_tokens(path, flag)
    ids = {
        role: tokenizer.token_to_id(token) if token is not None else None for role, token in tokens.items()
    }
    return SpecialIds(**ids)


def _tokenizer_config(tokenizer_dir: Path, flag: str) -> bytes:
    """tokenizer_config.json for a folder without one, so AutoTokenizer loads its copy (an export's
    too) with the special tokens preprocessing used."""
    tokens = special_tokens(tokenizer_dir, flag)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }
    config.update({f"{role}_token": token for role, token in tokens.items() if token is not None})
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def tokenizer_folder_files(tokenizer_dir: str | Path, flag: str = "--tokenizer") -> dict[str, bytes]:
    """The files a copy of a Hugging Face tokenizer folder holds (shards' `tokenizer/`, a run's, an
    export's), by name: the folder's own tokenizer files, plus a `tokenizer.json` built from a lone
    `vocab.txt` and a `tokenizer_config.json` naming the special tokens when it has none (so every
    copy loads with AutoTokenizer and encodes as preprocessing did). A copy gives back itself."""
    path = Path(tokenizer_dir)
    _check_folder(path, flag)
    files = {name: (path / name).read_bytes() for name in HF_TOKENIZER_FILES if (path / name).is_file()}
    if "tokenizer.json" not in files:
        files["tokenizer.json"] = hf_encoder(path, flag).to_str(pretty=True).encode()
    if "tokenizer_config.json" not in files:
        files["tokenizer_config.json"] = _tokenizer_config(path, flag)
    return dict(sorted(files.items()))


def tokenizer_hash(tokenizer_dir: str | Path) -> str:
    """sha256 identifying a tokenizer: shards and checkpoints record it.

    For swbert's own folders, that of the SentencePiece model file (the HF files are derived from
    it deterministically); for a Hugging Face folder, that of its files as a copy holds them
    (`tokenizer_folder_files`: names and bytes)."""
    path = Path(tokenizer_dir)
    if is_swbert_tokenizer(path):
        return hashlib.sha256((path / SPM_MODEL_NAME).read_bytes()).hexdigest()
    if not is_tokenizer_folder(path):
        raise ValueError(
            f"{tokenizer_dir} is not a tokenizer folder: {SPM_MODEL_NAME}, tokenizer.json and vocab.txt are "
            f"missing. Pass a Hugging Face tokenizer folder, or create one with: {TRAIN_HINT}"
        )
    digest = hashlib.sha256()
    for name, data in tokenizer_folder_files(path).items():
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def load_tokenizer(tokenizer_dir: str | Path) -> PreTrainedTokenizerBase:
    """Load the Hugging Face tokenizer of a tokenizer folder (swbert's, or a copy preprocessing made).

    The result adds `[CLS] ... [SEP]` (and `[SEP]` between the two texts of a pair) when
    `add_special_tokens=True`; a folder of swbert's own is checked to hold the specials at their ids.
    """
    from transformers import AutoTokenizer

    path = Path(tokenizer_dir)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"{path} holds no tokenizer.json. Create the folder with: {TRAIN_HINT}")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if is_swbert_tokenizer(path):
        for token_id, token in zip(SPECIAL_IDS, SPECIAL_TOKENS):
            if tokenizer.convert_tokens_to_ids(token) != token_id:
                raise ValueError(
                    f"{path}: {token} is not at id {token_id}; this folder was not made by swbert"
                )
    return tokenizer
