"""Data parallel: DDP with bucketed gradient all-reduce overlapped with backward."""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel


def apply_ddp(model: nn.Module, mesh: DeviceMesh, *, bucket_mb: float) -> nn.Module:
    """Wrap a materialized model in DDP over the mesh's dp axis.

    Buckets of `bucket_mb` MiB are all-reduced as soon as their gradients are ready, so the
    communication overlaps the rest of backward. Gradients are views into the buckets
    (`gradient_as_bucket_view`), so no second copy of the gradients is allocated. Callers skip
    the all-reduce on non-final micro-batches with `model.no_sync()`.
    """
    device_ids = [model_device(model).index] if model_device(model).type == "cuda" else None
    return DistributedDataParallel(
        model,
        process_group=mesh.get_group("dp"),
        bucket_cap_mb=bucket_mb,
        gradient_as_bucket_view=True,
        device_ids=device_ids,
    )


def model_device(model: nn.Module):
    return next(model.parameters()).device
