"""The residual stream's full rows beside its sequence shard, under sequence parallel: each rank
computes the next region's input itself instead of all-gathering it (sequence_parallel.py says why)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from workbench.parallel.sequence_parallel import (
    REGIONS_ATTR,
    SEQ_DIM,
    SequenceRegion,
    _gather,
    _same,
    _take,
)

# The stream's full rows. Autograd sees the residual stream as this rank's (B, T/tp, C) shard, as in
# Megatron-LM: the norms, the saved tensors and backward are exactly theirs. Beside it, without
# autograd, each rank carries the stream's full (B, T, C) rows: the row-parallel outputs are
# all-reduced (not reduce-scattered), the residual adds and the norms are computed on the full rows
# too (row-wise, so each row equals what its owner computes on its shard), and the next region's
# input is then at hand instead of all-gathered. Per block and micro-batch that is 2 collectives in
# forward (Megatron: 2 reduce-scatters + 2 all-gathers) with the same bytes on the wire; on gloo each
# collective costs a round trip, which made sequence parallel 1.7x plain TP's step on gpt-tiny.
# A block whose input has no full rows (the first after the embedding or a pipeline stage's edge,
# or a recomputed one) all-gathers its input once.


class _Stream:
    """The full rows of a stage's last block output (the tensor and its rows), for the next block or
    the final norm, or of the embedding (token rows, position rows or None) for the first block;
    taken by their reader."""

    __slots__ = ("pending", "embedding")

    def __init__(self):
        self.pending = None
        self.embedding = None

    def rows_for(self, x: torch.Tensor):
        pending = _take(self, "pending")
        return pending[1] if pending is not None and _same(pending[0], x) else None


class _SliceSequence(torch.autograd.Function):
    """(B, T, C) replicated -> this rank's (B, T/tp, C); backward all-gathers the shards' gradients
    (the replicated input's gradient, complete on every rank)."""

    @staticmethod
    def forward(ctx, full, mesh):
        ctx.mesh = mesh
        return full.chunk(mesh.size(), dim=SEQ_DIM)[mesh.get_local_rank()].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.mesh), None


def _attach_embedding(model: nn.Module, mesh: DeviceMesh, stream: _Stream) -> None:
    """The vocab-parallel embedding all-reduces its partial lookups (tp.py: Replicate output, one
    collective where reduce-scatter and the first block's all-gather are two); this rank keeps its
    sequence shard for autograd, and the token (and position) rows for the first block's full rows."""

    def token_rows(_module, _args, out):
        stream.embedding = (out.detach(), None)
        return _SliceSequence.apply(out, mesh)

    def position_rows(module, args, _out):
        if stream.embedding is not None:
            with torch.no_grad():
                stream.embedding = (stream.embedding[0], F.embedding(args[0], module.weight))

    model.tok_emb.register_forward_hook(token_rows)
    if getattr(model, "pos_emb", None) is not None:
        model.pos_emb.register_forward_hook(position_rows)


def _embedding_rows(stream: _Stream, x: torch.Tensor, tp: int):
    """The first block's input rows from the embedding's (tokens + positions, added as GPT.forward adds them)."""
    pending = _take(stream, "embedding")
    if pending is None or pending[0].shape[:2] != (x.shape[0], x.shape[1] * tp):
        return None
    tokens, positions = pending
    with torch.no_grad():
        return tokens if positions is None else tokens + positions


def _norm_rows_hook(full_input, region: SequenceRegion):
    """A norm's forward hook: compute its output on the full rows too (`full_input(x)` gives them,
    or None), for the region it feeds."""

    def hook(module, args, out):
        rows = full_input(args[0])
        if rows is not None:
            with torch.no_grad():
                region.input_full = (out, module.forward(rows.to(args[0].dtype)))  # the instance's forward: no hooks
    return hook


def attach_sequence_stream(model: nn.Module, mesh: DeviceMesh, head: SequenceRegion | None) -> None:
    """Carry the residual stream's full rows beside its shard through `model`'s blocks (planned by
    `megatron_sp_plan`) to the final norm, whose output's full rows go to the head's `head` region."""
    stream = _Stream()
    if getattr(model, "tok_emb", None) is not None:
        _attach_embedding(model, mesh, stream)
    blocks = list(model.blocks.values())
    for i, block in enumerate(blocks):
        _attach_block(block, mesh, stream, emits=i < len(blocks) - 1 or model.norm is not None)
    if model.norm is not None and head is not None:
        model.norm.register_forward_hook(_norm_rows_hook(stream.rows_for, head))


def _attach_block(block: nn.Module, mesh: DeviceMesh, stream: _Stream, emits: bool) -> None:
    attn, mlp = getattr(block, REGIONS_ATTR)
    rows: dict = {}  # within one call of the block: "x" (its input's full rows), then "h" (after attention)

    def enter(_module, args):
        x = args[0]
        full = stream.rows_for(x)
        if full is None:
            full = _embedding_rows(stream, x, mesh.size())
        if full is None:
            with torch.no_grad():
                full = _gather(x, mesh)
        rows["x"] = full

    def after_attention(_module, _args, _out):
        x, y = rows.pop("x", None), _take(attn, "output_full")
        if x is not None and y is not None:
            with torch.no_grad():
                rows["h"] = x + y

    def leave(_module, _args, out):
        h, y = rows.pop("h", None), _take(mlp, "output_full")
        if emits and h is not None and y is not None:
            with torch.no_grad():
                stream.pending = (out, h + y)

    block.register_forward_pre_hook(enter)
    block.get_submodule("attn_norm").register_forward_hook(_norm_rows_hook(lambda _x: rows.get("x"), attn))
    block.get_submodule("attn").register_forward_hook(after_attention)
    block.get_submodule("mlp_norm").register_forward_hook(_norm_rows_hook(lambda _x: rows.get("h"), mlp))
    block.register_forward_hook(leave)
