"""Saved models load in plain transformers: remote code (auto_map), fill-mask pipelines, Trainer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from swbert.models import SWBertConfig, SWBertForMaskedLM, SWBertForSequenceClassification
from swbert.models.remote_code import add_remote_code
from tests.launch_utils import HANG_S, job_env

VARIANTS = ["shared", "standard", "pairwise"]
IDS = [[2, 10, 11, 4, 12, 13, 3], [2, 20, 4, 21, 3, 0, 0]]
MASK = [[1] * 7, [1] * 5 + [0, 0]]

# Runs where `import swbert` fails: only transformers and the folder's own code can build the model.
PLAIN = """
import json, sys
sys.modules["swbert"] = None  # any import of swbert now raises ImportError
import torch
from torch.testing import assert_close
from transformers import AutoModelForMaskedLM, pipeline

from transformers import AutoModelForSequenceClassification

classifier = AutoModelForSequenceClassification.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
with torch.no_grad():
    scores = classifier(input_ids=torch.tensor([[2, 10, 11, 3]])).logits
assert_close(scores, torch.load(f"{sys.argv[1]}/../expected.pt"), rtol=1e-5, atol=1e-5)

for folder in sys.argv[2:]:
    model = AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    ids, mask = (torch.tensor(json.loads(open(f"{folder}/../{k}.json").read())) for k in ("ids", "mask"))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    assert_close(logits, torch.load(f"{folder}/../expected.pt"), rtol=1e-5, atol=1e-5)
    fill = pipeline("fill-mask", model=folder, trust_remote_code=True, top_k=3)
    predictions = fill("the cat [MASK] the dog")
    assert len(predictions) == 3 and all("token_str" in p and p["score"] > 0 for p in predictions), predictions
    print(folder, "ok", predictions[0]["token_str"])
assert [m for m in sys.modules if m.startswith("swbert") and sys.modules[m] is not None] == []
"""


def saved_model(root: Path, variant: str, tokenizer_dir: Path) -> tuple[Path, SWBertForMaskedLM]:
    """A tiny model with non-trivial weights, saved with its code and a tokenizer."""
    torch.manual_seed(0)
    model = SWBertForMaskedLM(SWBertConfig.from_size("tiny", attention_type=variant, vocab_size=96)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # not the initial values (diagonals at one, zero biases)
    folder = root / variant / "model"
    model.save_pretrained(folder)
    add_remote_code(folder)
    for item in tokenizer_dir.iterdir():
        if item.is_file() and item.name != "config.json":
            shutil.copy2(item, folder / item.name)
    (root / variant / "ids.json").write_text(json.dumps(IDS))
    (root / variant / "mask.json").write_text(json.dumps(MASK))
    with torch.no_grad():
        expected = model(input_ids=torch.tensor(IDS), attention_mask=torch.tensor(MASK)).logits
    torch.save(expected, root / variant / "expected.pt")
    return folder, model


@pytest.fixture(scope="module")
def folders(data_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("remote-code")
    return {v: saved_model(root, v, data_dir.parent / "tok")[0] for v in VARIANTS}


@pytest.mark.slow
def test_exported_code_loads_without_swbert_and_gives_swbert_logits(folders, tmp_path):
    config = json.loads((folders["shared"] / "config.json").read_text())
    assert config["auto_map"]["AutoModelForMaskedLM"].endswith(".SWBertForMaskedLM")
    copied = {p.name for p in folders["shared"].glob("*.py")}
    assert copied and all("swbert" not in line for p in copied for line in _imports(folders["shared"] / p))
    env = job_env(HF_MODULES_CACHE=str(tmp_path / "modules"))
    env.pop("PYTHONPATH")  # nor from the checkout
    torch.manual_seed(0)  # a fine-tuned head, saved as fine-tuning saves it
    classifier = SWBertForSequenceClassification(
        SWBertConfig.from_size("tiny", vocab_size=96, num_labels=3)
    ).eval()
    (tmp_path / "cls").mkdir()
    classifier.save_pretrained(tmp_path / "cls" / "model")
    add_remote_code(tmp_path / "cls" / "model")
    with torch.no_grad():
        torch.save(
            classifier(input_ids=torch.tensor([[2, 10, 11, 3]])).logits, tmp_path / "cls" / "expected.pt"
        )
    done = subprocess.run(
        [sys.executable, "-c", PLAIN, str(tmp_path / "cls" / "model"), *map(str, folders.values())],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,  # a hang guard
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count(" ok ") == len(VARIANTS)


def _imports(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith(("import ", "from "))]


def test_with_swbert_imported_its_own_classes_load_the_folder(folders):
    from transformers import AutoModelForMaskedLM

    model = AutoModelForMaskedLM.from_pretrained(folders["pairwise"])  # no trust_remote_code needed
    assert type(model) is SWBertForMaskedLM


def test_trainer_evaluate_on_a_saved_model(folders, tmp_path):
    """Eval-mode outputs follow transformers' convention, so Trainer's loss and predictions line up."""
    from transformers import Trainer, TrainingArguments

    model = SWBertForMaskedLM.from_pretrained(folders["shared"])
    rows = []
    for ids, mask in zip(IDS, MASK):
        labels = [-100] * len(ids)
        labels[2] = ids[2]
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    seen = {}

    def metrics(prediction):
        seen["shapes"] = (prediction.predictions.shape, prediction.label_ids.shape)
        return {}

    args = TrainingArguments(tmp_path, per_device_eval_batch_size=2, report_to=[], use_cpu=True)
    result = Trainer(model=model, args=args, eval_dataset=rows, compute_metrics=metrics).evaluate()
    with torch.no_grad():
        batch = {k: torch.tensor([r[k] for r in rows]) for k in rows[0]}
        expected = model.eval()(**batch).loss
    assert_close(torch.tensor(result["eval_loss"]), expected, rtol=1e-5, atol=1e-6)
    assert seen["shapes"] == ((2, 7, 96), (2, 7))
