"""BERT-uncased text normalization as a SentencePiece rule table, so the tokenizer itself lower-cases.

BERT-base-uncased (the paper's setting, arXiv 2412.00359v1 section 2.5) cleans the text (control
characters dropped, whitespace to a space), lower-cases and strips accents (NFD, combining marks
dropped). Doing this in Python before tokenizing would leave every other user of the tokenizer (the
shard writer, fine-tuning, an exported model) to remember it. Instead the same mapping, code point by
code point, becomes the SentencePiece model's normalization rules: `spm.model` carries it, so its hash
(the tokenizer's identity in manifests and checkpoints) differs from a cased tokenizer's, the shard
writer's SentencePiece applies it, and the Hugging Face `tokenizer.json` reproduces it through the
model's precompiled character map (data_prep.hf_tokenizer), the same path the cased default takes.

Each code point is first NFKC-normalised, as SentencePiece's default rules (`nmt_nfkc`) do for the
cased tokenizer. Rules act on code points, not on sequences; since combining marks are dropped, the
composition that NFKC would do across two code points does not change the result.
"""

from __future__ import annotations

import sys
import unicodedata
from pathlib import Path

LOWERCASE_DESCRIPTION = (
    "NFKC, control characters dropped, whitespace to a space, NFD, combining marks dropped, lower-cased"
)


def _is_control(char: str) -> bool:
    """BERT's `_is_control`: categories Cc and Cf, except the whitespace controls."""
    return char not in "\t\n\r" and unicodedata.category(char) in ("Cc", "Cf")


def uncase(text: str) -> str:
    """The normalization, on a string: what the uncased tokenizer sees before splitting into pieces."""
    out = []
    for char in unicodedata.normalize("NFKC", text):
        if char == "\x00" or char == "\ufffd" or _is_control(char):
            continue
        if char.isspace():
            out.append(" ")
            continue
        decomposed = unicodedata.normalize("NFD", char)
        out.append("".join(c for c in decomposed if unicodedata.category(c) != "Mn").lower())
    return "".join(out)


def write_rules(path: Path) -> int:
    """Write the SentencePiece rule table (`normalization_rule_tsv`) of :func:`uncase`: one line per
    code point it changes, ``source<TAB>target`` in hex code points (empty target: dropped). Returns
    the number of rules."""
    lines = []
    for code in range(sys.maxunicode + 1):
        if code == 0 or 0xD800 <= code <= 0xDFFF:  # NUL is no key SentencePiece accepts; surrogates
            continue
        char = chr(code)
        if unicodedata.category(char) in ("Cn", "Co"):  # unassigned and private use: nothing to map
            continue
        target = uncase(char)
        if target != char:
            lines.append(f"{code:04X}\t{' '.join(f'{ord(c):04X}' for c in target)}\n")
    path.write_text("".join(lines), encoding="ascii")
    return len(lines)
