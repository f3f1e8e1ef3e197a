"""Pack documents into fixed-length training sequences without padding."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from swbert.data.corpus import Corpus
from swbert.data.tokenizer import SEP_ID


class PackedSequences(torch.utils.data.Dataset):
    """Fixed-length sequences `[CLS] ... [SEP]` cut from the documents of a corpus.

    The documents, in corpus order, form one stream `doc0 [SEP] doc1 [SEP] ... docN`; sample
    `i` is `[CLS]` + the stream's tokens `[i*k, (i+1)*k)` + `[SEP]` with `k = seq_len - 2`.
    A document longer than `k` continues in the next sample; the last partial sample is
    dropped, so no sample needs padding (and the collator's attention mask is all ones).

    Construction is one cumulative sum over the document lengths (O(documents), no Python loop
    over tokens); reading a batch (`get_batch`) touches only the documents its samples overlap,
    with no Python loop over samples or tokens.
    """

    def __init__(self, corpus: Corpus, seq_len: int) -> None:
        if seq_len < 3:
            raise ValueError(f"seq_len must be at least 3 ([CLS] token [SEP]), not {seq_len}")
        self.corpus = corpus
        self.seq_len = seq_len
        self._content = seq_len - 2
        self.cls_id, self.sep_id = corpus.special_ids.cls, corpus.special_ids.sep  # its tokenizer's
        lengths = corpus.doc_lengths.astype(np.int64)
        # Start of each document in the stream: previous lengths plus one [SEP] per document.
        self._doc_starts = np.concatenate(([0], np.cumsum(lengths + 1)[:-1])) if len(lengths) else lengths
        stream_len = int(lengths.sum() + max(len(lengths) - 1, 0))
        self._num_samples = stream_len // self._content
        if self._num_samples == 0:
            raise ValueError(
                f"the {corpus.split} split of {corpus.data_dir} holds {corpus.num_tokens} tokens in "
                f"{corpus.num_documents} documents, less than one sequence of {seq_len}: "
                "use a shorter seq_len or a larger corpus"
            )

    def __len__(self) -> int:
        return self._num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        """Sample `index`: a (seq_len,) LongTensor."""
        return torch.from_numpy(self.get_batch([index])[0])

    def get_batch(self, indices: np.ndarray | Sequence[int]) -> np.ndarray:
        """Samples `indices`, stacked: a (B, seq_len) int64 array.

        Vectorised over every token of the batch: each stream position finds its document with
        one `searchsorted`, and the corpus reads all of them with one gather per shard.
        """
        index = np.asarray(indices, dtype=np.int64).reshape(-1)  # (B,)
        if len(index) and (index.min() < 0 or index.max() >= self._num_samples):
            bad = int(index[(index < 0) | (index >= self._num_samples)][0])
            raise IndexError(f"sample {bad} out of range [0, {self._num_samples})")
        stream = index[:, None] * self._content + np.arange(self._content)  # (B, k) stream positions
        # Row by row the positions increase, which keeps numpy's binary search short.
        doc = np.searchsorted(self._doc_starts, stream, side="right") - 1  # (B, k)
        offset = stream - self._doc_starts[doc]  # (B, k) position within the document
        separator = offset == self.corpus.doc_lengths[doc]  # one past a document's end: its [SEP]
        out = np.empty((len(index), self.seq_len), dtype=np.int64)
        out[:, 0] = self.cls_id
        out[:, -1] = self.sep_id
        body = out[:, 1:-1]  # (B, k), a view
        body[separator] = self.sep_id
        text = ~separator
        body[text] = self.corpus.gather(doc[text], offset[text])
        return out


def document_seqlens(input_ids: np.ndarray, sep_id: int = SEP_ID) -> tuple[torch.Tensor, int]:
    """The documents of a packed batch (B, S) as the sequences of one token stream: `cu_seqlens`
    (int32, over the B x S tokens) and `max_seqlen`, for attention within each document only.

    A sample is `[CLS] ... [SEP]`, and a `[SEP]` inside it ends a document (`PackedSequences`); the
    next token starts the next one. The leading `[CLS]` belongs to the first document of its
    sample and the closing `[SEP]` to the last. Computed on the host, in the loader's workers, so
    the step needs no device-to-host read for it. (Document-aware attention is ours, as ModernBERT
    trains; the paper packs sequences without it.)"""
    batch, seq_len = input_ids.shape
    starts = np.zeros((batch, seq_len), dtype=bool)
    starts[:, 0] = True
    starts[:, 2:] = input_ids[:, 1:-1] == sep_id  # the token after an inner [SEP]
    cu_seqlens = np.append(np.flatnonzero(starts), batch * seq_len).astype(np.int32)
    return torch.from_numpy(cu_seqlens), int(np.diff(cu_seqlens).max())
