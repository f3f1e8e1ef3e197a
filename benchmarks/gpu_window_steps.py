"""The steps of benchmarks/gpu_window.py, each run in a process of its own (`--child STEP`).

A step returns its figures and a status; `run_step` writes them as OUT/steps/STEP.json, which the
window reads back. On the GPU the sizes are BERT-base's; `--rehearse` runs each at a tiny size on
the CPU, so the code here is the code a GPU window runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BERT_VOCAB = 30_522


@dataclass(frozen=True)
class Ctx:
    out: Path
    rehearse: bool

    @property
    def device(self) -> str:
        return "cpu" if self.rehearse else "cuda"

    @property
    def size(self) -> str:
        return "tiny" if self.rehearse else "base"

    @property
    def backend(self) -> str:
        """torch.compile's backend: inductor on the GPU; aot_eager in the rehearsal (the same per-unit
        graphs and AOTAutograd split, without a C++ compiler's minutes)."""
        return "aot_eager" if self.rehearse else "inductor"

    @property
    def data(self) -> Path:
        return self.out / "data" / "data"


class Result(dict):
    """A step's figures; `status` and `note` travel beside them."""

    def __init__(self, status: str = "ok", note: str = "", **figures) -> None:
        super().__init__(figures)
        self.status, self.note = status, note


# ---------------------------------------------------------------------------------------------------
# What the machine lacks, made unimportable here too


def make_absent() -> None:
    """Make the packages the GPU machine's image lacks (SWBERT_WINDOW_ABSENT) unimportable here, as
    an absent package is: `import` raises ModuleNotFoundError and `importlib.util.find_spec` finds
    nothing (what optional-dependency checks such as transformers' ask), so a step that needs one
    fails in the rehearsal as it would there."""
    for name in filter(None, os.environ.get("SWBERT_WINDOW_ABSENT", "").split(",")):
        sys.modules[name] = None  # type: ignore[assignment]


# ---------------------------------------------------------------------------------------------------
# data


