"""The trainer's view of the data: packed sequences, the global sample stream, masks by position.

Every sample has a position in one global stream (see `swbert.data.GlobalSampler`), and its
mask is drawn from a generator keyed by (seed, position). So what a step sees depends only on
how many samples came before it: not on the number of ranks, and not on whether the run was
interrupted and resumed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from swbert.data import GlobalSampler, MaskingCollator, PackedSequences, open_corpus


def prepare_data(data_dir: str | Path | None) -> Path:
    """The folder of shards to train on, checked to hold a manifest. Building data is the offline
    tools' job (`data_prep`; the pretraining entry point builds the embedded default corpus)."""
    if data_dir is None:
        raise ValueError(
            "no --data-dir: make shards with `python -m data_prep.preprocess --input FILES --tokenizer "
            "TOK_DIR --output DIR`, or run launchers/pretrain.py, which builds the embedded default corpus"
        )
    path = Path(data_dir)
    if not (path / "manifest.json").is_file():
        raise FileNotFoundError(
            f"--data-dir {path} holds no manifest.json: make shards with "
            f"`python -m data_prep.preprocess --input FILES --tokenizer TOK_DIR --output {path}`"
        )
    return path


class TrainingData:
    """Train and validation sequences of one data folder, served by global stream position."""

    def __init__(self, data_dir: Path, seq_len: int, mlm_probability: float, seed: int) -> None:
        self.data_dir = Path(data_dir)
        corpus = open_corpus(data_dir, "train")
        self.train = PackedSequences(corpus, seq_len)
        self.vocab_size = corpus.vocab_size
        self.tokenizer_hash = corpus.tokenizer_hash
        self.tokenizer_dir = corpus.tokenizer_dir
        self.valid = None
        if any(shard["valid"]["documents"] > 0 for shard in corpus.manifest["shards"]):
            try:
                self.valid = PackedSequences(open_corpus(data_dir, "valid", corpus.tokenizer_hash), seq_len)
            except ValueError as err:
                if "less than one sequence" not in str(err):
                    raise
        self.collator = MaskingCollator(self.vocab_size, mlm_probability=mlm_probability)
        self.seed = seed
        self._samplers: dict[tuple, GlobalSampler] = {}

    @property
    def has_valid(self) -> bool:
        return self.valid is not None

    def _sampler(self, eval_split: bool, micro_bs: int, dp_rank: int, dp_size: int) -> GlobalSampler:
        key = (eval_split, micro_bs, dp_rank, dp_size)
        if key not in self._samplers:
            data = self.valid if eval_split else self.train
            self._samplers[key] = GlobalSampler(
                len(data),
                seed=self.seed,
                micro_batch_size=micro_bs,
                dp_rank=dp_rank,
                dp_size=dp_size,
                shuffle=not eval_split,
            )
        return self._samplers[key]

    def batch(
        self, samples_before: int, micro_bs: int, dp_rank: int, dp_size: int, eval_split: bool = False
    ) -> dict[str, torch.Tensor]:
        """This rank's micro-batch of the global batch that starts at stream position `samples_before`."""
        data = self.valid if eval_split else self.train
        sampler = self._sampler(eval_split, micro_bs, dp_rank, dp_size)
        epoch, consumed = divmod(samples_before, len(data))
        sampler.load_state_dict({"epoch": epoch, "consumed": consumed})
        indices = next(iter(sampler))
        first = samples_before + dp_rank * micro_bs
        stream_seed = self.seed + (1_000_003 if eval_split else 0)
        parts = []
        for j, index in enumerate(indices):
            g = torch.Generator().manual_seed(stream_seed * 2**32 + first + j)
            parts.append(self.collator(data[index][None], generator=g))
        return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}

    def sampler_state(self, samples_consumed: int) -> dict:
        epoch, consumed = divmod(samples_consumed, len(self.train))
        return {"epoch": epoch, "consumed": consumed, "seed": self.seed, "num_samples": len(self.train)}
