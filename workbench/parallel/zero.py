"""ZeRO stages on the dp sub-mesh: 1 = our sharded fp32 master/optimizer (master.py), 2/3 = FSDP2.

Mesh-generic: every function takes the dp sub-mesh (or its group) only, so the same calls work
on a 1-D dp mesh and on the dp axis of a (pp, dp, tp) mesh whose blocks are already
tensor-parallel DTensors (FSDP2 then shards the TP shards along dp: 2-D parallelism).
"""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from workbench.parallel.master import MasterOptimizer, MemoryStore


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, *, reshard_after_forward: bool, mp_policy=None,
               offload_policy=None) -> nn.Module:
    """FSDP2 `fully_shard` on each block of `model.blocks` (if any), then on the root.

    Call on the meta model (before materialize). The root is not resharded after forward: backward
    starts with it (head, final norm), so freeing it would only gather it again at once.

    Args:
        reshard_after_forward: True for zero=3 (free each block's unsharded parameters after its
            forward), False for zero=2 (keep them until backward is done).
        mp_policy: FSDP2 MixedPrecisionPolicy (None: fp32).
        offload_policy: FSDP2 CPUOffloadPolicy for offload=cpu (None: keep on the device).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kw = dict(mesh=dp_mesh, mp_policy=mp_policy or MixedPrecisionPolicy(),
              offload_policy=offload_policy or OffloadPolicy())
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        for block in blocks.values():
            fully_shard(block, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(model, reshard_after_forward=False, **kw)
    return model


def apply_zero(model: nn.Module, dp_mesh: DeviceMesh, *, stage: int, mp_policy=None, offload_policy=None) -> nn.Module:
    """ZeRO-2 (`fully_shard(reshard_after_forward=False)`) or ZeRO-3 (`fully_shard`) on the meta model.

    Stages 0 and 1 leave the model as it is (DDP wraps it; stage 1 shards the optimizer with
    build_master).
    """
    if stage < 2:
        return model
    return apply_fsdp(model, dp_mesh, reshard_after_forward=(stage == 3), mp_policy=mp_policy,
                      offload_policy=offload_policy)


def build_master(model: nn.Module, dp_mesh: DeviceMesh | None, *, stage: int, make_store=None) -> MasterOptimizer:
    """The fp32 master of `model`'s parameters, sharded over dp for zero=1, whole for zero=0.

    Call on the materialized fp32 model, before its parameters are cast to the low dtype.

    Args:
        dp_mesh: the dp sub-mesh (None or size 1: nothing to shard).
        stage: the ZeRO stage (0 or 1).
        make_store: where master and moments live (default in memory; offload.build_file_store for nvme).
    """
    from workbench.runtime.materialize import param_name

    group = dp_mesh.get_group() if dp_mesh is not None and stage == 1 and dp_mesh.size() > 1 else None
    # Canonical names per stage module (a ModuleList of pipeline stages adds no prefix): the
    # master's checkpoint keys, the same under every layout.
    stages = list(model) if isinstance(model, nn.ModuleList) else [model]
    named = [(param_name(m, n), p) for m in stages for n, p in m.named_parameters() if p.requires_grad]
    return MasterOptimizer([p for _, p in named], group, make_store or MemoryStore, names=[n for n, _ in named])
