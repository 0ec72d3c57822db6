"""Megatron-style sequence parallelism on local shards, with fewer collectives than Megatron's.

The autograd graph is Megatron-LM's (Korthikanti et al. 2022, sec. 4.2.2): the residual stream is
this rank's (B, T/tp, C) sequence shard, the norms run on it with their replicated weights as plain
tensors, attention and the MLP take their input's full sequence (backward: reduce-scatter of the
input gradient), their column-parallel linears save only the shard and all-gather it again in
backward, the row-parallel outputs are summed into the shard. The saved tensors, and so the memory,
are what Korthikanti et al. count; DTensor's SequenceParallel + ColwiseParallel would save the
gathered input. The gradients of what sees only the shard (norm weights and biases, the row-parallel
bias, the position embedding's slice) are partial sums over tp, completed by one all-reduce per step
(`sum_sequence_partial_grads`, from tp.align_grad_placements).

The collectives are not Megatron's, and this is what makes sequence parallel cost about what plain
TP costs where each collective is a round trip (gloo; profile: bench/profile_sp.py). Forward: the
row-parallel partial sums are all-reduced, each rank keeps its shard for autograd and the full rows
beside it without autograd, computes the residual adds and the next norm on those full rows too, and
so has the next region's input without an all-gather (`attach_sequence_stream`): 2 collectives per
block where Megatron's reduce-scatter + all-gather pairs are 4, with the same bytes on the wire.
Backward: the output gradient's all-gather carries the region's saved input shard too, which the
column-parallel linears need next (one all-gather where Megatron issues two). Per block and
micro-batch: 6 collectives (Megatron: 10, plain TP: 4). On gloo, without a pipeline, activation
checkpointing or FSDP, backward carries full rows too (`BackwardRows`): each region's input gradient
is all-reduced together with the previous region's saved shards, and the previous region's exit then
communicates nothing: 4 collectives per block and micro-batch, as plain TP.
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
    if dist.get_backend(mesh.get_group()) == "gloo":
        # gloo's reduce-scatter is its all-reduce of the whole buffer plus copies (its profile counts
        # a gloo:all_reduce per reduce_scatter_tensor): all-reduce and keep the slice, the same sums.
        out = full.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=mesh.get_group())
        return out.chunk(tp, dim=SEQ_DIM)[mesh.get_local_rank()].contiguous()
    chunks = full.unflatten(SEQ_DIM, (tp, full.shape[SEQ_DIM] // tp)).movedim(SEQ_DIM, 0).contiguous()
    out = chunks.new_empty(chunks.shape[1:])
    dist.reduce_scatter_tensor(out, chunks.flatten(0, 1), group=mesh.get_group())
    return out


class BackwardRows:
    """One call of a region (or, with `norm` None, the embedding's output) in the backward stream: on
    gloo (whose reduce-scatter is an all-reduce of the whole tensor anyway) the region's entry
    backward all-reduces its input gradient together with the previous region's saved shards (its
    norm's output and input, each in this rank's rows of a zero buffer: their sum is the gather),
    runs its own norm's backward on the full rows and hands the previous region the full rows of
    that region's output gradient (`given`). The previous region's exit backward then communicates
    nothing, where it would all-gather them; the embedding's backward likewise. Every decision is
    structural (the same on every rank): whether the previous call exists and the dtypes agree."""

    __slots__ = ("norm", "norm_input", "prev", "autocast", "norm_output", "out_grad", "x_full", "given")

    def __init__(self, norm: nn.Module | None = None, norm_input: torch.Tensor | None = None,
                 prev: BackwardRows | None = None):
        self.norm, self.norm_input, self.prev = norm, norm_input, prev
        device = norm_input.device.type if norm_input is not None else "cpu"
        self.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        self.norm_output = None  # the entry's shard (the column-parallel linears' input)
        self.out_grad = self.x_full = None  # full rows of the output gradient and norm input: the exit's backward
        self.given = None  # (output gradient, norm output, norm input) full rows: the next region's entry backward

    def carried(self, dtype: torch.dtype) -> bool:
        """Its saved shards can ride in the next region's all-reduce of `dtype`."""
        return (self.norm is not None and self.norm_output is not None
                and self.norm_output.dtype == dtype == self.norm_input.dtype)

    def input_grad(self, dy: torch.Tensor) -> torch.Tensor:
        """The full rows of the gradient of the region's input: its output's plus its norm's backward of
        `dy` (the norm recomputed on the full rows under the forward's autocast, as the stream computed it)."""
        device, enabled, dtype = self.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            x = self.x_full.detach().requires_grad_()
            y = self.norm.forward(x)  # the instance's forward: no hooks
            (dx,) = torch.autograd.grad(y, x, dy.to(y.dtype))
        return self.out_grad.to(dx.dtype) + dx


