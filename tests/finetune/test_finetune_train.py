"""End to end on CPU: GLUE and SQuAD launchers with tiny models, real MLflow stores, and the trainer."""

from __future__ import annotations

import json
import math
import os
import runpy
from collections import Counter
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from swbert import SWBertConfig, SWBertForSequenceClassification
from swbert.finetune.glue_data import EncodedDataset, load_glue_split, pad_collate
from swbert.finetune.synthetic import write_glue_fixture, write_squad_fixture
from swbert.finetune.tasks import get_task
from swbert.finetune.trainer import FinetuneConfig, deepspeed_config, fit
from tests.finetune_fixtures import make_checkpoint, write_triviaqa_fixture

ROOT = Path(__file__).resolve().parents[2]


def launcher(name: str):
    return runpy.run_path(str(ROOT / "launchers" / f"{name}.py"), run_name="launcher")["main"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One MLflow store for the module (creating a SQLite store costs seconds); an experiment per test."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def runs_of(uri: str, experiment: str, filter_string: str = "") -> list:
    client = MlflowClient(uri)
    return client.search_runs([client.get_experiment_by_name(experiment).experiment_id], filter_string)


@pytest.fixture(scope="module")
def glue_run(tmp_path_factory, store):
    """One GLUE sweep: four tasks, noise and cross-domain evaluation, through the launcher."""
    root = tmp_path_factory.mktemp("glue_run")
    write_glue_fixture(root / "glue", ["sst2", "stsb", "mrpc", "qnli"], n_train=192, n_dev=48)
    ckpt = make_checkpoint(root / "ckpt")
    out = root / "out"
    argv = ["--checkpoint", f"tiny={ckpt}", "--tasks", "sst2", "stsb", "mrpc", "qnli", "--data-dir", str(root / "glue"),
            "--output-dir", str(out), "--learning-rates", "3e-3", "--seeds", "1", "--epochs", "6", "--batch-size", "16",
            "--max-seq-length", "32", "--noise-levels", "0", "0.2", "--noise-seeds", "0", "--cross-domain",
            "--tracking-uri", store, "--experiment", "glue"]  # fmt: skip
    assert launcher("finetune_glue")(argv) == 0
    assert not (out / "mlflow.db").exists() and not (root / "mlflow.db").exists()  # --tracking-uri wins
    return out, {
        (r.data.tags["swbert.kind"], r.data.tags.get("swbert.task")): r for r in runs_of(store, "glue")
    }


@pytest.mark.slow
def test_classifier_beats_chance_by_a_wide_margin(glue_run):
    _, runs = glue_run
    sst2 = runs[("glue_trial", "sst2")]
    assert sst2.info.status == "FINISHED"
    assert sst2.data.metrics["best/validation/accuracy"] >= 0.9  # chance is 0.5
    assert sst2.data.params["learning_rate"] == "0.003" and sst2.data.params["weight_decay"] == "0.1"
    parent = runs[("glue_sweep", None)]
    assert sst2.data.tags["mlflow.parentRunId"] == parent.info.run_id  # one parent per sweep


@pytest.mark.slow  # reads the GLUE sweep the glue_run fixture trains
def test_regression_and_pair_tasks_produce_their_metrics(glue_run):
    out, runs = glue_run
    stsb = runs[("glue_trial", "stsb")].data.metrics
    assert math.isfinite(stsb["best/validation/pearson"]) and math.isfinite(stsb["best/validation/spearman"])
    kept = next((out / "tiny" / "stsb").iterdir())
    config = SWBertConfig.from_pretrained(kept)
    assert config.num_labels == 1 and config.problem_type == "regression" and config.glue_task == "stsb"
    assert {"best/validation/accuracy", "best/validation/f1"} <= set(
        runs[("glue_trial", "mrpc")].data.metrics
    )
    # the majority class's share of the dev labels, what the tables judge a seed at chance against
    labels = load_glue_split(get_task("mrpc"), "validation", out.parent / "glue").labels
    majority = Counter(labels.tolist()).most_common(1)[0][1] / len(labels)
    mrpc = runs[("glue_trial", "mrpc")].data.metrics
    assert mrpc["best/validation/majority_accuracy"] == pytest.approx(majority)
    assert "best/validation/majority_accuracy" not in stsb  # regression: no classes
    table = (out / "report" / "table1_glue.md").read_text()
    # the paper's metric per task; Avg needs all eight of the paper's tasks, four were run
    assert table.splitlines()[2] == "| Model | MRPC (Acc) | STS-B (P) | QNLI (Acc) | SST-2 (Acc) | Avg |"
    assert table.splitlines()[4].endswith(" | – |")


@pytest.mark.slow  # reads the GLUE sweep the glue_run fixture trains
def test_noise_level_zero_matches_the_trial_and_cross_domain_is_logged(glue_run, store):
    out, runs = glue_run
    noise = runs[("noise", "sst2")]
    client = MlflowClient(store)
    curve = {m.step: m.value for m in client.get_metric_history(noise.info.run_id, "validation/accuracy")}
    assert set(curve) == {0, 20}
    assert curve[0] == runs[("glue_trial", "sst2")].data.metrics["best/validation/accuracy"]
    cross = runs[("cross_domain", "mrpc")].data.metrics
    assert set(cross) == {
        "mrpc/validation/accuracy",
        "mrpc/validation/binary_accuracy",
        "qnli/validation/accuracy",
    }
    # the diagonal is the task's own accuracy: the trial's best dev accuracy, the same model
    mrpc_trial = runs[("glue_trial", "mrpc")].data.metrics["best/validation/accuracy"]
    assert cross["mrpc/validation/accuracy"] == pytest.approx(mrpc_trial)
    for stem in ("table5_noise", "table5_noise_relative"):  # both noise definitions, each its own table
        assert (out / "report" / f"{stem}.png").stat().st_size > 0
    table6 = (out / "report" / "table6_cross_domain.md").read_text().splitlines()
    assert table6[2] == "| Model | Trained on | QNLI | MRPC |"
    assert table6[5].startswith("| tiny | MRPC | ") and table6[5].endswith(f" | **{100 * mrpc_trial:.1f}** |")
    sweep = runs[("glue_sweep", None)].info.run_id  # the report and figures are its artifacts
    artifacts = {a.path for a in client.list_artifacts(sweep, "report")}
    assert {"report/table5_noise.png", "report/figure3_finetune_time.png"} <= artifacts
    assert "system/cpu_utilization_percentage" in client.get_run(sweep).data.metrics


@pytest.mark.slow  # reads the GLUE sweep the glue_run fixture trains
def test_evaluate_finetuned_reproduces_the_clean_score(glue_run, store, tmp_path):
    out, runs = glue_run
    kept = next((out / "tiny" / "sst2").iterdir())
    argv = ["--evaluate-finetuned", "--checkpoint", f"tiny={kept}", "--data-dir", str(out.parent / "glue"),
            "--output-dir", str(tmp_path), "--noise-levels", "0", "--noise-seeds", "5", "--max-seq-length", "32",
            "--tracking-uri", store, "--experiment", "evaluate"]  # fmt: skip
    assert launcher("finetune_glue")(argv) == 0
    expected = 100 * runs[("glue_trial", "sst2")].data.metrics["best/validation/accuracy"]
    for stem in ("table5_noise", "table5_noise_relative"):
        csv = (tmp_path / "report" / f"{stem}.csv").read_text().splitlines()
        assert csv[1].split(",")[:3] == ["tiny", "sst2", "accuracy"]
        assert float(csv[1].split(",")[3]) == pytest.approx(expected)


@pytest.mark.slow  # reads the GLUE sweep the glue_run fixture trains
def test_evaluate_finetuned_groups_several_folders_under_one_variant(glue_run, store, tmp_path):
    """docs/finetuning.md's Table 6 from fine-tuned folders: one name for every folder of a variant
    (and bare paths, named by their attention type) gives the sweep's own cross-domain table."""
    from swbert.finetune.glue import GlueSweep

    out, _ = glue_run
    mrpc, qnli = (next((out / "tiny" / task).iterdir()) for task in ("mrpc", "qnli"))
    bare = GlueSweep(checkpoint=[str(mrpc), str(qnli)], output_dir=tmp_path, evaluate_finetuned=True)
    assert [c.name for c in bare.checkpoints()] == ["shared", "shared"]
    argv = ["--evaluate-finetuned", "--cross-domain", "--checkpoint", f"shared={mrpc}", f"shared={qnli}",
            "--data-dir", str(out.parent / "glue"), "--output-dir", str(tmp_path), "--max-seq-length", "32",
            "--tracking-uri", store, "--experiment", "evaluate-cross"]  # fmt: skip
    assert launcher("finetune_glue")(argv) == 0
    ours = (tmp_path / "report" / "table6_cross_domain.md").read_text().splitlines()
    sweeps = (out / "report" / "table6_cross_domain.md").read_text().splitlines()
    assert ours[2:] == [line.replace("| tiny |", "| shared |") for line in sweeps[2:]]
    assert sorted(line.split(" | ")[1] for line in ours if line.startswith("| shared |")) == ["MRPC", "QNLI"]


# ------------------------------------------------------------------------- launchers: one-line errors


def _error_line(main, argv: list[str], capsys) -> str:
    """The launcher's last stderr line, after checking it exits with status 2 and no traceback."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: "), err
    return last


def test_fine_tuning_launchers_report_bad_input_on_one_line(tmp_path, capsys, store):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    glue = write_glue_fixture(tmp_path / "glue", ["sst2"], n_train=4, n_dev=4)
    train = glue / "SST-2" / "train.tsv"
    lines = train.read_text().splitlines()
    train.write_text("\n".join([*lines[:-1], lines[-1].rsplit("\t", 1)[0] + "\t7"]) + "\n")
    glue_main = launcher("finetune_glue")
    common = ["--output-dir", str(tmp_path / "out"), "--tracking-uri", store, "--experiment", "errors"]
    line = _error_line(glue_main, ["--checkpoint", str(tmp_path / "nowhere"), *common], capsys)
    assert line.startswith("error: --checkpoint ") and line.endswith("pass an exported model folder")
    argv = ["--checkpoint", str(ckpt), "--tasks", "sst2", "--data-dir", str(glue), *common]
    assert "train.tsv, line 5: label '7' is not one of" in _error_line(glue_main, argv, capsys)
    (tmp_path / "bad.json").write_text("not json")
    argv = ["--checkpoint", str(ckpt), "--version", "1.1", "--train-file", str(tmp_path / "bad.json"),
            "--dev-file", str(tmp_path / "bad.json"), *common]  # fmt: skip
    assert "bad.json: not a readable SQuAD JSON file" in _error_line(launcher("finetune_squad"), argv, capsys)


def test_offline_hub_data_fails_at_once_naming_the_local_files(tmp_path, capsys, monkeypatch, store):
    import threading
    import time

    import datasets
    import huggingface_hub.constants

    from swbert.finetune.squad_data import SquadDataError, read_squad_hub

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")  # nothing cached
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    was_offline = datasets.config.HF_HUB_OFFLINE
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # after `datasets` read it: the launcher must see it
    argv = ["--checkpoint", str(make_checkpoint(tmp_path / "ckpt")), "--tasks", "sst2",
            "--output-dir", str(tmp_path / "out"), "--tracking-uri", store, "--experiment", "errors"]  # fmt: skip
    # The Hub client's retries wait in time.sleep between tries (about 25 s in all): what this
    # thread slept, not the wall clock a loaded machine stretches, shows whether they ran.
    slept, sleep = [], time.sleep

    def counted(seconds: float) -> None:
        if threading.current_thread() is threading.main_thread():
            slept.append(seconds)
        sleep(seconds)

    monkeypatch.setattr(time, "sleep", counted)
    line = _error_line(launcher("finetune_glue"), argv, capsys)
    assert line.startswith("error: could not load nyu-mll/glue/sst2:train (offline mode is set and"), line
    assert "pass --data-dir DIR with GLUE's TSV files (SST-2/train.tsv, SST-2/dev.tsv" in line
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a Hub that does not answer
    with pytest.raises(SquadDataError, match=r"the Hub is unreachable .* --train-file 1.1=train-v1.1.json"):
        read_squad_hub("1.1", "validation")
    assert sum(slept) < 5, slept  # not the Hub client's half minute of retries
    assert datasets.config.HF_HUB_OFFLINE == was_offline  # offline only for that call


@pytest.mark.slow
def test_squad_v11_and_v20_end_to_end(tmp_path, store):
    """Both versions, the stepped learning-rate plan (two stages of one epoch), and the "+ TriviaQA"
    rows: TriviaQA first (from its official RC layout), then SQuAD from the kept TriviaQA model."""
    ckpt = make_checkpoint(tmp_path / "ckpt", attention_type="standard")
    for v in ("1.1", "2.0"):
        write_squad_fixture(tmp_path / f"train{v}.json", 64, v, seed=0)
        write_squad_fixture(tmp_path / f"dev{v}.json", 16, v, seed=1)
    trivia = [write_triviaqa_fixture(tmp_path / "triviaqa", split, n, seed) for split, n, seed in
              [("train", 48, 0), ("dev", 16, 1)]]  # fmt: skip
    argv = ["--checkpoint", str(ckpt), "--output-dir", str(tmp_path / "out"), "--learning-rates", "1e-3", "3e-4",
            "--seeds", "1", "--epochs", "1", "--batch-size", "16", "--max-seq-length", "32", "--doc-stride", "8",
            "--keep", "none", "--train-file", f"1.1={tmp_path / 'train1.1.json'}", f"2.0={tmp_path / 'train2.0.json'}",
            "--dev-file", f"1.1={tmp_path / 'dev1.1.json'}", f"2.0={tmp_path / 'dev2.0.json'}",
            "--triviaqa", "--triviaqa-train-file", str(trivia[0]), "--triviaqa-dev-file", str(trivia[1]),
            "--tracking-uri", store, "--experiment", "squad"]  # fmt: skip
    assert launcher("finetune_squad")(argv) == 0
    runs = runs_of(store, "squad", "tags.`swbert.kind` = 'squad_trial'")
    by = {(r.data.tags["swbert.variant"], r.data.tags["swbert.task"]): r for r in runs}
    assert set(by) == {("standard", "squad1.1"), ("standard", "squad2.0"), ("standard", "triviaqa"),
                       ("standard+triviaqa", "squad1.1"), ("standard+triviaqa", "squad2.0")}  # fmt: skip
    for r in by.values():
        m = r.data.metrics
        assert 0 <= m["best/validation/exact"] <= m["best/validation/f1"] <= 100
        # one run per seed goes through both learning rates, the second stage from the first's best
        assert (r.data.params["lr_plan"], r.data.params["later_learning_rates"]) == ("stepped", "0.0003")
        assert m["best_stage"] in (0, 1) and m["epochs_trained"] == 2 and m["seconds_per_epoch"] > 0
    assert {"best/validation/HasAns_f1", "best/validation/NoAns_f1", "best/validation/best_f1"} <= set(
        by[("standard", "squad2.0")].data.metrics
    )
    # SQuAD after TriviaQA starts from the kept TriviaQA model (kept whatever --keep says)
    kept = tmp_path / "out" / "standard" / "triviaqa" / "lr0.001-0.0003-seed1"
    assert by[("standard+triviaqa", "squad1.1")].data.tags["swbert.checkpoint"] == str(kept)
    assert SWBertConfig.from_pretrained(kept).architectures == ["SWBertForQuestionAnswering"]
    table = (tmp_path / "out" / "report" / "table2_squad.md").read_text().splitlines()
    assert [row.split(" | ")[0] for row in table[4:6]] == ["| standard", "| standard + TriviaQA"]


def test_squad_defaults_are_the_papers_appendix(tmp_path, capsys):
    """SQuAD: dropout 0.2, attention dropout 0.05, weight decay 0.1, 1e-4 then 2e-5 and 2e-6, 5 epochs;
    --help shows them."""
    parse = runpy.run_path(str(ROOT / "launchers" / "finetune_squad.py"), run_name="launcher")["parse_args"]
    args = parse(["--checkpoint", "ckpt", "--output-dir", str(tmp_path)])
    cfg = args.finetune_config()
    assert args.learning_rates == [1e-4, 2e-5, 2e-6] and args.lr_plan == "stepped"
    assert (cfg.weight_decay, cfg.epochs, args.attention_dropout, args.hidden_dropout) == (0.1, 5, 0.05, 0.2)
    from swbert.finetune.trainer import stage_config

    assert [stage_config(cfg, stage, 2e-5).warmup_ratio for stage in (0, 1, 2)] == [0.1, 0, 0]
    with pytest.raises(SystemExit) as exit_:
        parse(["--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    for line in ["--learning-rates           list[float], default: [0.0001, 2e-05, 2e-06]",
                 "--lr-plan                  one of ['stepped', 'grid'], default: 'stepped'",
                 "--epochs                   int, default: 5", "--weight-decay             float, default: 0.1",
                 "--attention-dropout        float, default: 0.05",
                 "--hidden-dropout           float | None, default: 0.2"]:  # fmt: skip
        assert line in help_text, line
    assert "the appendix's SQuAD attention dropout" in help_text


def test_fit_restores_the_best_epoch_and_stops_early():
    model, data = _tiny_model(), _tiny_data()
    scores, snapshots = iter([0.5, 0.9, 0.7, 0.6, 0.95]), []

    def evaluate(m):
        snapshots.append({k: v.clone() for k, v in m.state_dict().items()})
        return {"validation/score": next(scores)}

    cfg = FinetuneConfig(learning_rate=1e-3, epochs=5, batch_size=8, patience=2)
    result = fit(model, data, pad_collate(0), evaluate, "validation/score", cfg)
    assert result.best_epoch == 1 and len(result.history) == 4  # stopped after two epochs without progress
    for k, v in model.state_dict().items():
        assert torch.equal(v, snapshots[1][k])
    assert not torch.equal(snapshots[1]["classifier.weight"], snapshots[3]["classifier.weight"])


def test_one_process_trains_in_deepspeeds_precision_as_ranks_do():
    """A single process trains in a DeepSpeed engine too, so bf16 is DeepSpeed's there as on N ranks
    (bf16 weights, fp32 master weights in the optimizer), not autocast over fp32 weights."""
    model, evaluated = _tiny_model(), []
    cfg = FinetuneConfig(learning_rate=1e-3, epochs=1, batch_size=8, precision="bf16")
    fit(model, _tiny_data(), pad_collate(0), lambda m: evaluated.append(m) or {"validation/score": 0.0},
        "validation/score", cfg)  # fmt: skip
    assert evaluated == [model]  # the engine's module is the model itself
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not torch.distributed.is_initialized()  # the 1-rank group is gone with the run


def _sum_over_ranks() -> None:
    total = torch.ones(1)
    torch.distributed.all_reduce(total)
    assert total.item() == torch.distributed.get_world_size()


@pytest.mark.slow
def test_ranks_start_after_an_in_process_fine_tuning_run():
    """A fine-tuning run in a plain process starts and ends a 1-rank process group; the process is
    left as it was (no group, the environment unchanged, no loader worker), and ranks started after
    it in the same process finish. Forked from this process, they waited forever on a lock held by a thread of the
    old group: `run_ranks` starts them from a fresh process, and its timeout turns a hang into a
    failure."""
    import deepspeed  # noqa: F401  (its import sets a variable of its own, once per process)
    import psutil

    from tests.parallel.test_parallel_harness import run_ranks

    env, children = dict(os.environ), {c.pid for c in psutil.Process().children()}
    cfg = FinetuneConfig(learning_rate=1e-3, epochs=1, batch_size=8, precision="fp32", num_workers=1)
    fit(_tiny_model(), _tiny_data(), pad_collate(0), lambda m: {"validation/score": 0.0},
        "validation/score", cfg)  # fmt: skip
    assert not torch.distributed.is_initialized() and dict(os.environ) == env
    assert {c.pid for c in psutil.Process().children()} <= children  # the loader's workers ended
    run_ranks(_sum_over_ranks, 2, deepspeed=True)  # its hang guard turns the old hang into a failure


def test_compiled_fine_tuning_sees_one_shape_per_length_bucket():
    """Compiled runs pad each batch up to a length bucket, so torch.compile builds graphs for one
    shape per bucket, not one per batch length: an epoch of five length-grouped batches, of 3, 5, 7,
    12 and 14 tokens, runs in two shapes (buckets of 8 tokens), each compiled once. A recording
    backend (no code generation) keeps it fast."""
    graphs, lengths = [], []

    def recording(gm, example_inputs):
        ids = [t for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() == 2]
        graphs.append(tuple(ids[0].shape))
        return gm.forward

    texts = [
        [2] + [5 + (i * j) % 20 for j in range(n - 2)] + [3] for i, n in enumerate([3, 5, 7, 12, 14] * 4)
    ]
    data = EncodedDataset({"input_ids": texts, "attention_mask": [[1] * len(t) for t in texts]},
                          {"labels": torch.tensor([i % 2 for i in range(len(texts))]).numpy()})  # fmt: skip
    model = _tiny_model()
    model.config.problem_type = "single_label_classification"  # as glue.load_classifier sets it
    model.register_forward_pre_hook(lambda m, a, k: lengths.append(k["input_ids"].shape[1]), with_kwargs=True)
    cfg = FinetuneConfig(learning_rate=1e-3, epochs=1, batch_size=4, precision="fp32", num_workers=0,
                         group_by_length=True, compile=True, compile_backend=recording)  # fmt: skip
    fit(model, data, pad_collate(0, bucket=8, longest=32), lambda m: {"validation/score": 0.0},
        "validation/score", cfg)  # fmt: skip
    assert sorted(lengths) == [8, 8, 8, 16, 16]  # five batch lengths, two buckets
    shapes = Counter(graphs)
    assert {shape[1] for shape in shapes} == {8, 16}  # both buckets compiled, nothing else
    assert len(set(shapes.values())) == 1  # as many graphs for each shape: none compiled twice
    assert "forward" not in model.__dict__  # the model's own forward is back


def test_deepspeed_config_is_filled_from_the_flags(tmp_path):
    cfg = FinetuneConfig(batch_size=32, max_grad_norm=1.0)
    ds = deepspeed_config("zero2.json", cfg, world_size=4, precision="bf16")  # a shipped config, by name
    batch = (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_clipping"])
    assert batch == (32, 8, 1.0)
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert ds["zero_optimization"]["stage"] == 2
    path = tmp_path / "ds.json"
    for content, message in [
        (
            {"train_batch_size": 64},
            r"ds.json sets train_batch_size=64 but the fine-tuning flags give 32",
        ),
        ({"bf16": {"enabled": True}}, r"bf16.enabled=True but the run's precision is fp32"),
        ({"optimizer": {"type": "Adam"}}, "remove the 'optimizer' section"),
        ({"zero_optimization": {"stage": 3}}, "ZeRO stage 3 is not supported"),
    ]:
        path.write_text(json.dumps(content))
        with pytest.raises(ValueError, match=message):
            deepspeed_config(path, cfg, world_size=4, precision="fp32")
    with pytest.raises(ValueError, match="not divisible by the world size 3"):
        deepspeed_config("zero1.json", cfg, world_size=3, precision="fp32")


def _tiny_data() -> EncodedDataset:
    ids = [[2, 5 + (7 * i) % 20, 5 + (3 * i) % 20, 3] for i in range(16)]  # one length: no padding
    return EncodedDataset({"input_ids": ids, "attention_mask": [[1] * 4] * 16},
                          {"labels": torch.tensor([i % 2 for i in range(16)]).numpy()})  # fmt: skip


def _tiny_model() -> SWBertForSequenceClassification:
    torch.manual_seed(0)
    config = SWBertConfig.from_size(
        "tiny", vocab_size=32, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    return SWBertForSequenceClassification(config)


def _fit_full_batch(out: str | None = None) -> dict[str, torch.Tensor]:
    """Three full-batch epochs; the last is the best, so both runs keep the same epoch's weights. In
    the ranks (``out``), every training step's host syncs and the collating processes are recorded."""
    model, calls = _tiny_model(), iter(range(100))
    cfg = FinetuneConfig(learning_rate=1e-3, epochs=3, batch_size=16, precision="fp32",
                      deepspeed="zero1.json" if out else None)  # fmt: skip
    collate = _count_syncs(Path(out), pad_collate(0)) if out else pad_collate(0)
    logged = (lambda metrics, step: None) if out else None  # the ranks take the logging path too
    fit(model, _tiny_data(), collate, lambda m: {"validation/score": float(next(calls))},
        "validation/score", cfg, logged)  # fmt: skip
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if out:
        torch.save(state, Path(out) / f"rank{torch.distributed.get_rank()}.pt")
    return state


def _count_syncs(out: Path, collate):
    """In a rank: count each training step's host syncs as tests/scripts/count_syncs.py counts
    pretraining's (its counters; the optimizer a GPU gets, torch's fused AdamW, whose step counters
    stay on the device), into ``out/syncs-rank<r>.json``; the returned collate leaves a file named
    by the process that runs it."""
    import os

    from swbert.finetune import trainer
    from tests.scripts import count_syncs as counting

    build_optimizer = trainer.build_optimizer
    trainer.build_optimizer = lambda *a, **k: build_optimizer(*a, **{**k, "on_gpu": True})
    counting.install()
    step, steps = trainer.FitRun.step, []
    record = out / f"syncs-rank{torch.distributed.get_rank()}.json"

    def counted(self, batch):
        counting.calls.clear()  # set-up, the loader, the evaluations: not a step's
        step(self, batch)
        steps.append({"logged": self.window_steps == 0, "calls": list(counting.calls)})
        record.write_text(json.dumps({"pid": os.getpid(), "steps": steps}))

    trainer.FitRun.step = counted

    def collate_and_say_who(batch):
        (out / f"collated-by-{os.getpid()}").touch()
        return collate(batch)

    return collate_and_say_who


# DeepSpeed's own host syncs in a ZeRO-1 fp32 step with gradient clipping, per rank: its checks of the
# gradient norm, as in pretraining (tests/training/test_host_syncs.py; docs/performance.md says why they stay)
DEEPSPEED_SYNCS = Counter(
    {
        "__bool__@is_invalid_grad_norm<-step": 1,
        "__bool__@is_invalid_grad_norm<-unscale_and_clip_grads": 2,  # per parameter group
        "host_to_device@mask_nan_or_inf_with_val_inplace<-get_grad_norm_direct": 2,  # per group
    }
)


@pytest.mark.slow
def test_two_ranks_under_deepspeed_train_like_one_process(tmp_path):
    """The DeepSpeed path of ``fit`` (2 gloo ranks, ZeRO-1, the global batch split in two) ends with the
    weights of a single-process run: gradients averaged over ranks equal the full-batch gradient. Its
    batches are collated in loader workers, and a step that logs nothing reads nothing from the device:
    no host sync of swbert's (counted as tests/training/test_host_syncs.py counts pretraining's)."""
    from tests.parallel.test_parallel_harness import run_ranks
    from tests.training.test_host_syncs import _count  # a step's calls by owner, none left out

    run_ranks(_fit_full_batch, 2, str(tmp_path), deepspeed=True)
    single = _fit_full_batch()
    start = _tiny_model().state_dict()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, value in single.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name  # the ranks agree
        torch.testing.assert_close(ranks[0][name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert not torch.equal(single["classifier.weight"], start["classifier.weight"])  # it did train

    records = [json.loads((tmp_path / f"syncs-rank{r}.json").read_text()) for r in range(2)]
    collators = {int(f.name.rsplit("-", 1)[1]) for f in tmp_path.glob("collated-by-*")}
    assert collators and not collators & {r["pid"] for r in records}  # loader workers, not the ranks
    for rank, record in enumerate(records):
        assert [s["logged"] for s in record["steps"]] == [False, False, True]  # the last step logs
        for i, step in enumerate(record["steps"]):
            counts = _count(step["calls"])
            stacks = "".join(f"\n  {c['kind']}: {c['stack'][-3:]}" for c in step["calls"])
            where = f"rank {rank}, step {i + 1}: {stacks}"
            expected = Counter({"item@log_window": 1}) if step["logged"] and rank == 0 else Counter()
            assert counts["swbert"] == expected, where
            assert counts["deepspeed"] == DEEPSPEED_SYNCS, where


def test_glue_defaults_are_the_papers_appendix(tmp_path, capsys):
    """LR 1e-4 then 2e-5/2e-6 (stepped by default), weight decay 0.1, attention dropout 0.1 (also over a
    checkpoint pretrained without it), 10 epochs, several seeds, the paper's eight tasks (no WNLI);
    --help shows them."""
    from swbert.finetune.glue import load_classifier
    from swbert.finetune.tasks import get_task

    parse = runpy.run_path(str(ROOT / "launchers" / "finetune_glue.py"), run_name="launcher")["parse_args"]
    args = parse(["--checkpoint", "ckpt", "--output-dir", str(tmp_path)])
    cfg = args.finetune_config()
    assert args.learning_rates == [1e-4, 2e-5, 2e-6] and len(args.seeds) >= 3
    assert args.lr_settings() == [(1e-4, 2e-5, 2e-6)]  # stepped: one sequence of three stages per seed
    grid = parse(["--checkpoint", "c", "--output-dir", "o", "--lr-plan", "grid"])
    assert grid.lr_settings() == [(1e-4,), (2e-5,), (2e-6,)]
    assert sorted(args.tasks) == ["cola", "mnli", "mrpc", "qnli", "qqp", "rte", "sst2", "stsb"]
    assert (cfg.weight_decay, cfg.epochs, args.attention_dropout) == (0.1, 10, 0.1)
    ckpt = make_checkpoint(tmp_path / "ckpt")
    config = SWBertConfig.from_pretrained(ckpt)
    config.attention_probs_dropout_prob = 0.0
    config.save_pretrained(ckpt)
    model = load_classifier(ckpt, get_task("rte"), **args.dropout())
    assert model.config.attention_probs_dropout_prob == 0.1 and model.config.hidden_dropout_prob == 0.1
    with pytest.raises(SystemExit):
        parse(["--help"])
    help_text = capsys.readouterr().out
    for line in ["--learning-rates           list[float], default: [0.0001, 2e-05, 2e-06]",
                 "--epochs                   int, default: 10", "--weight-decay             float, default: 0.1",
                 "--attention-dropout        float, default: 0.1",
                 "--tasks                    list[str], default: ['mnli', 'qqp', 'qnli', 'sst2', 'cola', 'stsb', "
                 "'mrpc', 'rte']"]:  # fmt: skip
        assert line in help_text, line
    assert "the paper's eight by default, WNLI only when named" in help_text


def test_stepped_plan_continues_from_the_best_weights(tmp_path):
    """Stage 2 (worse than stage 1) hands stage 1's best weights on to stage 3; the model ends with the
    best weights of all stages; logged steps continue across stages."""
    from swbert.finetune.sweep import SweepConfig

    model, data = _tiny_model(), _tiny_data()
    scores, evaluated, started = iter([0.5, 0.9, 0.7, 0.8, 0.95, 0.6]), [], []

    def evaluate(m):
        evaluated.append({k: v.clone() for k, v in m.state_dict().items()})
        return {"validation/score": next(scores)}

    def record_start(module, args):  # as each step's forward begins: the weights that step starts from
        started.append({k: v.clone() for k, v in module.state_dict().items()})

    model.register_forward_pre_hook(record_start)  # not in the collate: batches are collated in workers
    collate = pad_collate(0)

    sweep = SweepConfig(checkpoint=["c"], output_dir=tmp_path, learning_rates=[1e-3, 1e-4, 1e-5], epochs=2,
                        batch_size=8, precision="fp32")  # fmt: skip
    logged = []
    cfg = sweep.finetune_config(seed=1)
    log = lambda m, step: logged.append(step)  # noqa: E731
    result = fit(model, data, collate, evaluate, "validation/score", cfg, log, later_lrs=(1e-4, 1e-5))
    assert (result.best_stage, result.best_epoch, result.steps, result.epochs_trained) == (2, 4, 12, 6)
    for k, v in started[8].items():  # the first step of stage 3 starts from stage 1's best (epoch 1)
        assert torch.equal(v, evaluated[1][k]), k
    for k, v in model.state_dict().items():  # the end: stage 3's first epoch, the best of all
        assert torch.equal(v, evaluated[4][k]), k
    assert max(logged) == 12 and logged == sorted(logged)
