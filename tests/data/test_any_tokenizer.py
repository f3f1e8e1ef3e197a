"""Preprocessing and pretraining with an existing Hugging Face tokenizer folder (ours; the paper
does not say how its vocabulary was read): its special tokens mapped, recorded in the manifest, used by packing,
masking and the model, and the export carrying it. The tokenizers are built here with the
`tokenizers` library (nothing is downloaded): a WordPiece `vocab.txt` whose specials sit at other
ids than swbert's, and a byte-level BPE `tokenizer.json` with RoBERTa's specials."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer
from tokenizers.implementations import BertWordPieceTokenizer, ByteLevelBPETokenizer

from data_prep.preprocess import main as preprocess_main, preprocess
from data_prep.sources import InputError
from data_prep.verify import verify_dir
from swbert.data import open_corpus, read_manifest
from swbert.data.manifest import special_ids as manifest_special_ids
from swbert.data.packing import PackedSequences
from swbert.data.tokenizer import SpecialIds, special_ids, tokenizer_hash
from swbert.training.config import TrainConfig
from swbert.training.data import TrainingData
from tests.launch_utils import write_corpus

WORDPIECE_SPECIALS = ["[UNK]", "[PAD]", "[SEP]", "[CLS]", "[MASK]"]  # not swbert's order
BPE_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # RoBERTa's; <mask> is added last, at the top id


def wordpiece_folder(folder: Path, corpus: Path, specials: list[str] = WORDPIECE_SPECIALS) -> Path:
    """A bare vocab.txt, as BERT's uncased WordPiece is read (lower-cased, no tokenizer_config.json)."""
    tokenizer = BertWordPieceTokenizer(lowercase=True)
    tokenizer.train([str(corpus)], vocab_size=200, special_tokens=specials, show_progress=False)
    folder.mkdir(parents=True)
    tokenizer.save_model(str(folder))
    return folder


def bpe_folder(folder: Path, corpus: Path) -> Path:
    """tokenizer.json and the tokenizer_config.json that names its specials."""
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train([str(corpus)], vocab_size=400, special_tokens=BPE_SPECIALS, show_progress=False)
    tokenizer.add_special_tokens(["<mask>"])
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "cls_token": "<s>", "sep_token": "</s>", "mask_token": "<mask>", "pad_token": "<pad>",
              "unk_token": "<unk>"}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("any-tokenizer")
    corpus = write_corpus(root / "corpus.txt", documents=120)
    return {
        "corpus": corpus,
        "wordpiece": wordpiece_folder(root / "wordpiece", corpus),
        "bpe": bpe_folder(root / "bpe", corpus),
    }


def reference_ids(kind: str, folder: Path) -> SpecialIds:
    """The ids read independently: a vocab.txt's line numbers, a tokenizer.json's own lookup."""
    if kind == "wordpiece":
        line = {token: i for i, token in enumerate((folder / "vocab.txt").read_text().splitlines())}
        return SpecialIds(
            cls=line["[CLS]"], sep=line["[SEP]"], mask=line["[MASK]"], pad=line["[PAD]"], unk=line["[UNK]"]
        )
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    roles = {"cls": "<s>", "sep": "</s>", "mask": "<mask>", "pad": "<pad>", "unk": "<unk>"}
    return SpecialIds(**{role: tok.token_to_id(token) for role, token in roles.items()})


@pytest.mark.parametrize("kind", ["wordpiece", "bpe"])
def test_special_ids_come_from_the_tokenizer_folder(folders, kind):
    expected = reference_ids(kind, folders[kind])
    assert special_ids(folders[kind]) == expected
    assert expected != SpecialIds()  # not swbert's fixed ids: the mapping is what is tested


@pytest.mark.parametrize("kind", ["wordpiece", "bpe"])
def test_preprocessed_shards_pack_and_mask_with_the_tokenizers_own_ids(folders, kind, tmp_path):
    """The manifest records the ids; the shards hold what AutoTokenizer (loading the folder's copy)
    encodes; packing writes its [CLS]/[SEP], masking its [MASK], never predicting a special."""
    from transformers import AutoTokenizer

    out = tmp_path / "data"
    preprocess([str(folders["corpus"])], folders[kind], out, workers=1, valid_fraction=0.1, progress=False)
    ids = reference_ids(kind, folders[kind])
    manifest = read_manifest(out)
    assert manifest_special_ids(manifest) == ids and manifest["tokenizer"]["hash"] == tokenizer_hash(
        folders[kind]
    )
    assert verify_dir(out)[0] == []
    copy = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    assert (copy.cls_token_id, copy.sep_token_id, copy.mask_token_id, copy.pad_token_id) == (
        ids.cls, ids.sep, ids.mask, ids.pad,
    )  # fmt: skip
    corpus = open_corpus(out)
    first = folders["corpus"].read_text().splitlines()[0]
    documents = [corpus.document(d).tolist() for d in range(len(corpus))]
    assert copy(first, add_special_tokens=False)["input_ids"] in documents
    batch = PackedSequences(corpus, 32).get_batch([0, 1, 2])
    assert (batch[:, 0] == ids.cls).all() and (batch[:, -1] == ids.sep).all()
    data = TrainingData(out, 32, 0.15, seed=3)
    masked = data.batch(0, 4, 0, 1)
    predicted = masked["labels"] != -100
    assert (masked["input_ids"][predicted] == ids.mask).any()
    assert not np.isin(masked["labels"][predicted].numpy(), ids.ids).any()