def write_corpus(path: Path, words: int, lexicon: int, seed: int = 0) -> None:
    """Documents of words drawn from a made-up lexicon with Zipf-like frequencies: enough distinct
    strings for a BERT-size vocabulary, made in a second."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    lex = ["".join(rng.choice(letters) for _ in range(rng.randint(3, 9))) for _ in range(lexicon)]
    drawn = rng.choices(lex, [1.0 / (i + 10) for i in range(lexicon)], k=words)
    lines = (" ".join(drawn[i : i + rng.randint(100, 400)]) for i in range(0, words, 400))
    path.write_text("\n".join(lines) + "\n")


def data(ctx: Ctx) -> Result:
    from data_prep.preprocess import preprocess
    from data_prep.train_tokenizer import train_tokenizer

    root = ctx.out / "data"
    if (ctx.data / "manifest.json").exists():
        return Result(note="reused", vocab=vocab_of(ctx.data), train_tokens=train_tokens(ctx.data))
    started = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    words, vocab = (60_000, 1_000) if ctx.rehearse else (1_500_000, BERT_VOCAB)
    write_corpus(root / "corpus.txt", words, lexicon=60_000)
    threads = os.cpu_count() or 1
    train_tokenizer(
        [str(root / "corpus.txt")], root / "tok", vocab_size=vocab, threads=threads, overwrite=True
    )
    workers = 1 if ctx.rehearse else min(8, threads)
    preprocess(
        [str(root / "corpus.txt")], root / "tok", ctx.data, workers=workers, progress=False, overwrite=True
    )
    seconds = round(time.perf_counter() - started, 1)
    return Result(vocab=vocab, train_tokens=train_tokens(ctx.data), seconds=seconds)


def train_tokens(data_dir: Path) -> int:
    manifest = json.loads((data_dir / "manifest.json").read_text())
    return sum(s["train"]["tokens"] for s in manifest["shards"])


# ---------------------------------------------------------------------------------------------------
# block_kernels

# what names an attention kernel; "softmax" catches the math path's (SDPA decomposed into matmul,
# softmax, matmul: what a CPU runs with dropout, and a GPU when no fused kernel takes the inputs)
ATTENTION_KERNEL_WORDS = ("flash", "fmha", "attention", "attn", "sdpa", "cudnn", "efficient", "softmax")


def kernel_names(prof, device: str) -> list[str]:
    """The attention kernels the profiler saw: CUDA kernels on a GPU, aten ops on a CPU."""
    from torch.autograd import DeviceType

    wanted = DeviceType.CUDA if device == "cuda" else DeviceType.CPU
    names = {e.name for e in prof.events() if e.device_type == wanted}
    found = [n for n in names if any(w in n.lower() for w in ATTENTION_KERNEL_WORDS)]
    return sorted(n[:120] for n in found)


def sdpa_backend(names: list[str]) -> str:
    text = " ".join(names).lower()
    for backend, words in (
        ("cudnn", ("cudnn",)),
        ("flash", ("flash",)),
        ("efficient", ("fmha", "efficient")),
    ):
        if any(w in text for w in words):
            return backend
    return "math" if names else "none seen"


def block_kernels(ctx: Ctx) -> Result:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from swbert.models import SWBertConfig, SWBertForMaskedLM

    torch.manual_seed(0)
    config = SWBertConfig.from_size(ctx.size, attention_type="shared", vocab_size=1024,
                                    hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)  # fmt: skip
    block = _first_block(SWBertForMaskedLM(config)).to(ctx.device, torch.bfloat16).train()
    batch, seq = (4, 32) if ctx.rehearse else (256, 128)
    x = torch.randn(
        batch, seq, config.hidden_size, device=ctx.device, dtype=torch.bfloat16, requires_grad=True
    )
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(block, backend=ctx.backend)
    for _ in range(2):  # compile, then the steady graph
        compiled(x).sum().backward()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device == "cuda" else [])
    sync = torch.cuda.synchronize if ctx.device == "cuda" else (lambda: None)
    with profile(activities=activities) as fwd:
        y = compiled(x)
        sync()
    with profile(activities=activities) as bwd:
        y.sum().backward()
        sync()
    forward, backward = kernel_names(fwd, ctx.device), kernel_names(bwd, ctx.device)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    backends = {"forward": sdpa_backend(forward), "backward": sdpa_backend(backward)}
    fused = all(b in ("flash", "cudnn", "efficient") for b in backends.values())
    ok = forward and backward and breaks == 0 and (ctx.rehearse or fused)
    note = "" if ok else f"graph breaks {breaks}" if breaks else "no fused SDPA kernel in both directions"
    return Result("ok" if ok else "failed", note, backend=backends, graph_breaks=breaks,
                  forward=forward, backward=backward)  # fmt: skip


def _first_block(model):
    for module in model.modules():
        if type(module).__name__ == "Block":
            return module
    raise RuntimeError("no encoder Block in the model")


# ---------------------------------------------------------------------------------------------------
# trainer_shared, trainer_standard


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_rank_env() -> dict[str, str]:
    """What torchrun gives a job of one process."""
    return dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))  # fmt: skip


def estimate_gib(
    size: str, attention_type: str, vocab: int, seq: int, micro: int, zero: int
) -> dict[str, float]:
    """The project's memory estimate for one bf16 rank: model states and activations (GiB)."""
    from swbert.models import SWBertConfig
    from swbert.scaling.activations import activation_memory
    from swbert.scaling.memory import GIB, Layout, model_state_bytes

    config = SWBertConfig.from_size(size, attention_type=attention_type, vocab_size=vocab)
    states = model_state_bytes(config, Layout(zero=zero), dp=1, precision="bf16").device
    acts = activation_memory(config, seq, micro, precision="bf16").peak
    return {"states": states / GIB, "activations": acts / GIB, "total": (states + acts) / GIB}


def largest_micro_batch(ctx: Ctx, attention_type: str, vocab: int, seq: int) -> int:
    """The largest power-of-two micro-batch (at most 1024) whose estimate fits 55% of the device
    (the rest: the allocator's slack, compile's workspace, the optimizer's step)."""
    if ctx.rehearse:
        return 4
    import torch

    memory = torch.cuda.get_device_properties(0).total_memory / 2**30
    for micro in (1024, 512, 256, 128, 64, 32):
        if estimate_gib(ctx.size, attention_type, vocab, seq, micro, zero=2)["total"] <= 0.55 * memory:
            return micro
    return 16


