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
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel.style import ParallelStyle

from workbench.parallel.local import shard_parameters

SEQ_DIM = 1  # activations are (B, T, C)


# The collectives are c10d's in-place ones on plain tensors: the functional collectives return a
# Python tensor subclass (AsyncCollectiveTensor) whose every later op dispatches through Python,
# the largest cost after waiting in a profile of a sequence-parallel step of gpt-tiny.


def _gather(shard: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """(B, T/tp, C) -> (B, T, C): all-gather the sequence shards of the tp group, in rank order."""
    tp = mesh.size()
    out = shard.new_empty((tp * shard.shape[0], *shard.shape[1:]))  # the shards stacked along dim 0
    dist.all_gather_into_tensor(out, shard.contiguous(), group=mesh.get_group())
    return out.unflatten(0, (tp, shard.shape[0])).movedim(0, SEQ_DIM).flatten(SEQ_DIM, SEQ_DIM + 1)


def _reduce_scatter(full: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """(B, T, C) -> this rank's (B, T/tp, C) of the sum over the tp group."""
    tp = mesh.size()
    chunks = full.unflatten(SEQ_DIM, (tp, full.shape[SEQ_DIM] // tp)).movedim(SEQ_DIM, 0).contiguous()
    out = chunks.new_empty(chunks.shape[1:])
    dist.reduce_scatter_tensor(out, chunks.flatten(0, 1), group=mesh.get_group())
    return out


class _GatherSequence(torch.autograd.Function):
    """(B, T/tp, C) -> (B, T, C); backward reduce-scatters the summed gradient. Saves nothing.

    `cache` is shared with the column-parallel linears that take the gathered input: the first of
    them to run backward gathers the shard again and leaves it there for the others (q, k and v
    share one gather, as Megatron's fused QKV does); this backward, which runs after all of them,
    drops it."""

    @staticmethod
    def forward(ctx, shard, mesh, cache):
        ctx.mesh, ctx.cache = mesh, cache
        return _gather(shard, mesh)

    @staticmethod
    def backward(ctx, grad):
        ctx.cache.clear()
        return _reduce_scatter(grad, ctx.mesh), None, None


class _ShardSavingLinear(torch.autograd.Function):
    """y = x W^T + b for the gathered x, keeping only x's sequence shard for backward."""

    @staticmethod
    def forward(ctx, full, shard, weight, bias, mesh, cache):
        ctx.mesh, ctx.has_bias, ctx.cache = mesh, bias is not None, cache
        ctx.save_for_backward(shard, weight)
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        full = ctx.cache.get(grad.dtype)  # gathered again by a linear that shares the input
        if full is None:
            full = ctx.cache[grad.dtype] = _gather(shard, ctx.mesh).to(grad.dtype)  # what forward did not keep
        grad_full = grad @ weight.to(grad.dtype)  # (autocast may have run forward in low precision)
        grad_weight = (grad.flatten(0, -2).t() @ full.flatten(0, -2)).to(weight.dtype)
        grad_bias = grad.flatten(0, -2).sum(0).to(weight.dtype) if ctx.has_bias else None
        return grad_full, None, grad_weight, grad_bias, None, None


class GatherSequenceInput(ParallelStyle):
    """On entry to attention / the MLP: all-gather the sequence-sharded input once, and tag the
    gathered tensor with its shard so the column-parallel linears inside can save the shard."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_module, args):
            x, *rest = args
            shard = x.to_local() if isinstance(x, DTensor) else x
            cache: dict = {}
            full = _GatherSequence.apply(shard, device_mesh, cache)
            full.sequence_shard, full.sequence_cache = shard, cache
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
            return _ShardSavingLinear.apply(x, x.sequence_shard, module.weight.to_local(), bias, device_mesh,
                                            getattr(x, "sequence_cache", {}))

        module.forward = forward  # the instance's forward: parameter names stay as they are
        return module


class _ScatterSequence(torch.autograd.Function):
    """Row-parallel partial (B, T, C) -> this rank's summed (B, T/tp, C) (reduce-scatter); backward
    all-gathers the sequence. Megatron's g-bar under sequence parallelism."""

    @staticmethod
    def forward(ctx, partial, mesh):
        ctx.mesh = mesh
        return _reduce_scatter(partial, mesh)

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
