"""The residual stream's full rows beside its sequence shard, under sequence parallel: each rank
computes the next region's input itself instead of all-gathering it (sequence_parallel.py says why)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from workbench.parallel.sequence_parallel import (
    REGIONS_ATTR,
    SEQ_DIM,
    BackwardRows,
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
# or a recomputed one) all-gathers its input once. With `backward_rows`, each full-rows value also
# carries the BackwardRows of the call that produced it, which backward links (sequence_parallel.py).


class _Stream:
    """The full rows of a stage's last block output (the tensor, its rows, the BackwardRows of the
    region that produced them or None), for the next block or the final norm, or of the embedding
    (token rows, position rows or None, its BackwardRows or None) for the first block; taken by
    their reader."""

    __slots__ = ("pending", "embedding", "backward_rows")

    def __init__(self, backward_rows: bool):
        self.pending = None
        self.embedding = None
        self.backward_rows = backward_rows

    def rows_for(self, x: torch.Tensor):
        """(full rows, their BackwardRows or None) of `x`, or None."""
        pending = _take(self, "pending")
        return pending[1:] if pending is not None and _same(pending[0], x) else None


class _SliceSequence(torch.autograd.Function):
    """(B, T, C) replicated -> this rank's (B, T/tp, C); backward all-gathers the shards' gradients
    (the replicated input's gradient, complete on every rank), unless the first block's entry
    backward handed over their full rows (`link`, BackwardRows)."""

    @staticmethod
    def forward(ctx, full, mesh, link=None):
        ctx.mesh, ctx.link = mesh, link
        return full.chunk(mesh.size(), dim=SEQ_DIM)[mesh.get_local_rank()].contiguous()

    @staticmethod
    def backward(ctx, grad):
        given = ctx.link.given if ctx.link is not None else None
        if given is not None and given[0].dtype == grad.dtype:
            ctx.link.given = None
            return given[0], None, None
        return _gather(grad, ctx.mesh), None, None


def _attach_embedding(model: nn.Module, mesh: DeviceMesh, stream: _Stream) -> None:
    """The vocab-parallel embedding all-reduces its partial lookups (tp.py: Replicate output, one
    collective where reduce-scatter and the first block's all-gather are two); this rank keeps its
    sequence shard for autograd, and the token (and position) rows for the first block's full rows."""

    def token_rows(_module, _args, out):
        link = BackwardRows() if stream.backward_rows else None
        stream.embedding = (out.detach(), None, link)
        return _SliceSequence.apply(out, mesh, link)

    def position_rows(module, args, _out):
        if stream.embedding is not None:
            with torch.no_grad():
                tokens, _, link = stream.embedding
                stream.embedding = (tokens, F.embedding(args[0], module.weight), link)

    model.tok_emb.register_forward_hook(token_rows)
    if getattr(model, "pos_emb", None) is not None:
        model.pos_emb.register_forward_hook(position_rows)


def _embedding_rows(stream: _Stream, x: torch.Tensor, tp: int):
    """(the first block's input rows from the embedding's: tokens + positions, added as GPT.forward
    adds them; the embedding's BackwardRows), or None."""
    pending = _take(stream, "embedding")
    if pending is None or pending[0].shape[:2] != (x.shape[0], x.shape[1] * tp):
        return None
    tokens, positions, link = pending
    with torch.no_grad():
        return (tokens if positions is None else tokens + positions), link


def _norm_rows_hook(full_input, region: SequenceRegion, backward_rows: bool = False, made=None):
    """A norm's forward hook: compute its output on the full rows too (`full_input(x)` gives them and
    the BackwardRows of their producer, or None), for the region it feeds; with `backward_rows`, this
    call's BackwardRows for the region too (also passed to `made`)."""

    def hook(module, args, out):
        got = full_input(args[0])
        if got is not None:
            rows, prev = got
            with torch.no_grad():
                region.input_full = (out, module.forward(rows.to(args[0].dtype)))  # the instance's forward: no hooks
            if backward_rows:
                region.backward = BackwardRows(module, args[0], prev)
                if made is not None:
                    made(region.backward)
    return hook


def attach_sequence_stream(model: nn.Module, mesh: DeviceMesh, head: SequenceRegion | None,
                           backward_rows: bool = False) -> None:
    """Carry the residual stream's full rows beside its shard through `model`'s blocks (planned by
    `megatron_sp_plan`) to the final norm, whose output's full rows go to the head's `head` region;
    with `backward_rows` (gloo, one stage, no recompute, no FSDP) backward's too (BackwardRows)."""
    stream = _Stream(backward_rows and dist.get_backend(mesh.get_group()) == "gloo")
    if getattr(model, "tok_emb", None) is not None:
        _attach_embedding(model, mesh, stream)
    blocks = list(model.blocks.values())
    for i, block in enumerate(blocks):
        _attach_block(block, mesh, stream, emits=i < len(blocks) - 1 or model.norm is not None)
    if model.norm is not None and head is not None:
        model.norm.register_forward_hook(_norm_rows_hook(stream.rows_for, head))


def _attach_block(block: nn.Module, mesh: DeviceMesh, stream: _Stream, emits: bool) -> None:
    attn, mlp = getattr(block, REGIONS_ATTR)
    # within one call of the block: "x" (its input's full rows and their producer's BackwardRows),
    # then "h" (after attention, and attention's BackwardRows); "attn" / "mlp": this call's BackwardRows
    rows: dict = {}

    def enter(_module, args):
        x = args[0]
        got = stream.rows_for(x) or _embedding_rows(stream, x, mesh.size())
        if got is None:
            with torch.no_grad():
                got = (_gather(x, mesh), None)
        rows["x"] = got

    def after_attention(_module, _args, _out):
        x, y = rows.pop("x", None), _take(attn, "output_full")
        if x is not None and y is not None:
            with torch.no_grad():
                rows["h"] = (x[0] + y, rows.pop("attn", None))

    def leave(_module, _args, out):
        h, y = rows.pop("h", None), _take(mlp, "output_full")
        if emits and h is not None and y is not None:
            with torch.no_grad():
                stream.pending = (out, h[0] + y, rows.pop("mlp", None))
        rows.clear()

    block.register_forward_pre_hook(enter)
    block.get_submodule("attn_norm").register_forward_hook(_norm_rows_hook(
        lambda _x: rows.get("x"), attn, stream.backward_rows, lambda link: rows.__setitem__("attn", link)))
    block.get_submodule("attn").register_forward_hook(after_attention)
    block.get_submodule("mlp_norm").register_forward_hook(_norm_rows_hook(
        lambda _x: rows.get("h"), mlp, stream.backward_rows, lambda link: rows.__setitem__("mlp", link)))
    block.register_forward_hook(leave)