def vocab_of(data_dir: Path) -> int:
    tok = json.loads((data_dir.parent / "tok" / "swbert_tokenizer.json").read_text())
    return int(tok["vocab_size"])


def pretrain_args(ctx: Ctx, out: Path, attention_type: str, steps: int, micro: int, *extra: str) -> list[str]:
    seq = 32 if ctx.rehearse else 128
    return [
        "--size", ctx.size, "--attention-type", attention_type, "--data-dir", str(ctx.data),
        "--output-dir", str(out), "--seq-len", str(seq), "--micro-batch-size", str(micro),
        "--global-batch-size", str(micro), "--train-steps", str(steps), "--warmup-steps", str(max(1, steps // 4)),
        "--precision", "bf16", "--mlflow", "false", "--export", "false", "--progress-bar", "false",
        "--system-metrics", "false", "--eval-batches", "0", "--save-interval", "100000",
        "--compile-backend", ctx.backend, "--num-workers", "2", *extra,
    ]  # fmt: skip


class SyncWatch:
    """For the steps it watches: CUDA's sync debug warnings (every synchronizing CUDA call, on any
    thread: the autograd engine replays its device threads' warnings on the caller), and the
    host-blocking calls tests/scripts/count_syncs.py counts, with the thread that made each."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.warnings: list[dict] = []
        self.counter = None

    def start(self) -> None:
        import runpy

        import torch

        self.counter = runpy.run_path(
            str(REPO / "tests" / "scripts" / "count_syncs.py"), run_name="count_syncs"
        )
        self.counter["install"]()
        self.counter["calls"].clear()
        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        self._show = warnings.showwarning
        warnings.simplefilter("always")
        warnings.showwarning = self._record

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return self._show(message, category, filename, lineno, file, line)
        stack = [f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in traceback.extract_stack()[:-2]][-6:]
        self.warnings.append({"thread": threading.current_thread().name, "message": str(message)[:160],
                              "stack": stack})  # fmt: skip

    def stop(self) -> list[dict]:
        import torch

        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._show
        pinning = self.counter["on_pin_memory_thread"]  # the loader's host-memory copies: no device sync
        return [c for c in self.counter["calls"] if not pinning(c)]


def watched_calls(calls: list[dict]) -> dict:
    """Host-blocking calls by thread and by place."""
    places = Counter(f"{c['kind']} at {c['stack'][-1] if c['stack'] else '?'}" for c in calls)
    return {"by_thread": dict(Counter(c["thread"] for c in calls)),
            "top": [f"{n} x {p}" for p, n in places.most_common(5)]}  # fmt: skip


def train_with_profile(args: list[str], device: str, profiled_steps: int = 2) -> tuple[dict, dict]:
    """Pretraining in this process (one rank), its last `profiled_steps` steps under torch.profiler
    and the sync watch. Returns (the run's summary, what the profiled steps showed)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from swbert.logs import setup_logging
    from swbert.training.cli import parse_args
    from swbert.training.trainer import Trainer

    os.environ.update(one_rank_env())
    setup_logging()
    config = parse_args(args)
    trainer = Trainer(config)
    watch, seen = SyncWatch(device), {}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    prof = profile(activities=activities)
    steps, train_step = [0], trainer.train_step

    def step():
        steps[0] += 1
        if steps[0] == config.train_steps - profiled_steps + 1:
            prof.start()
            watch.start()
            seen["t0"] = time.perf_counter()
        result = train_step()
        if steps[0] == config.train_steps:
            if device == "cuda":
                torch.cuda.synchronize()
            seen["wall_s"] = time.perf_counter() - seen.pop("t0")
            seen["calls"] = watch.stop()
            prof.stop()
        return result

    trainer.train_step = step
    summary = trainer.train()
    seen["warnings"] = watch.warnings
    seen["prof"] = prof
    seen["model_config"] = trainer.run.engine.module.config if trainer.run else None
    return summary, seen


def profile_figures(prof, wall_s: float, steps: int, device: str) -> dict:
    """Per profiled step: host wall time, device-busy time and the busiest kernels."""
    from torch.autograd import DeviceType

    events = prof.events()
    aten = sum(e.device_type == DeviceType.CPU and e.name.startswith("aten::") for e in events)
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    figures = {"step_ms": round(1e3 * wall_s / steps, 1), "aten_ops_per_step": aten // steps}
    if device == "cuda":
        busy = sum(e.device_time for e in kernels) / 1e3 / steps  # us -> ms
        by_name = Counter()
        for e in kernels:
            by_name[e.name[:80]] += e.device_time / 1e3 / steps
        figures["kernels_per_step"] = len(kernels) // steps
        figures["gpu_busy_ms"] = round(busy, 1)
        figures["top_kernels_ms"] = [f"{n} {ms:.1f}" for n, ms in by_name.most_common(5)]
    attn = kernel_names(prof, device)
    figures["attention_kernels"] = attn[:4]
    return figures


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def trainer(ctx: Ctx, attention_type: str) -> Result:
    vocab = vocab_of(ctx.data)
    seq = 32 if ctx.rehearse else 128
    micro = largest_micro_batch(ctx, attention_type, vocab, seq)
    steps, log_every = (8, 2) if ctx.rehearse else (42, 10)
    out = ctx.out / f"trainer_{attention_type}"

    shutil.rmtree(out, ignore_errors=True)
    args = pretrain_args(ctx, out, attention_type, steps, micro, "--compile", "on",
                         "--deepspeed-config", "ds_configs/zero2.json", "--log-interval", str(log_every))  # fmt: skip
    summary, seen = train_with_profile(args, ctx.device)
    if summary.get("status") != "FINISHED":
        return Result("failed", f"the run ended {summary.get('status')}")
    metrics = read_metrics(out)
    steady = [m for m in metrics if log_every < m["step"] <= steps - 2]  # past compile, before the profile
    figures = {"micro_batch": micro, "seq": seq, "steps": steps}
    figures["tokens_per_s"] = round(statistics.median(m["tokens_per_s"] for m in steady))
    if "mfu" in steady[-1]:
        figures["mfu"] = round(statistics.median(m["mfu"] for m in steady), 4)
    figures["tflops_per_device"] = round(statistics.median(m["tflops_per_device"] for m in steady), 2)
    figures["loss"] = f"{metrics[0]['loss']:.2f} -> {metrics[-1]['loss']:.2f}"
    if ctx.device == "cuda":
        import torch

        peak = torch.cuda.max_memory_allocated() / 2**30
        est = estimate_gib(ctx.size, attention_type, vocab, seq, micro, zero=2)
        figures["peak_gib"] = round(peak, 2)
        figures["estimate_gib"] = {k: round(v, 2) for k, v in est.items()}
        figures["peak_over_estimate"] = round(peak / est["total"], 3)
    figures["profiled"] = profile_figures(seen["prof"], seen["wall_s"], 2, ctx.device)
    figures["sync_warnings_per_step"] = len(seen["warnings"]) / 2
    figures["sync_warning_threads"] = dict(Counter(w["thread"] for w in seen["warnings"]))
    figures["host_blocking_calls"] = watched_calls(seen["calls"])
    trace = ctx.out / f"trainer_{attention_type}.trace.json"
    with contextlib.suppress(Exception):
        seen["prof"].export_chrome_trace(str(trace))
    fell = metrics[-1]["loss"] < metrics[0]["loss"]
    return Result("ok" if fell else "failed", "" if fell else "the loss did not fall", **figures)


# ---------------------------------------------------------------------------------------------------
# zero3_compile


def launch_pretrain(args: list[str], log: Path) -> subprocess.Popen:
    """launchers/pretrain.py as one rank in a new process, the absent packages still absent."""
    code = ("import runpy, sys; from benchmarks.gpu_window_steps import make_absent; make_absent(); "
            "sys.argv = ['launchers/pretrain.py', *sys.argv[1:]]; "
            "runpy.run_path('launchers/pretrain.py', run_name='__main__')")  # fmt: skip
    env = {**os.environ, **one_rank_env()}
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)  # fmt: skip


def zero3_compile(ctx: Ctx) -> Result:
    """Two 20-step ZeRO-3 runs side by side, compiled and eager, dropout 0 (the same function):
    their losses step by step."""
    steps = 20
    micro = 4 if ctx.rehearse else 64
    size_args = ["--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
                 "--deepspeed-config", "ds_configs/zero3.json"]  # fmt: skip
    runs, procs = {}, {}
    for mode in ("on", "off"):
        runs[mode] = ctx.out / f"zero3_compile_{mode}"

        shutil.rmtree(runs[mode], ignore_errors=True)
        args = pretrain_args(ctx, runs[mode], "shared", steps, micro, *size_args, "--compile", mode)
        if not ctx.rehearse:
            args[args.index("--size") + 1] = "mini"
        procs[mode] = launch_pretrain(args, ctx.out / "logs" / f"zero3_compile_{mode}.log")
    codes = {mode: p.wait() for mode, p in procs.items()}
    if any(codes.values()):
        return Result("failed", f"exit status {codes} (logs/zero3_compile_*.log)")
    losses = {mode: [m["loss"] for m in read_metrics(run)] for mode, run in runs.items()}
    if len(losses["on"]) != steps or len(losses["off"]) != steps:
        return Result("failed", f"{len(losses['on'])} and {len(losses['off'])} of {steps} steps logged")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses["on"], losses["off"]))
    ok = worst <= 3e-2 and losses["on"][-1] < losses["on"][0]
    return Result("ok" if ok else "failed", "" if ok else "compiled and eager losses differ (or did not fall)",
                  max_rel_loss_diff=round(worst, 5), compiled=f"{losses['on'][0]:.3f} -> {losses['on'][-1]:.3f}",
                  eager=f"{losses['off'][0]:.3f} -> {losses['off'][-1]:.3f}")  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# varlen


def to_device(batch: dict, device: str) -> dict:
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}


