"""Data parallel on a multi-dimensional mesh (dp x tp and/or pp, zero=0): average each rank's
local gradients over the dp axis once per step, in flat buckets (Megatron's non-overlapped DDP).

DDP itself takes plain tensors and one module; TP's DTensor parameters and a pipeline rank's
several stage modules are outside what it handles, so this explicit reduction replaces it there.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from workbench.parallel.local import local


def all_reduce_grads(modules: list[nn.Module], group: dist.ProcessGroup, *, bucket_mb: float) -> None:
    """Average the gradients of `modules` over `group` in place.

    Every rank of the group must hold the same modules (same parameter order), which holds for
    the dp axis: dp replicas share tp and pp coordinates.

    Args:
        modules: this rank's modules (pipeline stages or the whole model).
        group: the dp process group.
        bucket_mb: largest flat buffer per all-reduce, in MiB.
    """
    size = dist.get_world_size(group)
    grads = [local(p.grad) for m in modules for p in m.parameters() if p.grad is not None]
    cap = int(bucket_mb * 2**20)
    bucket: list[torch.Tensor] = []
    for g in grads:
        if bucket and (g.dtype != bucket[0].dtype or sum(b.numel() * b.element_size() for b in bucket) >= cap):
            _reduce(bucket, group, size)
            bucket = []
        bucket.append(g)
    if bucket:
        _reduce(bucket, group, size)


def _reduce(bucket: list[torch.Tensor], group: dist.ProcessGroup, size: int) -> None:
    # In fp32 (Megatron's grad_reduce_in_fp32, FSDP2's reduce_dtype here): each rank's gradient
    # is the mean of its own micro-batches, so the dp sum before the division is dp times the
    # step's gradient, which overflows fp16 (a loss-scaled gradient) where one process would not.
    flat = _flatten_dense_tensors(bucket).float()
    dist.all_reduce(flat, group=group)  # SUM: gloo has no AVG
    flat.div_(size)
    for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
        g.copy_(reduced)
