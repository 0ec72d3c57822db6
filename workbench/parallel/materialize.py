"""Materialize a meta-device model (possibly sharded) with a layout-invariant initialization.

Every parameter is drawn in full from a generator seeded by (seed, its canonical name), then
each rank keeps its own shard. So dp, tp, pp and ZeRO layouts all start from the same weights
as the single-process model, which is what makes parity tests possible.
"""
from __future__ import annotations

import math
import zlib
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from workbench.models import canonical_name

if TYPE_CHECKING:
    from workbench.spec import JobSpec

_RESIDUAL_OUT = ("attn.wo.weight", "mlp.w2.weight")


def param_name(model: nn.Module, name: str) -> str:
    """The canonical name of `model`'s parameter `name`: wrappers stripped, and a pipeline stage's
    copy of a tied weight named as the weight it copies (parallel/tied.py)."""
    name = canonical_name(name)
    return getattr(model, "init_aliases", {}).get(name, name)


def init_full(name: str, shape: torch.Size, seed: int, num_layers: int) -> torch.Tensor:
    """The full (unsharded) fp32 initial value of one parameter."""
    name = canonical_name(name)
    if name.endswith("bias"):
        return torch.zeros(shape)
    if len(shape) == 1:  # norm weights
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    std = 0.02 / math.sqrt(2 * num_layers) if name.endswith(_RESIDUAL_OUT) else 0.02
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def local_slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `full` for a plain tensor or a DTensor parameter."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh, param.placements)
    index = tuple(slice(o, o + s) for o, s in zip(offset, local_shape))
    return full[index]


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int) -> nn.Module:
    """Allocate `model`'s storage on `device` and fill it deterministically from `seed`."""
    from torch.distributed.tensor import DTensor

    if any(p.is_meta for p in model.parameters()):
        tied = _tied_groups(model)
        model.to_empty(device=device)
        for (owner, attr), *others in tied:  # to_empty gives each module its own tensor: re-tie
            for module, name in others:
                setattr(module, name, getattr(owner, attr))
    num_layers = max(1, _count_blocks(model))
    seen: set[int] = set()
    named = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:  # tied weights: initialize once
            continue
        seen.add(id(param))
        named.append((param_name(model, name), param))
    source = getattr(model, "init_source", None)
    if source is not None:  # released or earlier weights: each rank reads its own slices
        _load(model, named, source)
        return model
    for name, param in named:
        full = init_full(name, param.shape, seed, num_layers)
        local = local_slice(full, param)
        target = param.to_local() if isinstance(param, DTensor) else param
        target.copy_(local.to(device=target.device, dtype=target.dtype))
    return model


def _load(model: nn.Module, named: list, source: tuple[str, str]) -> None:
    """Fill `named` (canonical name, parameter) from model.init_source (workbench.hf_import): the
    checkpoint's values in fp32, this rank's region of each tensor only."""
    from torch.distributed.tensor import DTensor

    from workbench.hf_import import CheckpointLoader, local_index, open_loader

    loader = open_loader(source, model.shape)
    try:
        if isinstance(loader, CheckpointLoader):
            loader.fill(named)
            return
        for name, param in named:
            local = loader.read(name, local_index(param))
            target = param.to_local() if isinstance(param, DTensor) else param
            target.copy_(local.to(device=target.device, dtype=target.dtype))
            del local
    finally:
        loader.close()


def _tied_groups(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute) pairs that hold the same Parameter, for each shared parameter."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, attr))
    return [group for group in owners.values() if len(group) > 1]


def _count_blocks(model: nn.Module) -> int:
    shape = getattr(model, "shape", None)
    if shape is not None and hasattr(shape, "layers"):
        return shape.layers
    blocks = getattr(model, "blocks", None)
    return len(blocks) if blocks is not None else 1


def build_model(spec: JobSpec | dict | str) -> nn.Module:
    """The model materialized on CPU with the spec's deterministic initialization.

    Args:
        spec: a JobSpec, or anything `load_spec` accepts.
    Returns:
        An nn.Module whose forward(tokens) returns logits.
    """
    from workbench.models import build_model_meta
    from workbench.spec import load_spec

    spec = load_spec(spec)
    model = build_model_meta(spec)
    materialize(model, torch.device("cpu"), seed=spec.train.seed)
    return model