def varlen(ctx: Ctx) -> Result:
    """Fine-tuning batches of MNLI-like lengths, padded and as one stream: the classifier's logits
    equal (eval), and real tokens/s of training steps, the two modes interleaved."""
    import argparse

    import torch

    from benchmarks.finetune_step import batches, draw_lengths, examples
    from swbert.models import SWBertConfig, SWBertForSequenceClassification
    from swbert.models.varlen import varlen_kernel

    dtype = torch.float32 if ctx.rehearse else torch.bfloat16
    n, batch = (64, 8) if ctx.rehearse else (4096, 128)
    config = SWBertConfig.from_size(ctx.size, attention_type="shared", num_labels=3, vocab_size=BERT_VOCAB,
                                    attention_probs_dropout_prob=0.0)  # fmt: skip
    lengths = draw_lengths("mnli", n, 0)
    modes = batches(examples(lengths, config.vocab_size, 0), lengths, argparse.Namespace(batch=batch, seed=0))
    modes = {m: [to_device(b, ctx.device) for b in modes[m]] for m in ("padded", "unpadded")}
    torch.manual_seed(0)
    model = SWBertForSequenceClassification(config).to(ctx.device, dtype)
    model.eval()
    with torch.no_grad():
        pad = model(**modes["padded"][0]).logits.float()
        flat = model(**modes["unpadded"][0]).logits.float()
    tol = dict(rtol=1e-4, atol=1e-4) if ctx.rehearse else dict(rtol=2e-2, atol=2e-2)
    error = (flat - pad).abs().max().item()
    equal = torch.allclose(flat, pad, **tol)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5)
    sync = torch.cuda.synchronize if ctx.device == "cuda" else (lambda: None)
    seconds, real = dict.fromkeys(modes, 0.0), dict.fromkeys(modes, 0)
    for i, pair in enumerate(zip(modes["padded"], modes["unpadded"])):
        for mode, b in zip(modes, pair):
            sync()
            t0 = time.perf_counter()
            model(**b).loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            sync()
            if i >= 2:  # warm-up
                seconds[mode] += time.perf_counter() - t0
                real[mode] += (
                    int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel()
                )
    tps = {m: round(real[m] / seconds[m]) for m in modes}
    return Result("ok" if equal else "failed", "" if equal else f"unpadded logits differ by {error:.3g}",
                  kernel={"dropout 0": varlen_kernel(ctx.device, 0.0) or "per-sequence reference",
                          "dropout 0.1": varlen_kernel(ctx.device, 0.1) or "per-sequence reference"},
                  max_logit_diff=round(error, 5), real_tokens_per_s=tps,
                  unpadded_over_padded=round(tps["unpadded"] / tps["padded"], 2))  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# tp2_graph_breaks


