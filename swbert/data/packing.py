"""Pack documents into fixed-length training sequences without padding."""

from __future__ import annotations

import numpy as np
import torch

from swbert.data.corpus import Corpus
from swbert.data.tokenizer import CLS_ID, SEP_ID


class PackedSequences(torch.utils.data.Dataset):
    """Fixed-length sequences `[CLS] ... [SEP]` cut from the documents of a corpus.

    The documents, in corpus order, form one stream `doc0 [SEP] doc1 [SEP] ... docN`; sample
    `i` is `[CLS]` + the stream's tokens `[i*k, (i+1)*k)` + `[SEP]` with `k = seq_len - 2`.
    A document longer than `k` continues in the next sample; the last partial sample is
    dropped, so no sample needs padding (and the collator's attention mask is all ones).

    Construction is one cumulative sum over the document lengths (O(documents), no Python loop
    over tokens); reading a sample touches only the documents it overlaps.
    """

    def __init__(self, corpus: Corpus, seq_len: int) -> None:
        if seq_len < 3:
            raise ValueError(f"seq_len must be at least 3 ([CLS] token [SEP]), not {seq_len}")
        self.corpus = corpus
        self.seq_len = seq_len
        self._content = seq_len - 2
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
        if not 0 <= index < self._num_samples:
            raise IndexError(f"sample {index} out of range [0, {self._num_samples})")
        begin = index * self._content
        end = begin + self._content
        out = np.empty(self.seq_len, dtype=np.int64)
        out[0] = CLS_ID
        out[-1] = SEP_ID
        doc = int(np.searchsorted(self._doc_starts, begin, side="right")) - 1
        pos = begin
        while pos < end:
            doc_start = int(self._doc_starts[doc])
            doc_len = int(self.corpus.doc_lengths[doc])
            if pos < doc_start + doc_len:  # inside the document's tokens
                take = min(end, doc_start + doc_len) - pos
                out[1 + pos - begin : 1 + pos - begin + take] = self.corpus.read(doc, pos - doc_start, take)
                pos += take
            else:  # on the separator after the document
                out[1 + pos - begin] = SEP_ID
                pos += 1
                doc += 1
        return torch.from_numpy(out)