def test_swbert_manifests_without_ids_keep_the_fixed_ids():
    manifest = {"tokenizer": {"hash": "0" * 64, "vocab_size": 96}}
    assert manifest_special_ids(manifest) == SpecialIds(cls=2, sep=3, mask=4, pad=0, unk=1)


def test_a_tokenizer_without_a_mask_token_is_refused_in_one_line(folders, tmp_path, capsys):
    no_mask = wordpiece_folder(tmp_path / "no-mask", folders["corpus"], ["[UNK]", "[PAD]", "[CLS]", "[SEP]"])
    args = ["--input", str(folders["corpus"]), "--tokenizer", str(no_mask), "--output", str(tmp_path / "out")]
    with pytest.raises(InputError) as err:
        preprocess_main(args)
    message = str(err.value)
    assert "--tokenizer" in message and "mask" in message and "\n" not in message
    assert not (tmp_path / "out").exists()  # refused before anything ran
    with pytest.raises(ValueError, match="--tokenizer .*no mask token") as err:
        TrainConfig(tokenizer=str(no_mask)).check()
    assert "\n" not in str(err.value)


def test_a_tokenizer_other_than_the_datas_is_refused(folders, tmp_path):
    out = tmp_path / "data"
    preprocess([str(folders["corpus"])], folders["bpe"], out, workers=1, progress=False)
    TrainConfig(tokenizer=str(folders["bpe"]), data_dir=str(out)).check()  # the shards' own: accepted
    with pytest.raises(ValueError, match="--tokenizer .* is not the tokenizer the shards of"):
        TrainConfig(tokenizer=str(folders["wordpiece"]), data_dir=str(out)).check()


@pytest.mark.slow
def test_the_default_corpus_is_tokenized_with_the_given_tokenizer(folders, tmp_path):
    """`--tokenizer` without `--data-dir`: the embedded corpus in shards of that tokenizer's own."""
    from data_prep.default_corpus import ensure_default_data

    data = ensure_default_data(tmp_path, workers=1, max_corpus_bytes=30_000, tokenizer=folders["bpe"])
    assert data.name == f"shards-tok{tokenizer_hash(folders['bpe'])[:12]}-max30000"
    assert manifest_special_ids(read_manifest(data)) == reference_ids("bpe", folders["bpe"])
    assert not list(tmp_path.glob("tokenizer-*"))  # no SentencePiece model trained


@pytest.mark.slow
def test_pretraining_with_a_bpe_tokenizer_exports_it(folders, tmp_path):
    """A few steps on BPE shards (its [PAD] at 1, its mask at the top id): the model pads with the
    tokenizer's pad id, and the export's tokenizer loads with AutoTokenizer and encodes as the shards."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    import swbert  # noqa: F401  (registers the Auto classes)
    from tests.e2e.test_pretrain import check_ok, tiny_args
    from tests.launch_utils import run_single

    data = tmp_path / "data"
    preprocess([str(folders["corpus"])], folders["bpe"], data, workers=1, progress=False)
    out = tmp_path / "run"
    steps = ["--train-steps", "4", "--save-interval", "4", "--log-interval", "2", "--eval-batches", "0"]
    check_ok(
        run_single(tiny_args(data, out, *steps, "--tokenizer", str(folders["bpe"]), "--num-workers", "0"))
    )
    ids = reference_ids("bpe", folders["bpe"])
    tokenizer = AutoTokenizer.from_pretrained(str(out / "export"))
    assert (tokenizer.mask_token_id, tokenizer.pad_token_id) == (ids.mask, ids.pad)
    first = folders["corpus"].read_text().splitlines()[0]
    expected = (
        Tokenizer.from_file(str(folders["bpe"] / "tokenizer.json"))
        .encode(first, add_special_tokens=False)
        .ids
    )
    assert tokenizer(first, add_special_tokens=False)["input_ids"] == expected
    model = AutoModelForMaskedLM.from_pretrained(str(out / "export"))
    assert model.config.pad_token_id == ids.pad and model.config.vocab_size == ids.mask + 1