def tp2_graph_breaks(ctx: Ctx) -> Result:
    """The model as a TP=2 rank builds it (megatron-core layers), compiled per unit as the trainer
    does, at the recipes' dropout 0.1, forward and backward on rank 0 of a fake 2-rank group (no
    communication: the collectives return at once), counting dynamo's graph breaks."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from swbert import parallel
    from swbert.models import SWBertConfig, SWBertForMaskedLM
    from swbert.training.wrappers import wrap_model

    if ctx.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    parallel.initialize(2, seed=0)
    config = SWBertConfig.from_size(ctx.size, attention_type="shared", vocab_size=1024,
                                    hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)  # fmt: skip
    torch.manual_seed(0)
    model = SWBertForMaskedLM(config).to(ctx.device)
    model = wrap_model(model, tp_size=2, compile=True, compile_backend=ctx.backend, log_steps=False)
    batch, seq = (4, 32) if ctx.rehearse else (32, 128)
    ids = torch.randint(5, 1024, (batch, seq), device=ctx.device)
    positions = torch.arange(4, device=ctx.device).repeat(batch, 1)
    torch._dynamo.utils.counters.clear()
    ctxm = torch.autocast("cuda", dtype=torch.bfloat16) if ctx.device == "cuda" else contextlib.nullcontext()
    for _ in range(2):
        with ctxm:
            loss = model(input_ids=ids, mlm_positions=positions, mlm_targets=ids[:, :4]).loss
        loss.backward()
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    total = sum(breaks.values())
    reasons = [f"{n} x {r[:100]}" for r, n in breaks.items()]
    return Result("ok" if total == 0 else "failed", "" if total == 0 else "; ".join(reasons)[:300],
                  graph_breaks=total)  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# cuda_tests


def cuda_tests(ctx: Ctx) -> Result:
    """pytest on tests/e2e/test_cuda.py in a process of its own, the absent packages still absent
    (on a CPU every test there skips: the rehearsal checks that the file still collects)."""
    code = ("import sys, pytest; from benchmarks.gpu_window_steps import make_absent; make_absent(); "
            "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/e2e/test_cuda.py']))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    print(done.stdout[-20000:], done.stderr[-5000:], sep="\n")
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", done.stdout)}
    ok = done.returncode == 0 and (counts.get("passed", 0) > 0 or ctx.rehearse)
    return Result("ok" if ok else "failed", "" if ok else f"pytest exit status {done.returncode}", **counts)


# ---------------------------------------------------------------------------------------------------

STEP_FUNCTIONS: dict[str, Callable[[Ctx], Result]] = {
    "data": data,
    "block_kernels": block_kernels,
    "trainer_shared": lambda ctx: trainer(ctx, "shared"),
    "trainer_standard": lambda ctx: trainer(ctx, "standard"),
    "zero3_compile": zero3_compile,
    "varlen": varlen,
    "tp2_graph_breaks": tp2_graph_breaks,
    "cuda_tests": cuda_tests,
}


def run_step(name: str, out: Path, rehearse: bool) -> int:
    """Run one step and write OUT/steps/NAME.json: status, figures, note. An exception is a failed
    step whose note is its last line (the traceback goes to the step's log)."""
    make_absent()
    sys.path.insert(0, str(REPO))
    ctx = Ctx(out, rehearse)
    try:
        result = STEP_FUNCTIONS[name](ctx)
        record = {"status": result.status, "note": result.note, "figures": dict(result)}
    except Exception as err:  # noqa: BLE001 - the row says what failed; the next step runs
        traceback.print_exc()
        record = {
            "status": "failed",
            "note": f"{type(err).__name__}: {err}".splitlines()[0][:300],
            "figures": {},
        }
    path = out / "steps" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown race with the communicators' and loaders' threads (as launchers/pretrain.py)
