"""The one place that applies the strategies, in a fixed order.

Order (torchtitan's): build on meta -> pipeline split -> per stage: tensor parallel ->
activation checkpointing -> FSDP/ZeRO-2/3 (still on meta) -> materialize -> fp32 master
(zero 0/1 with mixed precision, zero=1, nvme) -> cast to the low dtype -> DDP (which needs real
tensors to broadcast, in their final dtype). Each step lives in its own file with one `apply_*`
function.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from workbench.parallel.checkpointing import apply_activation_checkpointing
from workbench.parallel.ddp import apply_ddp
from workbench.parallel.master import MasterOptimizer
from workbench.parallel.offload import build_file_store, cpu_offload_policy
from workbench.parallel.precision import apply_precision, mixed_precision_policy
from workbench.parallel.tied import is_tied
from workbench.parallel.zero import apply_zero, build_master
from workbench.runtime.materialize import materialize


def _no_op() -> None:
    return None


@dataclass
class Parallelized:
    """What the training loop needs from the parallelized model."""

    model: nn.Module  # call this for forward (pp=1)
    modules: list[nn.Module]  # the modules whose parameters this rank holds (for the optimizer)
    no_sync: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)
    master: MasterOptimizer | None = None  # the fp32 master when the parameters are not it
    params_are_master: bool = False  # FSDP2 mixed precision: the sharded fp32 parameters are the master
    notes: list[str] = field(default_factory=list)  # plain statements for the run's log (e.g. no-op offload)
    # Wrap forward+backward: loss_parallel when the head's logits are vocab-sharded (tp > 1).
    loss_context: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)
    # Called once per step after the last backward: gradient reduction no wrapper does.
    finish_grads: Callable[[], None] = field(default=_no_op)
    # pp > 1: this rank's stage modules are `modules`; their global indices and the total.
    stage_indices: list[int] = field(default_factory=list)
    num_stages: int = 1
    # pp > 1 with tied embeddings: the last stage's copy of the embedding weight (counted once).
    tied_copies: list[nn.Parameter] = field(default_factory=list)


def parallelize(model: nn.Module, mesh: DeviceMesh | None, layout, *, device: torch.device, seed: int,
                dtype: str = "fp32") -> Parallelized:
    """Apply the layout's strategies to a meta-device `model` and materialize it on `device`.

    Args:
        model: the full model on the meta device.
        mesh: the ("pp", "dp", "tp") mesh, or None for a single process.
        layout: a LayoutSpec.
        device: where this rank's parameters live.
        seed: initialization seed (the same weights under every layout).
        dtype: precision.dtype (fp32 | bf16 | fp16).
    """
    if mesh is not None and (layout.tp > 1 or layout.pp > 1):
        return _parallelize_nd(model, mesh, layout, device=device, seed=seed, dtype=dtype)
    apply_activation_checkpointing(model, layout.activation_checkpointing, every=layout.checkpoint_every)
    dp_mesh = mesh["dp"] if mesh is not None else None
    notes: list[str] = []
    if layout.zero >= 2:
        offload, init_device = None, device
        if layout.offload == "cpu":
            offload, note = cpu_offload_policy(device)
            init_device = torch.device("cpu")  # CPUOffloadPolicy wants the shards in host memory
            notes += [note] if note else []
        apply_zero(model, dp_mesh, stage=layout.zero, mp_policy=mixed_precision_policy(dtype), offload_policy=offload)
        materialize(model, init_device, seed=seed)
        return Parallelized(model, [model], params_are_master=(dtype != "fp32"), notes=notes)

    materialize(model, device, seed=seed)
    master = None
    if dtype != "fp32" or layout.zero == 1 or layout.offload == "nvme":
        store = build_file_store(layout.nvme_path) if layout.offload == "nvme" else None
        master = build_master(model, dp_mesh, stage=layout.zero, make_store=store)
        apply_precision(model, dtype)
    if mesh is None or layout.dp == 1:
        return Parallelized(model, [model], master=master, notes=notes)
    ddp = apply_ddp(model, mesh, bucket_mb=layout.bucket_mb)
    return Parallelized(ddp, [ddp.module], no_sync=ddp.no_sync, master=master, notes=notes)


def _parallelize_nd(model: nn.Module, mesh: DeviceMesh, layout, *, device: torch.device, seed: int,
                    dtype: str) -> Parallelized:
    """tp > 1 and/or pp > 1, with or without dp: the same steps per stage module."""
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
    init_device, offload = device, None
    if layout.zero >= 2 and layout.offload == "cpu":
        offload, note = cpu_offload_policy(device)
        init_device = torch.device("cpu")  # CPUOffloadPolicy wants the shards in host memory
        par.notes += [note] if note else []
    for m in par.modules:
        apply_activation_checkpointing(m, layout.activation_checkpointing, every=layout.checkpoint_every)
        # zero 2/3: FSDP2 over the dp axis, sharding TP's shards further (2-D DTensors).
        apply_zero(m, mesh["dp"], stage=layout.zero, mp_policy=mixed_precision_policy(dtype), offload_policy=offload)
    for m in par.modules:
        materialize(m, init_device, seed=seed)
    par.params_are_master = layout.zero >= 2 and dtype != "fp32"
    if layout.zero < 2 and (dtype != "fp32" or layout.zero == 1 or layout.offload == "nvme"):
        store = build_file_store(layout.nvme_path) if layout.offload == "nvme" else None
        par.master = build_master(nn.ModuleList(par.modules), mesh["dp"], stage=layout.zero, make_store=store)
        for m in par.modules:
            apply_precision(m, dtype)
    tied = None
    if layout.pp > 1 and is_tied(model):
        from workbench.parallel.tied import build_tied_group, tied_params

        tied = tied_params(par.modules, par.stage_indices, par.num_stages), build_tied_group(mesh)
        par.tied_copies = [m.head.weight for m, i in zip(par.modules, par.stage_indices)
                           if i == par.num_stages - 1]
    par.finish_grads = functools.partial(_finish_grads, par.modules, layout, mesh, tied)
    return par


def _finish_grads(modules: list[nn.Module], layout, mesh: DeviceMesh, tied=None) -> None:
    """After the step's last backward: TP gradients laid out like their parameters, a tied
    embedding's two gradients summed (first and last stage), then the dp average where no
    wrapper does it (FSDP2 reduce-scatters by itself for zero 2/3)."""
    from workbench.parallel.grad_sync import all_reduce_grads
    from workbench.parallel.tp import align_grad_placements

    if layout.tp > 1:
        align_grad_placements(modules)
    if tied is not None and tied[1] is not None:
        from workbench.parallel.tied import sync_tied_grads

        sync_tied_grads(*tied)
    if layout.dp > 1 and layout.zero < 2:
        all_reduce_grads(modules, mesh.get_group("dp"), bucket_mb=layout.bucket_mb)
