"""The local part of a tensor that may be a DTensor (a TP or FSDP shard) or a plain tensor, and
modules whose parameters are DTensors but whose forward computes on the local shards."""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, distribute_module, distribute_tensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `t` as a plain tensor (`t` itself when it is not a DTensor).

    Through autograd (`to_local`) only where the result must carry gradients back to `t`; every
    other use (gradients, values under no_grad) takes the shard as it is stored: `to_local` is an
    autograd Function call, ~150 of them per step for zeroing an FSDP2 model's gradients alone.
    """
    if not isinstance(t, DTensor):
        return t
    if t.requires_grad and torch.is_grad_enabled():
        return t.to_local()
    return t._local_tensor


def shard_parameters(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement]) -> None:
    """Make `module`'s own parameters DTensors over the 1-D `mesh`, placed by name (e.g.
    {"weight": Shard(0), "bias": Shard(0)}); the names, and what refers to the module, stay."""
    def shard(_name, mod, mesh):
        for name, param in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [placements[name]]),
                                                      requires_grad=param.requires_grad))

    distribute_module(module, mesh, shard)
