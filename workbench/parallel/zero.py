"""ZeRO on the dp sub-mesh: stage 1 = our sharded fp32 master/optimizer (master.py), 2/3 = FSDP2.

Mesh-generic: every function takes the dp sub-mesh (or its group) only, so the same calls work
on a 1-D dp mesh and on the dp axis of a (pp, dp, tp) mesh whose blocks are already
tensor-parallel DTensors (FSDP2 then shards the TP shards along dp: 2-D parallelism).
"""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from workbench.parallel.master import MasterOptimizer, MemoryStore


def fsdp_units(blocks: list[nn.Module], unit_mb: float | None) -> list[list[nn.Module]]:
    """Consecutive blocks grouped into FSDP2 units of at most `unit_mb` MiB of fp32 gradient (a
    larger block is a unit alone); None: one block per unit (Parallelism.fsdp_unit_mb)."""
    from workbench.parallel.local import local

    units: list[list[nn.Module]] = []
    size = 0
    for block in blocks:
        n = 4 * sum(local(p).numel() for p in block.parameters() if p.requires_grad)
        if not units or unit_mb is None or size + n > unit_mb * 2**20:
            units.append([])
            size = 0
        units[-1].append(block)
        size += n
    return units


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, *, reshard_after_forward: bool, mp_policy=None,
               offload_policy=None, unit_mb: float | None = None) -> nn.Module:
    """FSDP2 `fully_shard` on each unit of consecutive blocks of `model.blocks` (if any; `fsdp_units`),
    then on the root (embeddings, final norm, head); a model whose whole fp32 gradient fits
    `unit_mb` is one unit, the root alone.

    Call on the meta model (before materialize). The root is not resharded after forward: backward
    starts with it (head, final norm), so freeing it would only gather it again at once.

    Args:
        reshard_after_forward: True for zero=3 (free each block's unsharded parameters after its
            forward), False for zero=2 (keep them until backward is done).
        mp_policy: FSDP2 MixedPrecisionPolicy (None: fp32).
        offload_policy: FSDP2 CPUOffloadPolicy for offload=cpu (None: keep on the device).
        unit_mb: blocks per unit (`fsdp_units`; None: one block per unit).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from workbench.memory.params import whole_unit
    from workbench.parallel.local import local

    kw = dict(mesh=dp_mesh, mp_policy=mp_policy or MixedPrecisionPolicy(),
              offload_policy=offload_policy or OffloadPolicy())
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleDict) and not whole_unit(sum(local(p).numel() for p in model.parameters()), unit_mb):
        for unit in fsdp_units(list(blocks.values()), unit_mb):
            fully_shard(unit if len(unit) > 1 else unit[0], reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(model, reshard_after_forward=False, **kw)
    return model


def build_master(model: nn.Module, dp_mesh: DeviceMesh | None, *, sharded: bool, make_store=None) -> MasterOptimizer:
    """The fp32 master of `model`'s parameters: a flat 1/dp range per rank when `sharded` (zero=1),
    whole otherwise (Parallelism.master_sharded says which).

    Call on the materialized fp32 model, before its parameters are cast to the low dtype.

    Args:
        model: a module, or a ModuleList of this rank's pipeline stages.
        dp_mesh: the dp sub-mesh (None for a single process).
        sharded: shard the master and the optimizer state over dp_mesh.
        make_store: where master and moments live (default in memory; offload.build_file_store for nvme).
    """
    from workbench.parallel.materialize import param_name

    group = dp_mesh.get_group() if sharded and dp_mesh is not None else None
    # Canonical names per stage module (a ModuleList of pipeline stages adds no prefix): the
    # master's checkpoint keys, the same under every layout.
    stages = list(model) if isinstance(model, nn.ModuleList) else [model]
    named = [(param_name(m, n), p) for m in stages for n, p in m.named_parameters() if p.requires_grad]
    return MasterOptimizer([p for _, p in named], group, make_store or MemoryStore, names=[n for n, _ in named])
