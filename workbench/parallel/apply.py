"""The one place that applies the strategies, in a fixed order, as one linear function.

Order (torchtitan's parallelize_llama): build on meta -> pipeline split -> per stage: tensor
parallel -> activation checkpointing -> FSDP2 for zero 2/3 (still on meta, with CPU offload) ->
materialize -> fp32 master (ours: Parallelism.needs_master, in files for nvme) and the low dtype ->
tied embeddings across stages -> dp gradient sync (DDP, which needs real tensors in their final
dtype to broadcast, or our all-reduce after the last backward). Each step lives in its own file
with one `apply_*` function; what each step does is read from `Parallelism`, never re-derived.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from workbench.parallel.activation_checkpointing import apply_activation_checkpointing
from workbench.parallel.ddp import apply_ddp
from workbench.parallel.master import MasterOptimizer
from workbench.parallel.materialize import materialize
from workbench.parallel.offload import build_file_store, cpu_offload_policy
from workbench.parallel.precision import apply_precision, mixed_precision_policy
from workbench.parallel.tied import is_tied
from workbench.parallel.zero import apply_fsdp, build_master
from workbench.parallelism import Parallelism


def _no_op() -> None:
    return None


@dataclass
class Parallelized:
    """What the training loop needs from the parallelized model."""

    model: nn.Module  # call this for forward (pp=1)
    modules: list[nn.Module]  # the modules whose parameters this rank holds (for the optimizer)
    # Wraps each micro-batch's forward+backward but the step's last: DDP's no_sync; zero=2's kept weights.
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


def parallelize(model: nn.Module, mesh: DeviceMesh | None, par: Parallelism, *, device: torch.device,
                seed: int) -> Parallelized:
    """Apply `par`'s strategies to a meta-device `model` and materialize it on `device`.

    Args:
        model: the full model on the meta device.
        mesh: the ("pp", "dp", "tp") mesh, or None for a single process.
        par: the layout and precision's Parallelism (Parallelism.from_spec).
        device: where this rank's parameters live (host memory instead with offload=cpu).
        seed: initialization seed (the same weights under every layout).
    """
    out = Parallelized(model, [model])
    dp_mesh = mesh["dp"] if mesh is not None else None
    tied = par.pp > 1 and is_tied(model)
    if par.pp > 1:
        from workbench.parallel.pp import apply_pp

        out.modules, out.stage_indices, out.num_stages = apply_pp(model, mesh["pp"], chunks=par.chunks)
        out.model = out.modules[0]
    if par.tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        from workbench.parallel.tp import apply_tp

        for m in out.modules:
            apply_tp(m, mesh["tp"], sequence_parallel=par.sequence_parallel, backward_rows=par.sp_backward_rows)
        out.loss_context = loss_parallel
    for m in out.modules:
        apply_activation_checkpointing(m, par.activation_checkpointing, every=par.checkpoint_every)
    init_device = _apply_fsdp(out, dp_mesh, par, device)
    if par.keeps_gathered:
        out.no_sync = functools.partial(_keep_gathered, out.modules)
    for m in out.modules:
        materialize(m, init_device, seed=seed)
    if par.fsdp and par.offload == "nvme":  # ZeRO-Infinity: FSDP2's shards and the moments in files
        from workbench.parallel.offload import attach_nvme

        if len(out.modules) != 1:
            raise NotImplementedError("offload=nvme with zero 2/3 under pipeline parallelism")
        out.master = attach_nvme(out.modules[0], par.nvme_path, reshard_after_forward=par.reshard_after_forward,
                                 mixed=par.params_are_master)
    if par.needs_master:
        store = build_file_store(par.nvme_path) if par.offload == "nvme" else None
        out.master = build_master(nn.ModuleList(out.modules), dp_mesh, sharded=par.master_sharded, make_store=store)
        for m in out.modules:
            apply_precision(m, par.dtype)
    out.params_are_master = par.params_are_master
    tied_sync = _tie(out, mesh) if tied else None
    if par.grad_sync == "ddp":
        ddp = apply_ddp(model, mesh, bucket_mb=par.bucket_mb)
        out.model, out.modules, out.no_sync = ddp, [ddp.module], ddp.no_sync
    out.finish_grads = functools.partial(_finish_grads, out.modules, par, mesh, tied_sync)
    return out


def _apply_fsdp(out: Parallelized, dp_mesh: DeviceMesh | None, par: Parallelism, device: torch.device) -> torch.device:
    """zero 2/3: FSDP2 over the dp axis on each stage module (sharding TP's shards further: 2-D
    DTensors), with CPUOffloadPolicy for offload=cpu. Returns where to materialize."""
    if not par.fsdp:
        return device
    offload = None
    if par.init_on_host:
        offload, note = cpu_offload_policy(device)
        out.notes += [note] if note else []
    host = par.init_on_host or par.offload == "nvme"
    if par.offload == "nvme":  # the shards live in (mapped) files in host memory; FSDP2 copies them to the device
        from torch.distributed.fsdp import CPUOffloadPolicy

        offload = CPUOffloadPolicy(pin_memory=False)
    for m in out.modules:
        apply_fsdp(m, dp_mesh, reshard_after_forward=par.reshard_after_forward,
                   mp_policy=mixed_precision_policy(par.dtype), offload_policy=offload, unit_mb=par.fsdp_unit_mb)
    # CPUOffloadPolicy wants the shards in host memory.
    return torch.device("cpu") if host else device


@contextlib.contextmanager
def _keep_gathered(modules: list[nn.Module]):
    """zero=2 with gradient accumulation, around each micro-batch but the last: FSDP2 keeps the
    gathered weights after backward, so the next micro-batch's forward gathers nothing (the weights
    cannot change before the step). The peak stays: zero=2 holds every gathered weight from the end
    of forward into backward anyway. The gradients are still reduce-scattered every micro-batch."""
    for m in modules:
        m.set_reshard_after_backward(False)
    try:
        yield
    finally:
        for m in modules:
            m.set_reshard_after_backward(True)


def _tie(out: Parallelized, mesh: DeviceMesh):
    """pp > 1 with tied embeddings: the (materialized) embedding and its last-stage copy, and the
    group that sums their gradients (collective: every rank builds it)."""
    from workbench.parallel.tied import build_tied_group, tied_params

    params = tied_params(out.modules, out.stage_indices, out.num_stages)
    out.tied_copies = [m.head.weight for m, i in zip(out.modules, out.stage_indices) if i == out.num_stages - 1]
    return params, build_tied_group(mesh)


def _finish_grads(modules: list[nn.Module], par: Parallelism, mesh: DeviceMesh | None, tied=None) -> None:
    """After the step's last backward: TP gradients laid out like their parameters, a tied
    embedding's two gradients summed (first and last stage), then the dp average where no
    wrapper does it (Parallelism.grad_sync: DDP and FSDP2 reduce by themselves)."""
    from workbench.parallel.grad_sync import all_reduce_grads
    from workbench.parallel.tp import align_grad_placements

    if par.tp > 1:
        align_grad_placements(modules)
    if tied is not None and tied[1] is not None:
        from workbench.parallel.tied import sync_tied_grads

        sync_tied_grads(*tied)
    if par.grad_sync == "all-reduce":
        all_reduce_grads(modules, mesh.get_group("dp"), bucket_mb=par.bucket_mb)
