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


@dataclass
class Parallelized:
    """What the training loop needs from the parallelized model."""

    model: nn.Module  # call this for forward
    modules: list[nn.Module]  # the modules whose parameters this rank holds (for the optimizer)
    no_sync: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)


def parallelize(model: nn.Module, mesh: DeviceMesh | None, layout, *, device: torch.device, seed: int) -> Parallelized:
    """Apply the layout's strategies to a meta-device `model` and materialize it on `device`.

    Args:
        model: the full model on the meta device.
        mesh: the ("pp", "dp", "tp") mesh, or None for a single process.
        layout: a LayoutSpec.
        device: where this rank's parameters live.
        seed: initialization seed (the same weights under every layout).
    """
    materialize(model, device, seed=seed)
    if mesh is None or layout.dp == 1:
        return Parallelized(model, [model])
    ddp = apply_ddp(model, mesh, bucket_mb=layout.bucket_mb)
    return Parallelized(ddp, [ddp.module], no_sync=ddp.no_sync)
