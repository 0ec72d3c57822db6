"""Megatron-style sequence parallelism for the column-parallel linears: save the sequence shard,
all-gather it again in backward (Korthikanti et al. 2022, sec. 4.2.2).

DTensor's SequenceParallel + ColwiseParallel all-gather the norm's output on entry to attention
and the MLP, and each column-parallel linear then saves that gathered (B, T, C) input for its
weight gradient: activations that sequence parallelism was meant to divide by tp. Here the
attention / MLP entry gathers once (backward: one reduce-scatter), and the column-parallel linears
save only the (B, T/tp, C) shard, all-gathering it again when backward needs the weight gradient.
The numbers are the same bit for bit; the memory is what Korthikanti et al. count.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
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


def column_parallel_linears(block: nn.Module) -> list[str]:
    """A block's column-parallel linears: attention's q/k/v, the MLP's up (and SwiGLU's gate)."""
    names = ["attn.wq", "attn.wk", "attn.wv", "mlp.w1"]
    return names + (["mlp.w3"] if getattr(block.get_submodule("mlp"), "w3", None) is not None else [])


def megatron_sp_plan(block: nn.Module) -> dict:
    """Plan entries that replace DTensor's gather-and-save at a block's column-parallel linears."""
    plan = {"attn": GatherSequenceInput(), "mlp": GatherSequenceInput()}
    return plan | {name: ShardSavingColwiseParallel() for name in column_parallel_linears(block)}
