"""Held-out masked-LM loss, perplexity and accuracy of a checkpoint or an export on a data folder.

    python -m swbert.evaluate runs/mini-shared/export --data-dir runs/data/default/shards-v8000
    python -m swbert.evaluate runs/mini-shared/checkpoints --data-dir DIR --json eval.json

The model reads the folder's validation split, packed into `--seq-len` sequences and masked as
pretraining's validation masks them (the same seed gives the same masks), on the GPU when there is
one. Beside the model's figures it prints the unigram and bigram floors: the loss of predicting every
masked token from the training split's token counts alone, and from the pair counts of its visible
left neighbour (ours; `swbert.data.floors`). A model near the unigram floor has learnt word
frequencies, not context.

A checkpoint (a `checkpoints/` folder's newest complete one, or a `step_*` folder) is checked against
its hashes before it is read; data made with another tokenizer than the model's is refused.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swbert import cli
from swbert.data.corpus import Corpus
from swbert.data.floors import NgramFloors
from swbert.models import SWBertForMaskedLM
from swbert.models.modeling import IGNORE_INDEX


@dataclass
class EvaluateConfig:
    """The flags of `python -m swbert.evaluate`."""

    # an export folder (config.json), a run's checkpoints/ folder or one step_* folder
    model: Path = field(metadata={"positional": True})
    data_dir: Path  # shards from data_prep.preprocess; their validation split is read
    seq_len: int = 128  # tokens per packed sequence, [CLS] and [SEP] included
    mlm_probability: float = 0.15  # fraction of tokens predicted, as in pretraining
    batch_size: int = 32  # sequences per forward pass
    # validation sequences to read (default: the split once); more go round the split again with
    # other masks, as pretraining's validation does when eval_batches asks for more than it holds
    sequences: int | None = None
    seed: int = 1234  # the masks: pretraining's validation with the same seed masks the same tokens
    json: Path | None = None  # also write the figures here


def load_model(path: Path) -> tuple[SWBertForMaskedLM, dict]:
    """The model of an export or a checkpoint, and what it records of its tokenizer."""
    if (path / "config.json").is_file():
        model = SWBertForMaskedLM.from_pretrained(path)
        return model, {"vocab_sha256": getattr(model.config, "tokenizer_sha256", None)}
    from swbert.runtime.checkpoint_format import META
    from swbert.training.export import ExportConfig, _tag_dir, load_model_from_checkpoint

    tag_dir = _tag_dir(ExportConfig(path, path))
    meta = json.loads((tag_dir / META).read_text())
    return load_model_from_checkpoint(tag_dir), {"hash": meta.get("model", {}).get("tokenizer_hash")}


def check_same_tokenizer(recorded: dict, corpus: Corpus, model: Path, data_dir: Path) -> None:
    """Refuse data whose tokenizer is not the one the model records (when it records one)."""
    if recorded.get("hash") and recorded["hash"] != corpus.tokenizer_hash:
        found = corpus.tokenizer_hash[:12]
        raise ValueError(
            f"--data-dir {data_dir} was tokenized with tokenizer {found}, but {model} was trained with "
            f"{recorded['hash'][:12]}: preprocess the text with the model's tokenizer"
        )
    if recorded.get("vocab_sha256") and corpus.tokenizer_dir is not None:
        from transformers import AutoTokenizer

        from swbert.runtime.run_tokenizer import tokenizer_fingerprint

        if (
            tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(corpus.tokenizer_dir)))
            != recorded["vocab_sha256"]
        ):
            raise ValueError(
                f"--data-dir {data_dir} was tokenized with another vocabulary than {model}/config.json "
                "records (tokenizer_sha256): preprocess the text with the model's tokenizer"
            )


@torch.no_grad()
def evaluate(args: EvaluateConfig) -> dict[str, float]:
    from swbert.training.data import TrainingData

    model, recorded = load_model(args.model)
    data = TrainingData(args.data_dir, args.seq_len, args.mlm_probability, args.seed)
    check_same_tokenizer(recorded, data.train.corpus, args.model, args.data_dir)
    if data.valid is None:
        raise ValueError(f"--data-dir {args.data_dir} has no validation split large enough for one sequence")
    if model.config.vocab_size < data.vocab_size:
        raise ValueError(f"{args.model} reads {model.config.vocab_size} ids, the data has {data.vocab_size}")
    sequences = args.sequences or len(data.valid)
    batch_size = min(args.batch_size, sequences)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    floors = NgramFloors(data.train.corpus, data.special_ids.ids)
    loss_sum = unigram_sum = bigram_sum = correct = predicted = 0.0
    for start in range(0, sequences - batch_size + 1, batch_size):
        cpu_batch = data.batch(start, batch_size, 0, 1, valid=0)
        uni, bi, _ = floors.batch_nll(cpu_batch)
        unigram_sum, bigram_sum = unigram_sum + uni, bigram_sum + bi
        batch = {k: v.to(device) for k, v in cpu_batch.items()}
        target = batch["mlm_labels"].reshape(-1)
        inputs = {k: v for k, v in batch.items() if k != "mlm_labels"}
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            out = model(**inputs, mlm_targets=batch["mlm_labels"])
        labelled = target != IGNORE_INDEX
        n = labelled.sum().item()
        loss_sum += out.loss.double().item() * n
        correct += ((out.logits.argmax(-1) == target) & labelled).sum().item()
        predicted += n
    predicted = max(predicted, 1.0)
    loss, floor = loss_sum / predicted, unigram_sum / predicted
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "mlm_accuracy": correct / predicted,
        "unigram_loss": floor,
        "below_unigram": floor - loss,
        "bigram_loss": bigram_sum / predicted,
        "sequences": float(start + batch_size),
        "predicted_tokens": predicted,
    }


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = cli.parse_or_exit(EvaluateConfig, argv, __doc__, recipes=False)
    try:
        figures = evaluate(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(
        f"{args.model}: held-out loss {figures['loss']:.4f}, perplexity {figures['perplexity']:.2f}, "
        f"MLM accuracy {figures['mlm_accuracy']:.4f} over {int(figures['predicted_tokens']):,} masked "
        f"tokens of {int(figures['sequences']):,} sequences; unigram floor {figures['unigram_loss']:.4f} "
        f"({figures['below_unigram']:+.4f} below it), bigram floor {figures['bigram_loss']:.4f}"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