def _in_rows(buf: torch.Tensor, shard: torch.Tensor, mesh: DeviceMesh) -> None:
    """Write `shard` (B, T/tp, C') into this rank's rows of `buf` (B, T, C'), zeros elsewhere."""
    rows = shard.shape[SEQ_DIM]
    start = mesh.get_local_rank() * rows
    buf.narrow(SEQ_DIM, start, rows).copy_(shard)


class _GatherSequence(torch.autograd.Function):
    """(B, T/tp, C) -> (B, T, C); backward reduce-scatters the summed gradient. Saves nothing.

    `rows` ([tensor] or [None]): the full (B, T, C) when this rank already computed it beside the
    shard (the stream's full rows, below); forward then communicates nothing. `cache` is shared with
    the column-parallel linears that take the gathered input: the first of them to run backward
    (or the region's row-parallel exit, in its own all-gather) gathers the shard again and leaves
    it there for the others (q, k and v share one gather, as Megatron's fused QKV does); this
    backward, which runs after all of them, drops it. `link`: this call's BackwardRows (or None)."""

    @staticmethod
    def forward(ctx, shard, mesh, cache, rows, link=None):
        ctx.mesh, ctx.cache, ctx.link = mesh, cache, link
        return rows[0] if rows[0] is not None else _gather(shard, mesh)

    @staticmethod
    def backward(ctx, grad):
        ctx.cache.clear()
        link, mesh = ctx.link, ctx.mesh
        if link is None or dist.get_backend(mesh.get_group()) != "gloo":
            return _reduce_scatter(grad, mesh), None, None, None, None
        prev, c = link.prev, grad.shape[-1]
        carry = prev is not None and prev.carried(grad.dtype)
        widths = [c] + ([prev.norm_output.shape[-1], prev.norm_input.shape[-1]] if carry else [])
        buf = grad.new_zeros((*grad.shape[:-1], sum(widths)))
        full, *saved = buf.split(widths, dim=-1)
        full.copy_(grad)
        if carry:
            _in_rows(saved[0], prev.norm_output, mesh)
            _in_rows(saved[1], prev.norm_input, mesh)
        dist.all_reduce(buf, group=mesh.get_group())
        if prev is not None and link.out_grad is not None and (carry or prev.norm is None):
            prev.given = (link.input_grad(full), *saved) if carry else (link.input_grad(full), None, None)
        link.out_grad = link.x_full = None
        return full.chunk(mesh.size(), dim=SEQ_DIM)[mesh.get_local_rank()].contiguous(), None, None, None, None


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


class SequenceRegion:
    """What one region of a block (attention or the MLP) hands on within one forward call; each
    field is taken (and cleared) by its one reader, so nothing outlives the call."""

    __slots__ = ("input_full", "entry", "output_full", "backward")

    def __init__(self):
        self.input_full = None  # (the norm's output shard, its full rows), from the norm's hook
        self.entry = None  # (the gathered input's shard, the region's cache, its BackwardRows), for the exit's backward
        self.output_full = None  # the exit's summed output, full rows, no autograd
        self.backward = None  # this call's BackwardRows, from the norm's hook (sequence_stream.py)


