"""Tensor parallel (Megatron-style) on a 1-D tp mesh with DTensor `parallelize_module`.

Attention is split by heads (wq/wk/wv column-wise, wo row-wise), the MLP column-then-row, the
embedding by vocabulary rows and the head by vocabulary columns (a tied head keeps using the
embedding's one parameter, sharded over the vocabulary for both uses; the loss then runs on the
vocab-sharded logits under `loss_parallel`). Sequence parallel additionally keeps the residual
stream, the norms and the embedding output sharded along the sequence between the TP regions.
"""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from workbench.parallel.sequence_parallel import megatron_sp_plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> nn.Module:
    """Shard a GPT (or one pipeline stage of it) over `tp_mesh`, in place, on the meta device.

    The head's logits stay sharded over the vocabulary (a DTensor, Shard(-1)); compute the loss
    inside `torch.distributed.tensor.parallel.loss_parallel()` (forward and backward), which
    gives the exact mean cross-entropy without gathering the logits.

    Args:
        model: a workbench GPT whose `tok_emb`/`pos_emb`/`norm`/`head` may be None (a stage).
        tp_mesh: the 1-D tensor-parallel mesh.
        sequence_parallel: also shard norms and the residual stream along the sequence (dim 1).
    Returns:
        The same module, with DTensor parameters.
    """
    sp = sequence_parallel
    # Activations between blocks: seq-sharded local tensors with SP, full replicas without.
    stream = Shard(1) if sp else Replicate()
    plan: dict = {}
    if model.tok_emb is not None:
        # Vocab-parallel embedding: each rank looks up its rows, partial sums are reduced
        # (all-reduce, or reduce-scatter straight into the sequence shards with SP).
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if sp and getattr(model, "pos_emb", None) is not None:
        # Positions are replicated; keep this rank's sequence slice so it adds to the
        # seq-sharded token embeddings. Backward all-gathers, so the weight's grad is full.
        plan["pos_emb"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
    if model.norm is not None and sp:
        plan["norm"] = SequenceParallel()
    if model.head is not None:
        plan["head"] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
    # A tied head shares the embedding's (vocab, hidden) weight: both plans shard it Shard(0)
    # over the vocabulary, but each would make its own DTensor parameter; share the embedding's.
    tied = model.tok_emb is not None and model.head is not None and model.head.weight is model.tok_emb.weight
    if plan:
        parallelize_module(model, tp_mesh, plan)
    if tied:
        model.head.weight = model.tok_emb.weight
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, _block_plan(block, sp))
    return model


def _block_plan(block: nn.Module, sp: bool) -> dict:
    out = Shard(1) if sp else Replicate()
    plan = {
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=out),
        "mlp.w1": ColwiseParallel(),
        "mlp.w2": RowwiseParallel(output_layouts=out),
    }
    if block.mlp.w3 is not None:
        plan["mlp.w3"] = ColwiseParallel()
    if not sp:
        # Megatron's f: attention / the MLP take their input as one replicated DTensor, so the
        # column-parallel linears' partial input gradients add up locally and one all-reduce in
        # backward sums them over tp (each linear would otherwise all-reduce its own: 3 in attention).
        plan.update({
            "attn": PrepareModuleInput(input_layouts=(Replicate(), None), desired_input_layouts=(Replicate(), None)),
            "mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
        })
    if sp:
        plan.update({
            "attn_norm": SequenceParallel(),
            "mlp_norm": SequenceParallel(),
            # Attention and MLP need the whole sequence: all-gather on entry (reduce-scatter
            # in backward); their row-wise outputs reduce-scatter back to sequence shards.
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
        plan.update(megatron_sp_plan(block))  # the column-parallel linears save the shard, not the gather
    return plan


def align_grad_placements(modules: list[nn.Module]) -> None:
    """Give every DTensor gradient its parameter's placements.

    The vocab-parallel embedding's weight gradient comes out of backward with another placement
    than its Shard(0) weight (a full-vocabulary local tensor); torch.optim copes through DTensor
    dispatch, but code that works on local shards (gradient all-reduce, a flat fp32 master,
    memory accounting) needs the gradient laid out like the parameter.
    """
    from torch.distributed.tensor import DTensor

    for m in modules:
        for p in m.parameters():
            g = p.grad
            if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
                p.grad = g.redistribute(p.device_mesh, p.placements)
