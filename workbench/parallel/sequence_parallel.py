"""Megatron-style sequence parallelism for the column-parallel linears: save the sequence shard,
all-gather it again in backward (Korthikanti et al. 2022, sec. 4.2.2).

DTensor's SequenceParallel + ColwiseParallel all-gather the norm's output on entry to attention
and the MLP, and each column-parallel linear then saves that gathered (B, T, C) input for its
weight gradient: activations that sequence parallelism was meant to divide by tp. Here the
attention / MLP entry gathers once (backward: one reduce-scatter), and the column-parallel linears
save only the (B, T/tp, C) shard, all-gathering it again when backward needs the weight gradient.
The numbers are the same bit for bit; the memory is what Korthikanti et al. count.

The residual stream between those regions is a plain (B, T/tp, C) tensor, this rank's sequence
shard, not a DTensor: the norms run on it with their replicated weights as plain tensors, the
row-parallel linears reduce-scatter into it (`ScatterRowwiseParallel`), and the gradients of what
sees only the shard (norm weights and biases, the row-parallel bias, the position embedding's
slice) are partial sums over tp, completed by one all-reduce per step
(`sum_sequence_partial_grads`, from tp.align_grad_placements) where DTensor's SequenceParallel
all-reduced each of them on every micro-batch and dispatched every op of the stream in Python.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel.style import ParallelStyle

from workbench.parallel.local import shard_parameters

SEQ_DIM = 1  # activations are (B, T, C)


def _gather(shard: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_gather_single(shard.contiguous(), SEQ_DIM, mesh))


class _GatherSequence(torch.autograd.Function):
    """(B, T/tp, C) -> (B, T, C); backward reduce-scatters the summed gradient. Saves nothing."""

    @staticmethod
    def forward(ctx, shard, mesh):
        ctx.mesh = mesh
        return _gather(shard, mesh)

    @staticmethod
    def backward(ctx, grad):
        return funcol.wait_tensor(funcol.reduce_scatter_single(grad.contiguous(), "sum", SEQ_DIM, ctx.mesh)), None


class _ShardSavingLinear(torch.autograd.Function):
    """y = x W^T + b for the gathered x, keeping only x's sequence shard for backward."""

    @staticmethod
    def forward(ctx, full, shard, weight, bias, mesh):
        ctx.mesh, ctx.has_bias = mesh, bias is not None
        ctx.save_for_backward(shard, weight)
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        full = _gather(shard, ctx.mesh).to(grad.dtype)  # again: what forward did not keep
        grad_full = grad @ weight.to(grad.dtype)  # (autocast may have run forward in low precision)
        grad_weight = (grad.flatten(0, -2).t() @ full.flatten(0, -2)).to(weight.dtype)
        grad_bias = grad.flatten(0, -2).sum(0).to(weight.dtype) if ctx.has_bias else None
        return grad_full, None, grad_weight, grad_bias, None


class GatherSequenceInput(ParallelStyle):
    """On entry to attention / the MLP: all-gather the sequence-sharded input once, and tag the
    gathered tensor with its shard so the column-parallel linears inside can save the shard."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_module, args):
            x, *rest = args
            shard = x.to_local() if isinstance(x, DTensor) else x
            full = _GatherSequence.apply(shard, device_mesh)
            full.sequence_shard = shard
            return (full, *rest)

        module.register_forward_pre_hook(gather)
        return module


class ShardSavingColwiseParallel(ParallelStyle):
    """Column-parallel nn.Linear (weight and bias Shard(0), output the local Shard(-1) columns) whose
    input is the tagged gathered tensor of `GatherSequenceInput`; it saves the shard, not the input."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        shard_parameters(module, device_mesh, {"weight": Shard(0), "bias": Shard(0)})

        def forward(x):
            bias = module.bias.to_local() if module.bias is not None else None
            return _ShardSavingLinear.apply(x, x.sequence_shard, module.weight.to_local(), bias, device_mesh)

        module.forward = forward  # the instance's forward: parameter names stay as they are
        return module


