"""What a person running a job reads: a tiny pretraining run and a tiny GLUE sweep keep to a line
budget (known third-party noise dropped, nothing in colour, the resolved config named in one line,
one line per trial for a new classifier head), and a run says what happens (a status line per
logged step without the progress bar, the closing summary without an export, how the LR goes on when
a resume changes the run's length, where the default corpus is)."""

from __future__ import annotations

import logging
import re
import runpy
import subprocess
from types import SimpleNamespace
from unittest import mock

import pytest

from swbert import logs
from swbert.runtime.optim import lr_factor
from tests.launch_utils import REPO, launch, read_metrics

PRETRAIN_BUDGET = 40  # lines of a tiny pretraining run on 2 ranks, besides the progress bar
GLUE_BUDGET = 60  # lines of a tiny GLUE sweep (two tasks, one trial each)
STEPS, LONGER = 10, 14


def _lines(result: subprocess.CompletedProcess) -> list[str]:
    return (result.stdout + result.stderr).splitlines()


def _no_noise(text: str) -> None:
    """Nothing of KNOWN_NOISE, no colour code, no traceback in a job's output."""
    assert not re.search(r"\x1b\[[0-9;]*m", text), text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    for noise in logs.KNOWN_NOISE:
        assert noise.text not in text, f"{noise.text!r} still shows"


@pytest.fixture(scope="module")
def pretrained(data_dir, tmp_path_factory) -> SimpleNamespace:
    """A tiny run to the end (MLflow and the export on, as a first run has them), then resumed with a
    longer schedule, without an export."""
    out = tmp_path_factory.mktemp("console") / "run"
    args = ["--config", "tiny_cpu", "--data-dir", str(data_dir), "--output-dir", str(out)]
    first = launch(2, [*args, "--train-steps", str(STEPS)])
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    longer = ["--train-steps", str(LONGER), "--log-interval", "2", "--mlflow", "false", "--export", "false"]
    resumed = launch(2, [*args, *longer, "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    return SimpleNamespace(out=out, first=first, resumed=resumed)


@pytest.mark.slow
def test_tiny_pretraining_keeps_to_its_console_budget(pretrained):
    first, out = pretrained.first, pretrained.out
    text = first.stdout + first.stderr
    assert len(_lines(first)) <= PRETRAIN_BUDGET, f"{len(_lines(first))} lines:\n{text}"
    _no_noise(text)
    assert text.count("resolved config (") == 1 and f"({out / 'resolved_config.yaml'}): size tiny" in text
    assert "attention_type: shared" in (out / "resolved_config.yaml").read_text()  # the file holds it all
    # no progress bar in tiny_cpu: a status line per logged step says how it goes
    assert f"step 5/{STEPS}: loss " in first.stdout and f"step {STEPS}/{STEPS}: loss " in first.stdout
    assert f"done: {STEPS} steps" in first.stdout and f"model (Hugging Face folder): {out / 'export'}" in text


@pytest.mark.slow
def test_a_longer_resume_says_how_the_lr_goes_on_and_the_summary_shows_without_export(pretrained):
    """tiny_cpu's linear schedule had decayed to 0 at step 10; over 14 steps it stands at 2e-3 x 4/9 at
    step 10, which the resumed run says and follows."""
    resumed, out = pretrained.resumed, pretrained.out
    new = lr_factor(LONGER, 5, "linear")
    said = (
        f"resume changes the run's length: the LR schedule now spans {LONGER} steps instead of {STEPS}: "
        f"step {STEPS + 1} runs at LR {2e-3 * new(STEPS):.3g} (the saved schedule's 0)"
    )
    assert said in resumed.stderr, resumed.stderr[-3000:]
    assert read_metrics(out)[STEPS + 2]["lr"] == pytest.approx(2e-3 * new(STEPS + 2))
    assert f"step {STEPS + 2}/{LONGER}: loss " in resumed.stdout
    assert f"done: {LONGER} steps" in resumed.stdout, resumed.stdout[-2000:]
    assert "model (Hugging Face folder): not written (--export false)" in resumed.stdout
    assert len(_lines(resumed)) <= PRETRAIN_BUDGET, "\n".join(_lines(resumed))


@pytest.mark.slow
def test_a_tiny_glue_sweep_keeps_to_its_console_budget(tmp_path):
    from swbert.finetune.synthetic import write_glue_fixture
    from tests.finetune_fixtures import make_checkpoint

    glue = write_glue_fixture(tmp_path / "glue", ["sst2", "stsb"], n_train=32, n_dev=16)
    ckpt = make_checkpoint(tmp_path / "ckpt")
    argv = ["--checkpoint", f"tiny={ckpt}", "--tasks", "sst2", "stsb", "--data-dir", str(glue),
            "--output-dir", str(tmp_path / "out"), "--learning-rates", "3e-3", "--seeds", "1", "--epochs", "1",
            "--batch-size", "16", "--max-seq-length", "32"]  # fmt: skip
    result = launch(1, argv, script="launchers/finetune_glue.py")  # forked: imports paid once
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-5000:]
    assert len(_lines(result)) <= GLUE_BUDGET, f"{len(_lines(result))} lines:\n{text}"
    _no_noise(text)
    # a new classifier head on each of the two trials: one line each
    assert text.count(f"SWBertForSequenceClassification {ckpt}: new (not in the checkpoint): ") == 2, text
    assert text.count("resolved arguments: ") == 1 and '"learning_rates"' not in text


def test_known_noise_is_dropped_and_anything_else_shows():
    """Through the handlers `setup_logging` installs: a known message is dropped, a message that only
    resembles one shows, colour codes are stripped, and transformers' load report is one line."""
    from transformers.utils.loading_report import LoadStateDictInfo, log_state_dict_report

    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    handler = Collect()
    handler.setFormatter(logs.PlainFormatter("%(message)s"))
    handler.addFilter(logs.ConsoleFilter())
    noise = logs.Noise("some.lib", "a known harmless message", "for the test")
    logger = logging.getLogger("some.lib.module")
    with mock.patch.object(logs, "KNOWN_NOISE", (noise,)), mock.patch.object(logger, "handlers", [handler]):
        logger.propagate = False
        logger.warning("a known harmless message, with a varying tail 42")
        logger.warning("not a known harmless message")
        logger.warning("\x1b[1mbold\x1b[0m and plain")
        info = LoadStateDictInfo({"classifier.weight", "classifier.bias"}, {"cls.bias"}, set(), [], {}, set())
        model = type("SWBertForSequenceClassification", (), {})()
        log_state_dict_report(model, "/ckpt", False, info, logger=logger)
    logger.propagate = True
    assert records[:2] == ["not a known harmless message", "bold and plain"]
    assert len(records) == 3 and "\n" not in records[2], records
    assert records[2].startswith(
        "SWBertForSequenceClassification /ckpt: new (not in the checkpoint): classifier."
    )
    assert "unused: cls.bias" in records[2]


def test_the_default_corpus_is_announced_before_it_is_built(capsys):
    """Without --data-dir the corpus is built before anything else, logging included: it says so."""
    main = runpy.run_path(str(REPO / "launchers" / "pretrain.py"), run_name="launcher")["main"]
    stop = FileNotFoundError("stopped here by the test")
    with (
        mock.patch("data_prep.default_corpus.ensure_default_data", side_effect=stop),
        pytest.raises(SystemExit),
    ):
        main(["--config", "tiny_cpu", "--mlflow", "false"])
    out = capsys.readouterr().out
    assert "data: the embedded default corpus under " in out and "(no --data-dir; built on first use)" in out
