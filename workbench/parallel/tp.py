"""Tensor parallel (Megatron-style) on a 1-D tp mesh with DTensor `parallelize_module`.

Attention is split by heads (wq/wk/wv column-wise, wo row-wise), the MLP column-then-row, the
embedding by vocabulary rows and the head by vocabulary columns (a tied head keeps using the
embedding's one parameter, sharded over the vocabulary for both uses; the loss then runs on the
vocab-sharded logits under `loss_parallel`). Sequence parallel additionally keeps the residual
stream, the norms and the embedding output sharded along the sequence between the TP regions.

Inside the blocks the parameters are DTensors (checkpoints, FSDP2, the optimizer and clipping see
shards), but the arithmetic runs on their local shards, as Megatron-LM writes it: attention and the
MLP take their input through `f` (identity forward, all-reduce of the input gradient backward), the
column-parallel linears multiply local tensors, the row-parallel ones all-reduce their partial
output through `g`. DTensor's own styles would dispatch every op of a block through its sharding
propagation in Python: 1.29x the CPU per step on gpt-mini, tp=2 (bench/bench_tp.py). Sequence
parallel keeps the residual stream as local sequence shards the same way (sequence_parallel.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from workbench.parallel.local import shard_parameters
from workbench.parallel.sequence_parallel import (
    GatherSequenceHead,
    SequenceRegion,
    SequenceShardedNorm,
    SequenceSlice,
    column_parallel_linears,
    megatron_sp_plan,
    sum_sequence_partial_grads,
)
from workbench.parallel.sequence_stream import attach_sequence_stream


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, backward_rows: bool = False) -> nn.Module:
    """Shard a GPT (or one pipeline stage of it) over `tp_mesh`, in place, on the meta device.

    The head's logits stay sharded over the vocabulary (a DTensor, Shard(-1)); compute the loss
    inside `torch.distributed.tensor.parallel.loss_parallel()` (forward and backward), which
    gives the exact mean cross-entropy without gathering the logits.

    Args:
        model: a workbench GPT whose `tok_emb`/`pos_emb`/`norm`/`head` may be None (a stage).
        tp_mesh: the 1-D tensor-parallel mesh.
        sequence_parallel: also shard norms and the residual stream along the sequence (dim 1).
        backward_rows: with sequence_parallel, carry full rows through backward too (gloo only;
            sequence_parallel.BackwardRows): the caller says the regions' calls reach their backward
            whole (one pipeline stage, no recompute, no FSDP).
    Returns:
        The same module, with DTensor parameters.
    """
    sp = sequence_parallel
    plan: dict = {}
    if model.tok_emb is not None:
        # Vocab-parallel embedding: each rank looks up its rows, partial sums are all-reduced (with
        # SP each rank then keeps its sequence shard, and the full rows beside it: sequence_parallel.py).
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if sp and getattr(model, "pos_emb", None) is not None:
        # Positions are replicated; keep this rank's sequence slice so it adds to the
        # seq-sharded token embeddings (its gradient is partial over tp, summed once per step).
        plan["pos_emb"] = SequenceSlice()
    if model.norm is not None and sp:
        plan["norm"] = SequenceShardedNorm()
    head = SequenceRegion() if sp else None  # the final norm's full rows, for the head (attach_sequence_stream)
    if model.head is not None:
        plan["head"] = GatherSequenceHead(head) if sp else ColwiseParallel(output_layouts=Shard(-1),
                                                                           use_local_output=False)
    # A tied head shares the embedding's (vocab, hidden) weight: both plans shard it Shard(0)
    # over the vocabulary, but each would make its own DTensor parameter; share the embedding's.
    tied = model.tok_emb is not None and model.head is not None and model.head.weight is model.tok_emb.weight
    if plan:
        parallelize_module(model, tp_mesh, plan)
    if tied:
        model.head.weight = model.tok_emb.weight
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, _block_plan(block, sp))
    if sp:
        attach_sequence_stream(model, tp_mesh, head, backward_rows=backward_rows)
    return model


def _block_plan(block: nn.Module, sp: bool) -> dict:
    if not sp:
        plan = {"attn": CopyToTensorParallel(), "mlp": CopyToTensorParallel(),
                "attn.wo": LocalRowwiseParallel(), "mlp.w2": LocalRowwiseParallel()}
        plan.update({name: LocalColwiseParallel() for name in column_parallel_linears(block)})
        return plan
    # Sequence parallel, on local shards like the plan above: the residual stream is this rank's
    # (B, T/tp, C) plain tensor for autograd; the norms work on it with replicated plain weights;
    # attention and the MLP take the full sequence on entry (reduce-scatter in backward), their
    # column-parallel linears save only the shard, and the row-parallel outputs are summed back into
    # the shard, with the full rows kept beside it so the next entry needs no all-gather
    # (sequence_parallel.py). The gradients of what sees only a shard (norms, row-parallel bias)
    # are partial over tp: summed in one all-reduce per step (align_grad_placements).
    return megatron_sp_plan(block)


def _all_reduce(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    out = t.clone(memory_format=torch.contiguous_format)  # autograd's tensors are not ours to change
    dist.all_reduce(out, group=mesh.get_group())
    return out


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity forward; backward sums the partial input gradients over tp."""

    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.mesh), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: forward sums the row-parallel partial outputs over tp; identity backward."""

    @staticmethod
    def forward(ctx, x, mesh):
        return _all_reduce(x, mesh)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class CopyToTensorParallel(ParallelStyle):
    """On entry to attention / the MLP: the input through `f`, so the column-parallel linears that
    share it leave one partial input gradient, all-reduced once (Megatron's count: 2 per block)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def copy(_module, args):
            x, *rest = args
            return (_CopyToTensorParallel.apply(x, device_mesh), *rest)

        module.register_forward_pre_hook(copy)
        return module


class LocalColwiseParallel(ParallelStyle):
    """Column-parallel nn.Linear: weight and bias Shard(0) DTensors as in ColwiseParallel; forward
    multiplies the full input by the local rows, giving this rank's output columns."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        shard_parameters(module, device_mesh, {"weight": Shard(0), "bias": Shard(0)})

        def forward(x):
            bias = module.bias.to_local() if module.bias is not None else None
            return F.linear(x, module.weight.to_local(), bias)

        module.forward = forward  # the instance's forward: parameter names stay as they are
        return module


class LocalRowwiseParallel(ParallelStyle):
    """Row-parallel nn.Linear: weight Shard(1), bias Replicate as in RowwiseParallel; forward
    multiplies the local input columns by the local weight columns and sums over tp (`g`), then
    adds the bias once."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        shard_parameters(module, device_mesh, {"weight": Shard(1), "bias": Replicate()})

        def forward(x):
            y = _ReduceFromTensorParallel.apply(F.linear(x, module.weight.to_local()), device_mesh)
            return y if module.bias is None else y + module.bias.to_local().to(y.dtype)

        module.forward = forward
        return module


def align_grad_placements(modules: list[nn.Module]) -> None:
    """Give every DTensor gradient its parameter's placements, and (sequence parallel) sum the
    gradients that are partial over tp (sequence_parallel.sum_sequence_partial_grads).

    The vocab-parallel embedding's weight gradient comes out of backward with another placement
    than its Shard(0) weight (a full-vocabulary local tensor); torch.optim copes through DTensor
    dispatch, but code that works on local shards (gradient all-reduce, a flat fp32 master,
    memory accounting) needs the gradient laid out like the parameter.
    """
    from torch.distributed.tensor import DTensor

    sum_sequence_partial_grads(modules)
    for m in modules:
        for p in m.parameters():
            g = p.grad
            if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
                p.grad = g.redistribute(p.device_mesh, p.placements)
