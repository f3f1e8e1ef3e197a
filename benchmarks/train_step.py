"""Training-step throughput and activation memory: transformers' BERT against swbert's variants.

One process builds every model at the same shape, then times forward + backward + optimizer step
in interleaved repetitions after a warm-up (the order rotates every repetition, so a slow spell of
a shared machine hits every model alike) and prints the median of each and the ratios that matter:

    python benchmarks/train_step.py                       # BERT-base, seq 128, batch 8
    python benchmarks/train_step.py --seq-len 512 --batch 4 --reps 10
    python benchmarks/train_step.py --smoke               # tiny shape, seconds (run by the tests)
    python benchmarks/train_step.py --models standard,standard-full,shared,shared-full   # last layer on/off
    python benchmarks/train_step.py --models standard,standard-separate   # what the fused QKV GEMM is worth

The reference is what a user would otherwise run: `transformers.BertForMaskedLM` with
`attn_implementation="sdpa"`, labels set to -100 on the unmasked positions (15% masked), the same
optimizer (torch AdamW) and the same dtype. On a GPU the default dtype is bf16, SDPA picks the
fused (flash / memory-efficient / cuDNN) kernels, and MFU is printed next to the throughput.

Activation memory is the bytes of the distinct tensors autograd saves for backward in one forward
pass (parameters excluded), read through `torch.autograd.graph.saved_tensors_hooks`, which works on
every device; on a GPU the peak allocated memory of a step above what was resident before it is
printed as well. `--inference` adds eval-mode latency of `shared` before and after
`optimize_for_inference()`. `<variant>-full` (`standard-full`, `shared-full`, ...; not in the
default set) is that swbert variant with `last_layer_on_labels = False`: its last layer computes
every position, not only the masked ones. `standard-separate` is standard attention as it was before
its projections were fused: three d x d GEMMs (q_proj, k_proj, v_proj) instead of one 3d x d.

On a CPU every swbert model runs with the CPU kernels (`swbert.runtime.cpu.optimize_for_cpu`), as the
trainer does by default there. `<model>-plain` runs it without them, exactly the model path a GPU
runs; `<model>+dropout+decoder` with only those kernels, so one run measures what each is worth:

    python benchmarks/train_step.py --models standard,standard-plain,shared,shared-plain
    python benchmarks/train_step.py --models shared-plain,shared+dropout,shared+attention,shared+decoder,shared
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers
from torch import nn

from swbert.models import SWBertConfig, SWBertForMaskedLM
from swbert.models.attention import SelfAttention, StandardAttention, attention_types, unpack_heads
from swbert.models.flops import masked_lm_flops
from swbert.runtime.cpu import CPU_KERNELS, keep_freed_memory, optimize_for_cpu
from swbert.runtime.monitor import peak_tflops_of

MODELS: tuple[str, ...] = ("hf", "standard", "shared", "symmetric", "pairwise")
# Opt-in: a variant without the masked-positions-only last layer, e.g. "shared-full".
FULL_LAST_LAYER = "-full"
# Opt-in: standard attention with its Q, K, V projections as three GEMMs, as before the fusion.
SEPARATE = "-separate"
# Suffixes for the CPU kernels: none of them (the GPU's path), or only the named ones.
PLAIN = "-plain"
MODEL_FORMS = (
    f"hf, or <variant>[{FULL_LAST_LAYER}][{PLAIN} | +kernel...] with a variant of {attention_types()} "
    f"and kernels of {CPU_KERNELS}, or standard{SEPARATE}[...]"
)
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
MASK_PROB = 0.15


@dataclass
class Result:
    """Medians over the timed repetitions of one model."""

    name: str
    params: int
    step_s: list[float] = field(default_factory=list)  # wall clock
    cpu_s: list[float] = field(default_factory=list)  # this process's CPU time
    activation_bytes: int = 0
    peak_step_bytes: int | None = None  # GPU only: max allocated during a step minus before it
    flops_per_token: float = 0.0  # training FLOPs (forward + backward) per input token

    clock: str = "wall"

    @property
    def median_s(self) -> float:
        """Median seconds per step on the clock the throughput is quoted on."""
        return statistics.median(self.cpu_s if self.clock == "process" else self.step_s)

    def tokens_per_s(self, tokens: int) -> float:
        return tokens / self.median_s


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="base", help="named size from swbert.models.SIZES (default: base)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--vocab-size", type=int, default=30522, help="default: BERT's WordPiece vocabulary")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions of every model")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {MODELS}")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument(
        "--dropout",
        type=float,
        default=None,
        help="override hidden and attention dropout (default: 0.1, BERT's)",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile every model (the reference too)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument(
        "--clock",
        choices=("wall", "process"),
        default="wall",
        help="time steps by the wall clock, or by this process's CPU time: on a CPU shared with other "
        "jobs, with --threads 1, the CPU time is the time the step would take on an idle core",
    )
    p.add_argument(
        "--malloc",
        choices=("keep", "system"),
        default="keep",
        help="CPU: keep freed memory in the process for reuse, as the trainer does (default), or glibc's "
        "own behaviour (every model in the run gets the same)",
    )
    p.add_argument("--peak-tflops", type=float, default=None, help="accelerator peak for MFU")
    p.add_argument("--inference", action="store_true", help="also time shared before/after the fold")
    p.add_argument("--inference-batch", type=int, default=1, help="sequences per eval forward (latency)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--smoke", action="store_true", help="tiny shape, 2 reps: checks that the script runs")
    args = p.parse_args(argv)
    if args.smoke:  # one thread: tiny shapes gain nothing from more, and they wait on a busy machine
        args.size, args.seq_len, args.batch, args.vocab_size = "tiny", 16, 2, 1024
        args.reps, args.warmup, args.threads = 2, 1, 1
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.dtype = args.dtype or ("bf16" if args.device.type == "cuda" else "fp32")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    for name in args.models:
        try:
            if name != "hf":
                parse_model(name)
        except ValueError as e:
            p.error(f"--models: {e}")
    return args


@dataclass(frozen=True)
class ModelSpec:
    variant: str  # an attention type
    full_last_layer: bool = False
    cpu_kernels: tuple[str, ...] = CPU_KERNELS  # on a CPU; () is the plain path
    separate_qkv: bool = False  # standard only: Q, K, V as three GEMMs (before the fusion)


def parse_model(name: str) -> ModelSpec:
    """`shared`, `shared-full`, `shared-plain`, `shared+dropout+decoder`, `shared-full-plain`,
    `standard-separate-full`, ..."""
    base, *kernels = name.split("+")
    plain = base.endswith(PLAIN)
    base = base.removesuffix(PLAIN)
    full = base.endswith(FULL_LAST_LAYER)
    base = base.removesuffix(FULL_LAST_LAYER)
    separate = base.endswith(SEPARATE)
    variant = base.removesuffix(SEPARATE)
    if (
        variant not in attention_types()
        or (plain and kernels)
        or not set(kernels) <= set(CPU_KERNELS)
        or (separate and variant != StandardAttention.attention_type)
    ):
        raise ValueError(f"unknown model {name!r}: use {MODEL_FORMS}")
    return ModelSpec(variant, full, () if plain else tuple(kernels) or CPU_KERNELS, separate)


class SeparateQKVAttention(SelfAttention):
    """Standard attention before the fusion: Q, K and V from three d x d projections (not registered:
    a benchmark baseline only)."""

    def __init__(self, fused: StandardAttention, config: SWBertConfig) -> None:
        super().__init__(config)
        self.load_state_dict(
            {"out_proj." + k: v for k, v in fused.out_proj.state_dict().items()}, strict=False
        )
        d = config.hidden_size
        weights, biases = (unpack_heads(t.detach(), 3, self.head_dim) for t in fused.in_proj.parameters())
        for name, w, b in zip(StandardAttention.packed["in_proj"], weights, biases):
            linear = nn.Linear(d, d)
            with torch.no_grad():
                linear.weight.copy_(w)
                linear.bias.copy_(b)
            setattr(self, name, linear)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            self.split_heads(self.q_proj(x)),
            self.split_heads(self.k_proj(x)),
            self.split_heads(self.v_proj(x)),
        )


def swbert_config(args: argparse.Namespace, attention_type: str = "standard") -> SWBertConfig:
    overrides = {}
    if args.dropout is not None:
        overrides = dict(hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout)
    max_pos = max(512, args.seq_len)
    return SWBertConfig.from_size(
        args.size,
        attention_type=attention_type,
        vocab_size=args.vocab_size,
        max_position_embeddings=max_pos,
        **overrides,
    )


def build_model(name: str, args: argparse.Namespace) -> nn.Module:
    """`hf` is transformers' BertForMaskedLM with the same fields as swbert's config."""
    if name == "hf":
        c = swbert_config(args)
        hf_config = transformers.BertConfig(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            num_hidden_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads,
            intermediate_size=c.intermediate_size,
            hidden_act=c.hidden_act,
            hidden_dropout_prob=c.hidden_dropout_prob,
            attention_probs_dropout_prob=c.attention_probs_dropout_prob,
            max_position_embeddings=c.max_position_embeddings,
            layer_norm_eps=c.layer_norm_eps,
            attn_implementation="sdpa",
        )
        return transformers.BertForMaskedLM(hf_config)
    spec = parse_model(name)
    model = SWBertForMaskedLM(swbert_config(args, spec.variant))
    model.last_layer_on_labels = not spec.full_last_layer
    if spec.separate_qkv:
        for layer in model.bert.encoder.layers:
            layer.attn = SeparateQKVAttention(layer.attn, model.config)
    if args.device.type == "cpu" and not args.compile:  # as the trainer's cpu_kernels: auto
        optimize_for_cpu(model, spec.cpu_kernels)
    return model


def make_batch(
    vocab: int, batch: int, seq_len: int, seed: int, device: torch.device, hf: bool = False
) -> dict[str, torch.Tensor]:
    """Random tokens with exactly round(15% x seq_len) masked positions per sequence.

    swbert's models get them as the trainer gives them, static shapes (`mlm_positions`,
    `mlm_targets`: the path that compiles whole); the reference as (B, S) `labels`, -100 elsewhere.
    No padding (pretraining packs documents into full sequences), so no attention mask is passed.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, seq_len), generator=g)
    k = max(1, round(MASK_PROB * seq_len))
    positions = torch.rand(batch, seq_len, generator=g).argsort(dim=1)[:, :k].sort(dim=1).values  # (B, k)
    targets = ids.gather(1, positions)
    ids.scatter_(1, positions, min(103, vocab - 1))  # [MASK] in BERT's vocabulary
    if hf:
        labels = torch.full_like(ids, -100).scatter_(1, positions, targets)
        return {"input_ids": ids.to(device), "labels": labels.to(device)}
    return {
        "input_ids": ids.to(device),
        "mlm_positions": positions.to(device),
        "mlm_targets": targets.to(device),
    }