class _ScatterSequence(torch.autograd.Function):
    """Row-parallel partial (B, T, C) -> this rank's summed (B, T/tp, C) (reduce-scatter); backward
    all-gathers the sequence. Megatron's g-bar under sequence parallelism."""

    @staticmethod
    def forward(ctx, partial, mesh):
        ctx.mesh = mesh
        return funcol.wait_tensor(funcol.reduce_scatter_single(partial.contiguous(), "sum", SEQ_DIM, mesh))

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.mesh), None


# The parameters a module applies to this rank's sequence shard only (the norms, the row-parallel
# linears' bias, the position embedding's slice): their gradients are partial sums over tp, which
# `sum_sequence_partial_grads` completes once per step. The names live on the module (FSDP2
# replaces the parameter objects, not the module's attributes).
PARTIAL_ATTR = "_workbench_sequence_partial"


def mark_sequence_partial(module: nn.Module, names: tuple[str, ...], mesh: DeviceMesh) -> None:
    """Record that `module`'s parameters `names` (those it has) get partial gradients over `mesh`."""
    have = tuple(n for n in names if getattr(module, n, None) is not None)
    if have:
        setattr(module, PARTIAL_ATTR, (have, mesh))


class SequenceShardedNorm(ParallelStyle):
    """A norm on this rank's sequence shard, as plain tensors: its weight (and bias) stay replicated
    plain parameters whose gradients are summed over tp once per step, where DTensor's
    SequenceParallel dispatches every norm through its sharding propagation and all-reduces its
    gradients on every micro-batch."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        mark_sequence_partial(module, ("weight", "bias"), device_mesh)
        return module


class SequenceSlice(ParallelStyle):
    """The position embedding under sequence parallel: this rank's slice of the (T, C) positions,
    to add to its sequence shard of the token embeddings. Backward leaves zeros outside the slice:
    the weight's gradient is partial over tp (summed once per step)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        mark_sequence_partial(module, ("weight",), device_mesh)

        def slice_output(_module, _args, out):
            return torch.chunk(out, device_mesh.size(), dim=0)[device_mesh.get_local_rank()]

        module.register_forward_hook(slice_output)
        return module


class ScatterRowwiseParallel(ParallelStyle):
    """Row-parallel nn.Linear under sequence parallel on local shards: weight Shard(1), bias
    Replicate (as RowwiseParallel); forward multiplies the local input columns by the local weight
    columns, reduce-scatters the partial sums into this rank's sequence shard, then adds the bias
    (whose gradient is then partial over tp: summed once per step)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        shard_parameters(module, device_mesh, {"weight": Shard(1), "bias": Replicate()})
        mark_sequence_partial(module, ("bias",), device_mesh)

        def forward(x):
            y = _ScatterSequence.apply(F.linear(x, module.weight.to_local()), device_mesh)
            return y if module.bias is None else y + module.bias.to_local().to(y.dtype)

        module.forward = forward
        return module


def sum_sequence_partial_grads(modules: list[nn.Module]) -> None:
    """Complete the partial gradients of the marked parameters: one all-reduce over tp per dtype.

    Runs after the step's last backward. Under FSDP2 the gradients are already reduce-scattered
    over dp; the tp sum of each dp shard is the dp shard of the tp sum, so the order is free.
    """
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for m in modules:
        for sub in m.modules():
            marked = getattr(sub, PARTIAL_ATTR, None)
            if marked is None:
                continue
            names, mesh = marked
            for name in names:
                grad = getattr(sub, name).grad
                if grad is not None:
                    g = grad._local_tensor if isinstance(grad, DTensor) else grad
                    buckets.setdefault((mesh.get_group(), g.dtype, g.device), []).append(g)
    for (group, _dtype, _device), grads in buckets.items():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def column_parallel_linears(block: nn.Module) -> list[str]:
    """A block's column-parallel linears: attention's q/k/v, the MLP's up (and SwiGLU's gate)."""
    names = ["attn.wq", "attn.wk", "attn.wv", "mlp.w1"]
    return names + (["mlp.w3"] if getattr(block.get_submodule("mlp"), "w3", None) is not None else [])


def megatron_sp_plan(block: nn.Module) -> dict:
    """Plan entries that replace DTensor's gather-and-save at a block's column-parallel linears."""
    plan = {"attn": GatherSequenceInput(), "mlp": GatherSequenceInput()}
    return plan | {name: ShardSavingColwiseParallel() for name in column_parallel_linears(block)}
