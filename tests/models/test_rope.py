"""Rotary positions (`position_embedding: rope`, ours): the rotation against one written here on
complex numbers, scores that depend on offsets only, every variant, the unpadded path with positions
restarting per document, compile with no graph break, the Hugging Face export's remote code, context
extension on resume, and the bad-input errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from swbert.models import SWBertConfig, SWBertForMaskedLM
from swbert.models.attention import attention_types
from swbert.models.remote_code import save_loadable
from swbert.models.varlen import unpad_input
from tests.launch_utils import HANG_S, job_env

VOCAB = 96


def rope_config(attention_type: str = "shared", **overrides: object) -> SWBertConfig:
    fields = dict(
        attention_type=attention_type,
        vocab_size=VOCAB,
        position_embedding="rope",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return SWBertConfig.from_size("tiny", **{**fields, **overrides})


def perturbed(model: SWBertForMaskedLM, seed: int = 0) -> SWBertForMaskedLM:
    """Every parameter away from its init (dq, dk, dv at ones and U the identity would hide a mix-up)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def rotate_reference(t: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """t (B, H, S, Dh) rotated as complex numbers: feature i + 1j * feature i + Dh/2 times
    exp(1j * position * theta^(-2i/Dh)), written independently of swbert.models.positions."""
    half = t.shape[-1] // 2
    z = torch.complex(t[..., :half].double(), t[..., half:].double())
    freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / t.shape[-1])
    turn = torch.polar(torch.ones_like(freq), positions.double()[:, None, :, None] * freq)  # (B, 1, S, Dh/2)
    out = z * turn
    return torch.cat([out.real, out.imag], dim=-1).to(t.dtype)