def _take(holder, name: str):
    value = getattr(holder, name)
    setattr(holder, name, None)
    return value


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`b` is `a` (or a view of the same storage with its shape and dtype, e.g. FSDP2's hook wrap)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype)


def _full_rows_of(region: SequenceRegion, x: torch.Tensor):
    pending = _take(region, "input_full")
    return [pending[1] if pending is not None and _same(pending[0], x) else None]


class GatherSequenceInput(ParallelStyle):
    """On entry to attention / the MLP: the sequence-sharded input's full rows (computed locally
    from the stream's full rows when there are, all-gathered otherwise), tagged with its shard so
    the column-parallel linears inside can save the shard."""

    def __init__(self, region: SequenceRegion | None = None):
        super().__init__()
        self.region = region or SequenceRegion()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        region = self.region

        def gather(_module, args):
            x, *rest = args
            shard = x.to_local() if isinstance(x, DTensor) else x
            cache: dict = {}
            link = _take(region, "backward")
            if link is not None:
                link.norm_output = shard
            full = _GatherSequence.apply(shard, device_mesh, cache, _full_rows_of(region, x), link)
            full.sequence_shard, full.sequence_cache = shard, cache
            region.entry = (shard, cache, link)
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


class _ReduceToSequenceShard(torch.autograd.Function):
    """Row-parallel partial (B, T, C) -> (this rank's summed (B, T/tp, C), the summed (B, T, C)).

    Forward all-reduces: one collective where Megatron's reduce-scatter and the next region's
    all-gather are two (the next norm's full rows are then computed here, `attach_sequence_stream`);
    autograd sees only the shard. Backward all-gathers the sequence (Megatron's g-bar) in the same
    collective as the region's saved input shard, which the region's column-parallel linears need
    again next (their cache): one all-gather where Megatron issues two."""

    @staticmethod
    def forward(ctx, partial, mesh, entry):
        ctx.mesh, ctx.cache, ctx.link = mesh, None, None
        if entry is not None:
            ctx.save_for_backward(entry[0])
            ctx.cache, ctx.link = entry[1], entry[2]
        full = partial.clone(memory_format=torch.contiguous_format)  # autograd's tensors are not ours to change
        dist.all_reduce(full, group=mesh.get_group())
        ctx.mark_non_differentiable(full)
        return full.chunk(mesh.size(), dim=SEQ_DIM)[mesh.get_local_rank()].contiguous(), full

    @staticmethod
    def backward(ctx, grad, _full_grad):
        cache, link = ctx.cache, ctx.link
        given = link.given if link is not None else None
        if given is not None and given[1] is not None and given[1].dtype == grad.dtype:  # from the next region's entry
            link.given = None
            link.out_grad, cache[grad.dtype], link.x_full = given
            return given[0], None, None
        if cache is not None and grad.dtype not in cache:
            (shard,) = ctx.saved_tensors
            if shard.shape[:-1] == grad.shape[:-1]:
                x = link.norm_input if link is not None and link.norm_input.dtype == grad.dtype else None
                parts = [grad, shard.to(grad.dtype)] + ([x] if x is not None else [])
                full, cache[grad.dtype], *rest = _gather(torch.cat(parts, dim=-1), ctx.mesh).split(
                    [p.shape[-1] for p in parts], dim=-1)
                if rest:  # this region's entry can then hand the previous one its full rows
                    link.out_grad, link.x_full = full, rest[0]
                return full, None, None
        return _gather(grad, ctx.mesh), None, None


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
    columns, sums the partial products over tp into this rank's sequence shard (and the full rows
    beside it, `_ReduceToSequenceShard`), then adds the bias (whose gradient is then partial over
    tp: summed once per step)."""

    def __init__(self, region: SequenceRegion | None = None):
        super().__init__()
        self.region = region or SequenceRegion()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        shard_parameters(module, device_mesh, {"weight": Shard(1), "bias": Replicate()})
        mark_sequence_partial(module, ("bias",), device_mesh)
        region = self.region

        def forward(x):
            y, full = _ReduceToSequenceShard.apply(F.linear(x, module.weight.to_local()), device_mesh,
                                                   _take(region, "entry"))
            if module.bias is not None:
                bias = module.bias.to_local().to(y.dtype)
                y, full = y + bias, full + bias.detach()
            region.output_full = full
            return y

        module.forward = forward
        return module


class GatherSequenceHead(ParallelStyle):
    """The head (vocab-parallel nn.Linear, weight Shard(0)) under sequence parallel: its input's full
    rows (the final norm's, computed locally from the stream's full rows, or all-gathered), the local
    vocabulary columns of the logits as a Shard(-1) DTensor for `loss_parallel`; backward
    reduce-scatters the input gradient into the sequence shard. Like ColwiseParallel it keeps the
    gathered input for its weight gradient."""

    def __init__(self, region: SequenceRegion | None = None):
        super().__init__()
        self.region = region or SequenceRegion()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        shard_parameters(module, device_mesh, {"weight": Shard(0), "bias": Shard(0)})
        region = self.region

        def forward(x):
            full = _GatherSequence.apply(x, device_mesh, {}, _full_rows_of(region, x))
            bias = module.bias.to_local() if module.bias is not None else None
            return DTensor.from_local(F.linear(full, module.weight.to_local(), bias), device_mesh, [Shard(-1)],
                                      run_check=False)

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


REGIONS_ATTR = "_workbench_sequence_regions"


def megatron_sp_plan(block: nn.Module) -> dict:
    """A block's sequence-parallel plan: the norms on the shard, attention and the MLP entered by a
    gather whose column-parallel linears save the shard, left by a row-parallel linear that sums
    into the shard. Each region's entry and exit share a `SequenceRegion` (kept on the block for
    `attach_sequence_stream`)."""
    attn, mlp = SequenceRegion(), SequenceRegion()
    setattr(block, REGIONS_ATTR, (attn, mlp))
    plan = {"attn_norm": SequenceShardedNorm(), "mlp_norm": SequenceShardedNorm(),
            "attn": GatherSequenceInput(attn), "mlp": GatherSequenceInput(mlp),
            "attn.wo": ScatterRowwiseParallel(attn), "mlp.w2": ScatterRowwiseParallel(mlp)}
    return plan | {name: ShardSavingColwiseParallel() for name in column_parallel_linears(block)}