def training_flops_per_token(name: str, args: argparse.Namespace) -> float:
    """The reference computes its 30k-way head on every token; swbert on the masked ones only."""
    if name == "hf":
        return masked_lm_flops(swbert_config(args), args.seq_len, 1.0, last_layer_on_predicted=False).training
    spec = parse_model(name)
    config = swbert_config(args, spec.variant)
    predicted = max(1, round(MASK_PROB * args.seq_len)) / args.seq_len  # what make_batch masks
    return masked_lm_flops(config, args.seq_len, predicted, not spec.full_last_layer).training


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def activation_bytes(model: nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct non-parameter storages autograd keeps for backward after a forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t.detach()  # a saved output kept as itself would keep the discarded graph alive

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    del loss  # frees the graph
    return sum(saved.values())


def make_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]
) -> Callable[[], None]:
    def step() -> None:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """torch AdamW, the same for every model: the fused kernel (one pass over the parameters, on CPU
    several times faster than the multi-tensor path), else the multi-tensor one."""
    params = list(model.parameters())
    try:
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    except RuntimeError:
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=True)


def timed(step: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    synchronize(device)
    t0, c0 = time.perf_counter(), time.process_time()
    step()
    synchronize(device)
    return time.perf_counter() - t0, time.process_time() - c0


def peak_step_bytes(step: Callable[[], None], device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def peak_tflops(args: argparse.Namespace) -> float | None:
    if args.peak_tflops is not None:
        return args.peak_tflops
    if args.device.type != "cuda":
        return None
    return peak_tflops_of(torch.cuda.get_device_name(args.device))  # the trainer's table


def run_training(args: argparse.Namespace) -> tuple[dict[str, Result], int]:
    dtype = DTYPES[args.dtype]
    tokens = args.batch * args.seq_len
    steps: dict[str, Callable[[], None]] = {}
    results: dict[str, Result] = {}
    for name in args.models:
        torch.manual_seed(args.seed)
        model = build_model(name, args).to(device=args.device, dtype=dtype).train()
        batch = make_batch(
            model.config.vocab_size, args.batch, args.seq_len, args.seed, args.device, name == "hf"
        )
        results[name] = Result(
            name=name,
            clock=args.clock,
            params=sum(p.numel() for p in model.parameters()),
            activation_bytes=activation_bytes(model, batch),
            flops_per_token=training_flops_per_token(name, args),
        )
        if args.compile:
            model = torch.compile(model)
        optimizer = make_optimizer(model)
        steps[name] = make_step(model, optimizer, batch)
    for rep in range(args.warmup + args.reps):
        k = rep % len(args.models)
        for name in args.models[k:] + args.models[:k]:
            wall, cpu = timed(steps[name], args.device)
            if rep >= args.warmup:
                results[name].step_s.append(wall)
                results[name].cpu_s.append(cpu)
            if not args.smoke:  # progress, on stderr: a long run that is stopped still says something
                print(f"rep {rep} {name}: {wall:.3f} s wall, {cpu:.3f} s cpu", file=sys.stderr, flush=True)
    for name in args.models:
        results[name].peak_step_bytes = peak_step_bytes(steps[name], args.device)
    return results, tokens


def run_inference(args: argparse.Namespace) -> dict[str, float]:
    """Eval latency of `shared` as trained and after `optimize_for_inference()`; outputs must match.

    In fp32 the two must agree to float rounding. In a 16-bit dtype the fold rounds the rewritten
    weights once more, so the check is that the folded model is as close to the fp32 model as the
    unfolded one (within 50% more error).
    """
    dtype = DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    reference = SWBertForMaskedLM(swbert_config(args, "shared")).to(device=args.device).eval()
    # away from the ones the diagonals start at, so the fold has work to do (positive, as trained
    # models have them: everything folds into the projections)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith((".dq", ".dk", ".dv")):
                p.uniform_(0.5, 1.5)
    plain = copy.deepcopy(reference).to(dtype)
    folded = copy.deepcopy(reference).optimize_for_inference().to(dtype)
    batch = make_batch(plain.config.vocab_size, args.inference_batch, args.seq_len, args.seed, args.device)
    ids = batch["input_ids"]
    models = {"shared": plain, "shared_folded": folded}
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.inference_mode():
        out = {name: m(input_ids=ids).logits.float() for name, m in models.items()}
        if dtype == torch.float32:
            torch.testing.assert_close(out["shared_folded"], out["shared"], rtol=1e-4, atol=1e-4)
        else:
            exact = reference(input_ids=ids).logits
            err = {name: (o - exact).abs().max().item() for name, o in out.items()}
            if err["shared_folded"] > 1.5 * err["shared"]:
                raise AssertionError(
                    f"the folded {args.dtype} model is further from fp32 than the unfolded: {err}"
                )
        names = list(models)
        for rep in range(args.warmup + 10 * args.reps):  # short calls: more of them
            for name in names[rep % 2 :] + names[: rep % 2]:
                wall, cpu = timed(lambda m=models[name]: m(input_ids=ids), args.device)
                if rep >= args.warmup:
                    times[name].append(cpu if args.clock == "process" else wall)
    return {name: statistics.median(t) for name, t in times.items()}


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads"


def paired_ratios(slow: Result, fast: Result) -> list[float]:
    """slow/fast step time within each repetition: the two ran back to back, so a slow spell of a
    shared machine shows up as spread here rather than as a shifted median."""
    clock = "cpu_s" if slow.clock == "process" else "step_s"
    return [s / f for s, f in zip(getattr(slow, clock), getattr(fast, clock))]


def ratio_pairs(names: list[str]) -> list[tuple[str, str]]:
    """(fast, slow) pairs worth a ratio: each variant against standard in the same form, swbert
    standard against transformers, the masked-positions last layer against the full one, and the
    CPU kernels (all, or some) against the plain path."""
    pairs = []
    for name in names:
        if name == "hf":
            continue
        variant = parse_model(name).variant
        suffix = name.removeprefix(variant)
        if variant != "standard" and f"standard{suffix}" in names:
            pairs.append((name, f"standard{suffix}"))
        if SEPARATE in suffix and name.replace(SEPARATE, "") in names:
            pairs.append((name.replace(SEPARATE, ""), name))
            continue
        if FULL_LAST_LAYER in suffix and name.replace(FULL_LAST_LAYER, "") in names:
            pairs.append((name.replace(FULL_LAST_LAYER, ""), name))
        base = name.split("+")[0].removesuffix(PLAIN)
        if not name.endswith(PLAIN) and f"{base}{PLAIN}" in names:
            pairs.append((name, f"{base}{PLAIN}"))
    if "standard" in names and "hf" in names:
        pairs.append(("standard", "hf"))
    return pairs


def report(
    args: argparse.Namespace, results: dict[str, Result], tokens: int, inference: dict[str, float]
) -> dict:
    peak = peak_tflops(args)
    print(
        f"# {args.size}, seq {args.seq_len}, batch {args.batch} ({tokens} tokens/step), {args.dtype}, "
        f"{args.device.type}{' compiled' if args.compile else ''}; {machine()}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}; median of {args.reps} interleaved reps after "
        f"{args.warmup} warm-up; throughput on the {args.clock} clock; malloc {args.malloc}"
    )
    width = max(14, *(len(name) for name in results))
    header = f"{'model':<{width}} {'params':>12} {'wall s':>8} {'cpu s':>8} {'tokens/s':>10} {'TFLOP/s':>8}"
    header += f" {'act. MiB':>9}" + (f" {'peak MiB':>9}" if args.device.type == "cuda" else "")
    print(header + (f" {'MFU':>6}" if peak else ""))
    rows = {}
    for name, r in results.items():
        tps = r.tokens_per_s(tokens)
        tflops = r.flops_per_token * tps / 1e12
        line = (
            f"{name:<{width}} {r.params:>12,} {statistics.median(r.step_s):>8.3f} {statistics.median(r.cpu_s):>8.3f} "
            f"{tps:>10.1f} {tflops:>8.3f} {r.activation_bytes / 2**20:>9.1f}"
        )
        if r.peak_step_bytes is not None:
            line += f" {r.peak_step_bytes / 2**20:>9.1f}"
        print(line + (f" {100 * tflops / peak:>5.1f}%" if peak else ""))
        rows[name] = dict(asdict(r), median_s=r.median_s, tokens_per_s=tps, tflops=tflops)
    ratios: dict[str, float] = {}
    for fast, slow in ratio_pairs(list(results)):
        if fast not in results or slow not in results:
            continue
        a, b = results[fast], results[slow]
        key = f"{fast}/{slow}"
        ratios[key] = b.median_s / a.median_s
        ratios[f"{key} per-rep"] = paired_ratios(b, a)
        ratios[f"{key} activation memory"] = a.activation_bytes / b.activation_bytes
        per_rep = ratios[f"{key} per-rep"]
        label = "swbert standard / transformers BertForMaskedLM" if slow == "hf" else key
        print(
            f"{label} throughput {ratios[key]:.3f}x (same-rep ratios: median {statistics.median(per_rep):.3f}, "
            f"range {min(per_rep):.3f}-{max(per_rep):.3f}; training FLOPs {b.flops_per_token / a.flops_per_token:.3f}x "
            f"fewer), activation memory {ratios[f'{key} activation memory']:.3f}x"
        )
    if inference:
        speedup = inference["shared"] / inference["shared_folded"]
        ratios["shared fold speedup"] = speedup
        print(
            f"inference, eval forward of {args.inference_batch} x {args.seq_len} tokens: shared {1e3 * inference['shared']:.1f} ms, after "
            f"optimize_for_inference() {1e3 * inference['shared_folded']:.1f} ms ({speedup:.3f}x), outputs equal"
        )
    return {
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": machine(),
        "torch": torch.__version__,
        "tokens_per_step": tokens,
        "models": rows,
        "ratios": ratios,
        "inference_s": inference,
    }


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.type == "cpu" and args.malloc == "keep" and not keep_freed_memory():
        args.malloc = "system (glibc refused)"
    try:
        results, tokens = run_training(args)
        inference = run_inference(args) if args.inference else {}
        out = report(args, results, tokens, inference)
    finally:  # callers in the same process (the tests) keep their setting
        torch.set_num_threads(threads)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
