"""The one place that applies the strategies, in a fixed order.

Order (torchtitan's): build on meta -> pipeline split -> per stage: tensor parallel ->
activation checkpointing -> FSDP/ZeRO (still on meta) -> materialize -> DDP (which needs real
tensors to broadcast). Each step lives in its own file with one `apply_*` function.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from workbench.parallel.ddp import apply_ddp
from workbench.runtime.materialize import materialize


def _no_op() -> None:
    return None


@dataclass
class Parallelized:
    """What the training loop needs from the parallelized model."""

    model: nn.Module  # call this for forward (pp=1)
    modules: list[nn.Module]  # the modules whose parameters this rank holds (for the optimizer)
    no_sync: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)
    # Wrap forward+backward: loss_parallel when the head's logits are vocab-sharded (tp > 1).
    loss_context: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)
    # Called once per step after the last backward: gradient reduction no wrapper does.
    finish_grads: Callable[[], None] = field(default=_no_op)
    # pp > 1: this rank's stage modules are `modules`; their global indices and the total.
    stage_indices: list[int] = field(default_factory=list)
    num_stages: int = 1


def parallelize(model: nn.Module, mesh: DeviceMesh | None, layout, *, device: torch.device, seed: int) -> Parallelized:
    """Apply the layout's strategies to a meta-device `model` and materialize it on `device`.

    Args:
        model: the full model on the meta device.
        mesh: the ("pp", "dp", "tp") mesh, or None for a single process.
        layout: a LayoutSpec.
        device: where this rank's parameters live.
        seed: initialization seed (the same weights under every layout).
    """
    if mesh is None or (layout.tp == 1 and layout.pp == 1):
        materialize(model, device, seed=seed)
        if mesh is None or layout.dp == 1:
            return Parallelized(model, [model])
        ddp = apply_ddp(model, mesh, bucket_mb=layout.bucket_mb)
        return Parallelized(ddp, [ddp.module], no_sync=ddp.no_sync)
    return _parallelize_nd(model, mesh, layout, device=device, seed=seed)


def _parallelize_nd(model: nn.Module, mesh: DeviceMesh, layout, *, device: torch.device, seed: int) -> Parallelized:
    """tp > 1 and/or pp > 1, with or without dp."""
    from workbench.parallel.grad_sync import all_reduce_grads

    par = Parallelized(model, [model])
    if layout.pp > 1:
        from workbench.parallel.pp import apply_pp

        par.modules, par.stage_indices, par.num_stages = apply_pp(
            model, mesh["pp"], schedule=layout.pp_schedule, virtual_stages=layout.virtual_stages)
        par.model = par.modules[0]
    if layout.tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        from workbench.parallel.tp import apply_tp

        for m in par.modules:
            apply_tp(m, mesh["tp"], sequence_parallel=layout.sequence_parallel)
        par.loss_context = loss_parallel
    for m in par.modules:
        materialize(m, device, seed=seed)
    if layout.dp > 1:
        group, modules, bucket_mb = mesh.get_group("dp"), par.modules, layout.bucket_mb
        par.finish_grads = lambda: all_reduce_grads(modules, group, bucket_mb=bucket_mb)
    return par
