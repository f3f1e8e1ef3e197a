"""State dicts across tensor-parallel sizes: gather a sharded model into TP=1, shard TP=1 for TP=k,
merge saved shards, and the layout DeepSpeed's universal checkpoint needs to reshard one.

A TP=k state dict has the TP=1 keys; tensors that `plan.partition_dim` names are rank r's chunk r
of k along that dimension, every other tensor is the full one.

Checkpoints change tensor-parallel (and data-parallel) size with optimizer state through
DeepSpeed's universal checkpoint: `python -m swbert.parallel.convert universal` turns a checkpoint
into one that loads at any size, adding which parameters are split along which dimension
(`universal_checkpoint_info`, derived from the same `plan`) from the model config the checkpoint's
swbert_meta.json records. A run refuses a checkpoint of another tensor-parallel size itself, naming
that command (`swbert.training.compat.check_compatible`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.checkpoint import constants as ds_ckpt
from torch import nn

from swbert.models import SWBertConfig, SWBertForMaskedLM
from swbert.parallel import plan
from swbert.parallel.state import dims
from swbert.runtime.checkpoint_format import LATEST, LATEST_UNIVERSAL, read_latest

# DeepSpeed's per-TP-rank module files: <dir>/<tag>/mp_rank_00_model_states.pt, mp_rank_01_...; under
# ZeRO-3 one per data- and tensor-parallel rank, zero_pp_rank_<dp>_mp_rank_<tp>_model_states.pt.
_MODEL_STATES = re.compile(r"(?:zero_pp_rank_0_)?mp_rank_(\d+)_model_states\.pt")
CONFIG_KEY = "model_config"  # swbert_meta.json's key (or a client state's) for SWBertConfig.to_dict()


def _tensors(state: dict[str, object]) -> dict[str, torch.Tensor]:
    # megatron layers add `_extra_state` (None) entries; they carry nothing.
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def shard_state_dict(
    full_state: dict[str, torch.Tensor], tp_rank: int, tp_size: int, config: SWBertConfig
) -> dict[str, torch.Tensor]:
    """Rank `tp_rank`'s state dict for a TP=`tp_size` model, from a TP=1 (full) state dict."""
    plan.check_divisible(config, tp_size)
    return {
        name: plan.shard(t, plan.partition_dim(name, config), tp_rank, tp_size)
        for name, t in _tensors(full_state).items()
    }


def merge_state_dicts(shards: list[dict[str, torch.Tensor]], config: SWBertConfig) -> dict[str, torch.Tensor]:
    """The TP=1 state dict from the state dicts of TP ranks 0..k-1 (in rank order)."""
    merged = {}
    for name, t in _tensors(shards[0]).items():
        dim = plan.partition_dim(name, config)
        merged[name] = t if dim is None or len(shards) == 1 else torch.cat([s[name] for s in shards], dim)
    return merged


def gather_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (TP=1) state dict of a tensor-parallel model, as CPU tensors on every rank.

    A collective over the tensor-parallel group: every rank of the group must call it. The result
    loads into `SWBertForMaskedLM(config)`, e.g. to `save_pretrained` a Hugging Face folder. Under
    ZeRO-3, call it inside `deepspeed.zero.GatheredParameters(model.parameters())`.
    """
    return gather_tensors(model.state_dict(), model.config)


def gather_tensors(local: dict[str, torch.Tensor], config: SWBertConfig) -> dict[str, torch.Tensor]:
    """Full tensors (on CPU) from this rank's shards named as in the state dict, e.g. gradients.

    A collective over the tensor-parallel group.
    """
    local = _tensors(local)
    d = dims()
    if d.tp_size == 1:
        return {k: v.detach().cpu() for k, v in local.items()}
    done: dict[int, torch.Tensor] = {}  # tied tensors (embedding / decoder) are gathered once
    full = {}
    for name, t in local.items():
        if id(t) not in done:
            dim = plan.partition_dim(name, config)
            if dim is None:
                done[id(t)] = t.detach().cpu()
            else:
                parts = [torch.empty_like(t) for _ in range(d.tp_size)]
                dist.all_gather(parts, t.detach().contiguous(), group=d.tp_group)
                done[id(t)] = torch.cat(parts, dim).cpu()
        full[name] = done[id(t)]
    return full


def universal_checkpoint_info(config: SWBertConfig) -> dict[str, object]:
    """The layout DeepSpeed's universal checkpoint needs: replicated and row-parallel parameters by
    exact name (everything else is split along dim 0), from `plan.partition_dim`."""
    with torch.device("meta"):  # names only; no memory
        names = [name for name, _ in SWBertForMaskedLM(config).named_parameters()]
    exact = [(name, plan.partition_dim(name, config)) for name in names]
    return {
        ds_ckpt.UNIVERSAL_CHECKPOINT_VERSION_KEY: ds_ckpt.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        ds_ckpt.TP_REPLICATED_PARAMETER_PATTERNS: [re.escape(n) + "$" for n, d in exact if d is None],
        ds_ckpt.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [re.escape(n) + "$" for n, d in exact if d == 1],
    }


def resolve_tag(ckpt_dir: str | Path, tag: str | None = None) -> str:
    """`tag`, or the one DeepSpeed's `latest` file names."""
    if tag is not None:
        return tag
    for pointer in (LATEST_UNIVERSAL, LATEST):  # a folder a universal conversion wrote names its own
        named = read_latest(Path(ckpt_dir), pointer, step_tags=False)
        if named is not None:
            return named
    raise FileNotFoundError(f"{ckpt_dir} has no 'latest' file naming a folder in it; pass the tag (--tag)")


def model_state_files(ckpt_dir: str | Path, tag: str | None = None) -> list[Path]:
    """The per-TP-rank model files of a DeepSpeed checkpoint, in rank order."""
    folder = Path(ckpt_dir) / resolve_tag(ckpt_dir, tag)
    found = sorted(
        (int(m.group(1)), p)
        for p in folder.glob("*mp_rank_*_model_states.pt")
        if (m := _MODEL_STATES.fullmatch(p.name))
    )
    if not found:
        raise FileNotFoundError(f"{folder} holds no mp_rank_*_model_states.pt: not a DeepSpeed checkpoint")
    ranks = [r for r, _ in found]
    if ranks != list(range(len(ranks))):
        raise FileNotFoundError(f"{folder} holds TP ranks {ranks}; some are missing")
    return [p for _, p in found]
