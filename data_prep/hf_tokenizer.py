"""Turn a SentencePiece model into a Hugging Face tokenizer folder that encodes the same way.

The `tokenizers` pipeline mirrors SentencePiece's: its precompiled normalization map, then
SentencePiece's whitespace handling (strip, collapse runs of spaces), then `▁`-prefixed words,
then the same BPE merges or unigram scores, with byte fallback. For BPE the ids are identical;
for unigram they are identical except where two segmentations of a word have exactly the same
score (e.g. a long run of `=`), where the two libraries may pick different ones of equal score.
"""

from __future__ import annotations

import json
from pathlib import Path

from swbert.data.tokenizer import CLS_ID, SEP_ID, SPECIAL_TOKENS

MODEL_MAX_LENGTH = 512


def _bpe_merges(vocab: list[tuple[str, float]]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece BPE vocabulary: every split of a piece into two pieces,
    ranked by the merged piece's score (SentencePiece stores no merge list of its own)."""
    ids = {piece: i for i, (piece, _) in enumerate(vocab)}
    merges = []
    for piece, score in vocab:
        local = [
            (piece[:k], piece[k:], score)
            for k in range(1, len(piece))
            if piece[:k] in ids and piece[k:] in ids
        ]
        local.sort(key=lambda m: (ids[m[0]], ids[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def build_fast_tokenizer(spm_model: str | Path):  # -> tokenizers.Tokenizer
    """A `tokenizers.Tokenizer` equivalent to the SentencePiece model, with the BERT post-processor."""
    from sentencepiece import sentencepiece_model_pb2 as model_pb2
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE, Unigram

    proto = model_pb2.ModelProto()
    proto.ParseFromString(Path(spm_model).read_bytes())
    trainer, normalizer = proto.trainer_spec, proto.normalizer_spec
    vocab = [(piece.piece, piece.score) for piece in proto.pieces]
    if trainer.model_type == model_pb2.TrainerSpec.UNIGRAM:
        tokenizer = Tokenizer(Unigram(vocab, unk_id=trainer.unk_id, byte_fallback=trainer.byte_fallback))
    elif trainer.model_type == model_pb2.TrainerSpec.BPE:
        model = BPE(
            {piece: i for i, (piece, _) in enumerate(vocab)},
            _bpe_merges(vocab),
            unk_token=trainer.unk_piece,
            fuse_unk=True,
            byte_fallback=trainer.byte_fallback,
        )
        tokenizer = Tokenizer(model)
    else:
        raise ValueError(f"{spm_model}: only unigram and BPE SentencePiece models are supported")

    steps = []
    if normalizer.precompiled_charsmap:
        steps.append(normalizers.Precompiled(normalizer.precompiled_charsmap))
    if normalizer.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    tokenizer.normalizer = normalizers.Sequence(steps)
    prepend = "always" if normalizer.add_dummy_prefix else "never"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend, split=True)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", CLS_ID), ("[SEP]", SEP_ID)],
    )
    return tokenizer


def save_hf_folder(spm_model: str | Path, out_dir: str | Path) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` that `AutoTokenizer` loads.

    Written directly rather than through transformers (whose import takes seconds); the
    config names the generic fast-tokenizer class that every transformers version knows.
    """
    out_dir = Path(out_dir)
    build_fast_tokenizer(spm_model).save(str(out_dir / "tokenizer.json"))
    pad, unk, cls, sep, mask = SPECIAL_TOKENS
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MODEL_MAX_LENGTH,
        "model_input_names": ["input_ids", "token_type_ids", "attention_mask"],
        "pad_token": pad,
        "unk_token": unk,
        "cls_token": cls,
        "sep_token": sep,
        "mask_token": mask,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
