"""Shared pieces of the tensor-parallel tests: real processes on gloo, a tiny model, batches.

`run_ranks(fn, n, ...)` starts n processes (forked from the test process, so they start with its
imports instead of paying about 10 s each to import torch, DeepSpeed and megatron-core again; a
free localhost port),
initializes torch.distributed on gloo in each and calls `fn(*args)`; an assertion failing in
any rank fails the test with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from swbert.models import SWBertConfig, SWBertForMaskedLM

VOCAB = 128


def tiny_config(attention_type: str = "shared", **overrides: object) -> SWBertConfig:
    """The tiny model without dropout, so TP=1 and TP=k runs are comparable step by step."""
    fields = dict(
        vocab_size=VOCAB,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attention_type=attention_type,
    )
    return SWBertConfig.from_size("tiny", **{**fields, **overrides})


def reference_model(config: SWBertConfig, seed: int = 0) -> SWBertForMaskedLM:
    """A TP=1 model with every parameter away from its init (dq, dk, dv, U start as ones/identity)."""
    torch.manual_seed(seed)
    model = SWBertForMaskedLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def mlm_batch(seed: int, batch: int = 4, seq: int = 16, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """Token ids with padding and ~25% labelled positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, seq // 2 :] = 0
    ids[mask == 0] = 0
    labels = torch.where(torch.rand(ids.shape, generator=g) < 0.25, ids, torch.full_like(ids, -100))
    labels[mask == 0] = -100
    labels[0, 1] = ids[0, 1]  # at least one labelled token
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., None], args: tuple, deepspeed: bool) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(1)  # several ranks share a few cores
    if deepspeed:
        import deepspeed as ds

        ds.init_distributed(dist_backend="gloo", verbose=False)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(*args)
    finally:
        from swbert import parallel

        if parallel.is_initialized():
            parallel.destroy()
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., None], world: int, *args: object, deepspeed: bool = False) -> None:
    """Run `fn(*args)` in `world` processes on gloo; `deepspeed=True` starts them the DeepSpeed way."""
    mp.start_processes(
        _entry, args=(world, _free_port(), fn, args, deepspeed), nprocs=world, join=True, start_method="fork"
    )
