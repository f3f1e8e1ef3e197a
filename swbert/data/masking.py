"""Dynamic masking for masked-language-model pretraining, drawn afresh for every batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swbert.data.tokenizer import MASK_ID, PAD_ID, SPECIAL_IDS


class MaskingCollator:
    """Stack sequences and mask them BERT-style.

    Each non-special position is selected with probability `mlm_probability`; a selected
    position becomes `[MASK]` with probability `mask_fraction` (0.8), a random non-special token
    with probability `random_fraction` (0.1), and stays as it is otherwise. `labels` hold the
    original id at selected positions and -100 elsewhere (ignored by the loss).

    Pass a seeded `generator` (at construction or per call) for reproducible masks: the trainer
    seeds one per step so that a resumed run masks exactly as the uninterrupted one would.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        mlm_probability: float = 0.15,
        mask_fraction: float = 0.8,
        random_fraction: float = 0.1,
        mask_token_id: int = MASK_ID,
        pad_token_id: int = PAD_ID,
        special_ids: Sequence[int] = SPECIAL_IDS,
        generator: torch.Generator | None = None,
    ) -> None:
        if not 0.0 < mlm_probability < 1.0:
            raise ValueError(f"mlm_probability must be in (0, 1), not {mlm_probability}")
        if mask_fraction < 0 or random_fraction < 0 or mask_fraction + random_fraction > 1:
            raise ValueError(
                f"mask_fraction ({mask_fraction}) and random_fraction ({random_fraction}) must be "
                "non-negative and sum to at most 1"
            )
        self.vocab_size = vocab_size
        self.mlm_probability = mlm_probability
        self.mask_fraction = mask_fraction
        self.random_fraction = random_fraction
        self.mask_token_id = mask_token_id
        self.pad_token_id = pad_token_id
        self.special_ids = torch.tensor(sorted(set(special_ids) | {mask_token_id, pad_token_id}))
        allowed = torch.ones(vocab_size, dtype=torch.bool)
        allowed[self.special_ids[self.special_ids < vocab_size]] = False
        # Random replacements come from this table so they can never be a special token.
        self.replacement_ids = torch.nonzero(allowed).flatten()
        if len(self.replacement_ids) == 0:
            raise ValueError(f"vocab_size={vocab_size} leaves no non-special token to draw")
        self.generator = generator

    def __call__(
        self,
        batch: Sequence[torch.Tensor] | torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        """`batch`: a list of (S,) LongTensors or a (B, S) LongTensor.

        Returns `input_ids`, `labels` and `attention_mask`, each (B, S); the input is not modified.
        """
        input_ids = torch.stack(list(batch)) if not isinstance(batch, torch.Tensor) else batch.clone()
        input_ids = input_ids.long()
        gen = generator if generator is not None else self.generator
        special = torch.isin(input_ids, self.special_ids)

        draws = torch.rand(input_ids.shape, generator=gen)  # (B, S)
        selected = (draws < self.mlm_probability) & ~special
        labels = torch.where(selected, input_ids, torch.full_like(input_ids, -100))

        # One more uniform draw splits the selected positions into mask / random / keep.
        action = torch.rand(input_ids.shape, generator=gen)
        to_mask = selected & (action < self.mask_fraction)
        to_random = (
            selected & (action >= self.mask_fraction) & (action < self.mask_fraction + self.random_fraction)
        )
        picks = torch.randint(len(self.replacement_ids), input_ids.shape, generator=gen)
        input_ids = torch.where(to_mask, torch.full_like(input_ids, self.mask_token_id), input_ids)
        input_ids = torch.where(to_random, self.replacement_ids[picks], input_ids)

        attention_mask = (input_ids != self.pad_token_id).long()
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