def attention_reference(attn, x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """A layer's output from its literal Q, K, V (`paper_qkv`), the rotation above and softmax attention
    written out."""
    q, k, v = attn.paper_qkv(x)
    q, k = rotate_reference(q, positions, theta), rotate_reference(k, positions, theta)
    probs = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
    y = (probs @ v).transpose(1, 2).flatten(2)  # (B, S, d)
    return torch.nn.functional.linear(y, attn.out_proj.weight, attn.out_proj.bias)


@pytest.mark.parametrize("attention_type", attention_types())
def test_every_variant_rotates_its_own_queries_and_keys(attention_type):
    model = perturbed(SWBertForMaskedLM(rope_config(attention_type, rope_theta=500.0)))
    attn = model.bert.encoder.layers[0].attn
    x = torch.randn(2, 9, model.config.hidden_size)
    positions = torch.tensor([list(range(9)), [3, 1, 4, 1, 5, 9, 2, 6, 5]])  # any ids, per row
    rotary = model.bert.rotary(positions)
    with torch.no_grad():
        assert_close(attn(x, None, None, rotary), attention_reference(attn, x, positions, 500.0))
        # rotation matters: without it the layer computes something else
        assert not torch.allclose(attn(x), attention_reference(attn, x, positions, 500.0), atol=1e-3)


@pytest.mark.parametrize("attention_type", ["standard", "shared"])
def test_scores_and_outputs_depend_on_offsets_only(attention_type):
    """q_m . k_n depends on n - m alone; so shifting every position leaves the whole model unchanged,
    while a learned table changes it."""
    config = rope_config(attention_type)
    rotary = SWBertForMaskedLM(config).bert.rotary
    q, k = torch.randn(2, 1, 1, config.head_dim, dtype=torch.float64).unbind(0)

    def score(m: int, n: int) -> torch.Tensor:
        cos_m, sin_m = (t.double() for t in rotary(torch.tensor([[m]])))
        cos_n, sin_n = (t.double() for t in rotary(torch.tensor([[n]])))
        half = config.head_dim // 2

        def rot(t, c, s):
            return t * c + torch.cat([-t[..., half:], t[..., :half]], -1) * s

        return (rot(q, cos_m, sin_m) * rot(k, cos_n, sin_n)).sum()

    assert_close(score(2, 7), score(102, 107), rtol=1e-5, atol=1e-6)  # the angles are fp32
    assert_close(score(5, 1), score(35, 31), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(score(2, 7), score(7, 2))  # the signed offset: not symmetric in m, n
    ids = torch.randint(5, VOCAB, (2, 12))
    for pe, same in (("rope", True), ("learned", False)):
        model = perturbed(SWBertForMaskedLM(rope_config(attention_type, position_embedding=pe)))
        with torch.no_grad():
            plain = model(input_ids=ids).logits
            shifted = model(input_ids=ids, position_ids=torch.arange(12)[None] + 17).logits
        assert torch.allclose(plain, shifted, atol=1e-5) is same, pe


def test_rope_has_no_position_table_and_counts_say_so():
    from swbert.models.flops import masked_lm_params

    rope, learned = (SWBertForMaskedLM(rope_config(position_embedding=pe)) for pe in ("rope", "learned"))
    assert rope.bert.embeddings.position_embeddings is None
    assert rope.bert.embeddings.token_type_embeddings is not None  # kept
    assert not any("position" in k for k in rope.state_dict())
    assert not list(rope.bert.rotary.buffers())  # cos and sin come from each forward
    for model in (rope, learned):
        assert masked_lm_params(model.config) == sum(p.numel() for p in model.parameters())
    # no table to run past: longer than max_position_embeddings runs
    long_ids = torch.randint(5, VOCAB, (1, rope.config.max_position_embeddings + 8))
    assert rope.eval()(input_ids=long_ids).logits.shape[1] == long_ids.shape[1]


@pytest.mark.parametrize("attention_type", ["shared", "symmetric"])
def test_unpadded_stream_restarts_positions_per_document(attention_type):
    """Document attention: each document of the stream computes what it computes alone, its positions
    from 0, so the unpadded path equals the padded one row by row."""
    model = perturbed(SWBertForMaskedLM(rope_config(attention_type)))
    ids = torch.randint(5, VOCAB, (3, 10))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 3:] = 0
    with torch.no_grad():
        padded = model.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        stream = unpad_input(ids, mask)
        unpadded = model.bert(
            input_ids=stream.input_ids, cu_seqlens=stream.cu_seqlens, max_seqlen=stream.max_seqlen
        ).last_hidden_state  # (T, d)
    assert_close(unpadded, padded.reshape(-1, padded.shape[-1])[stream.indices], rtol=1e-4, atol=1e-5)


def test_folding_for_inference_keeps_the_function_with_rope():
    model = perturbed(SWBertForMaskedLM(rope_config("shared")))
    ids = torch.randint(5, VOCAB, (2, 8))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        after = model.optimize_for_inference()(input_ids=ids).logits
    assert_close(after, before)


@pytest.mark.slow
@pytest.mark.parametrize("attention_type", ["shared", "pairwise"])
def test_compiled_equals_eager_without_graph_breaks(attention_type):
    config = rope_config(attention_type, local_attention_window=4, global_attention_every=2)
    model = perturbed(SWBertForMaskedLM(config)).train()
    ids = torch.randint(5, VOCAB, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    explanation = torch._dynamo.explain(lambda **kw: model(**kw).logits)(**inputs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    eager = model(**inputs).logits
    eager.square().mean().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = torch.compile(model, backend="aot_eager", fullgraph=True)(**inputs).logits
    got.square().mean().backward()
    assert_close(got, eager)
    for name, p in model.named_parameters():
        assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
    torch._dynamo.reset()


# Runs where `import swbert` fails: transformers and the folder's own code build the model.
PLAIN = """
import sys
sys.modules["swbert"] = None
import torch
from torch.testing import assert_close
from transformers import AutoModelForMaskedLM

for folder in sys.argv[1:]:
    model = AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    inputs = torch.load(f"{folder}/../inputs.pt")
    with torch.no_grad():
        logits = model(**inputs).logits
    assert_close(logits, torch.load(f"{folder}/../expected.pt"), rtol=1e-5, atol=1e-5)
    print(folder, "ok")
"""


@pytest.mark.slow
def test_export_with_remote_code_gives_the_same_logits(tmp_path):
    """rope and local attention (every variant's code is the same file) load from the folder alone."""
    folders = []
    for name, overrides in {
        "rope": {"attention_type": "shared"},
        "rope-local": {
            "attention_type": "standard",
            "local_attention_window": 4,
            "global_attention_every": 2,
        },
    }.items():
        model = perturbed(SWBertForMaskedLM(rope_config(**overrides, rope_theta=2000.0)))
        folder = save_loadable(model, tmp_path / name / "model")
        ids = torch.randint(5, VOCAB, (2, 11))
        inputs = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids).index_fill(1, torch.tensor([9, 10]), 0),
        }
        with torch.no_grad():
            torch.save(model(**inputs).logits, tmp_path / name / "expected.pt")
        torch.save(inputs, tmp_path / name / "inputs.pt")
        saved = json.loads((folder / "config.json").read_text())
        assert saved["position_embedding"] == "rope" and saved["rope_theta"] == 2000.0
        assert "no transformers BERT equivalent" in (folder / "README.md").read_text()
        folders.append(str(folder))
    env = job_env(HF_MODULES_CACHE=str(tmp_path / "modules"))
    env.pop("PYTHONPATH")
    done = subprocess.run(
        [sys.executable, "-c", PLAIN, *folders],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count(" ok") == 2


def test_context_extension_resume_builds_the_model_at_the_new_theta_and_length(tmp_path):
    """A resume at a longer seq_len with a larger rope_theta: the recorded theta may change only when
    named, and the checkpoint's weights load into the model the new settings build (no table to grow)."""
    from swbert.runtime.checkpoint_format import META
    from swbert.training.build import build_model_config
    from swbert.training.compat import check_compatible
    from swbert.training.config import RESUME_CHANGEABLE, TrainConfig

    assert "rope_theta" in RESUME_CHANGEABLE
    data = SimpleNamespace(vocab_size=VOCAB, special_ids=SimpleNamespace(pad=0))  # what the model reads
    short = TrainConfig(size="tiny", position_embedding="rope", seq_len=64)
    long = TrainConfig(size="tiny", position_embedding="rope", seq_len=1024, rope_theta=160000.0)
    long.check()
    old, new = build_model_config(short, data), build_model_config(long, data)
    assert (new.rope_theta, new.max_position_embeddings) == (160000.0, 1024)
    trained = perturbed(SWBertForMaskedLM(old))
    resumed = SWBertForMaskedLM(new).eval()
    resumed.load_state_dict(trained.state_dict(), strict=True)
    ids = torch.randint(5, VOCAB, (1, 40))
    with torch.no_grad():  # the same weights, other angles
        assert not torch.allclose(resumed(input_ids=ids).logits, trained(input_ids=ids).logits, atol=1e-4)
    record = {"model": {"size": "tiny"}, "tensor_parallel": 1}
    (tmp_path / META).write_text(json.dumps({**record, "run": {"rope_theta": 10000.0, "seq_len": 64}}))
    now = {**record, "run": {"rope_theta": 160000.0, "seq_len": 1024}}
    with pytest.raises(ValueError, match="--allow-resume-change rope_theta,seq_len"):
        check_compatible(tmp_path, now, (), tensors=False)
    changes = check_compatible(tmp_path, now, ("rope_theta", "seq_len"), tensors=False)
    assert changes == ["rope_theta: 10000.0 -> 160000.0", "seq_len: 64 -> 1024"]


def test_bad_input_is_one_line_naming_the_key():
    from swbert.convert import to_hf_bert
    from swbert.training.config import build_config

    with pytest.raises(
        ValueError, match=r"^position_embedding=rope needs an even head dimension.*= 15;"
    ) as err:
        SWBertConfig(hidden_size=60, num_attention_heads=4, position_embedding="rope")
    assert "\n" not in str(err.value)
    SWBertConfig(hidden_size=60, num_attention_heads=4)  # learned positions take any head width
    with pytest.raises(ValueError, match=r"position_embedding='alibi' is not one of learned, rope"):
        rope_config(position_embedding="alibi")
    for theta in (0.0, -5.0, float("inf"), "big"):
        with pytest.raises(ValueError, match=r"^rope_theta=.* must be a finite number above 1"):
            rope_config(rope_theta=theta)
    with pytest.raises(ValueError, match="position_embedding"):  # at config check, before any process
        build_config(None, ["--position-embedding", "sinusoidal"])
    with pytest.raises(ValueError, match="position_embedding=rope has no transformers BERT equivalent"):
        to_hf_bert(SWBertForMaskedLM(rope_config("standard")))
