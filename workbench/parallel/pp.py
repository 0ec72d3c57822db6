"""Pipeline parallel: split the blocks into stages balanced by parameter count, and build the
torch.distributed.pipelining stages and schedule that run them.

The split happens on the meta device (before TP, FSDP and materialization): each stage is a
copy of the model that keeps only its blocks, the embedding on the first stage and the final
norm + head on the last, so parameter names (and so the initialization) match the full model.
"""
from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from workbench.parallelism import looped_stages


def balance_blocks(block_params: list[int], first_extra: int, last_extra: int, num_stages: int) -> list[range]:
    """Contiguous block ranges, one per stage, minimizing the largest stage's parameter count.

    Args:
        block_params: parameters of each block, in order.
        first_extra: parameters the first stage also holds (embeddings).
        last_extra: parameters the last stage also holds (final norm and head).
        num_stages: number of stages (<= number of blocks; each stage gets at least one).
    Returns:
        One `range` of block indices per stage.
    """
    n = len(block_params)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} blocks into {num_stages} non-empty stages")
    # One implementation for the runtime and the memory model, so predictions use the real split.
    from workbench.memory.params import balance_blocks as balanced

    return list(balanced(tuple(block_params), first_extra, last_extra, num_stages))


def _params(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def split_stage(model: nn.Module, blocks: range, *, first: bool, last: bool) -> nn.Module:
    """A copy of `model` (on meta) that keeps only `blocks` and, if first/last, the ends.

    A tied model's last stage keeps its head weight as a copy of the embedding (see tied.py).
    """
    from workbench.parallel.tied import is_tied, mark_head_copy

    tied = is_tied(model)
    stage = copy.deepcopy(model)
    for key in list(stage.blocks.keys()):
        if int(key) not in blocks:
            del stage.blocks[key]
    if not first:
        stage.tok_emb = None
        if getattr(stage, "pos_emb", None) is not None:
            stage.pos_emb = None
    if not last:
        stage.norm = None
        stage.head = None
    if tied and last and not first:
        mark_head_copy(stage)
    return stage


def apply_pp(model: nn.Module, pp_mesh: DeviceMesh, *, chunks: int) -> tuple[list[nn.Module], list[int], int]:
    """Split a meta-device GPT into this pipeline rank's stage modules.

    Args:
        model: the full GPT on the meta device.
        pp_mesh: the 1-D pipeline mesh (this rank's position on it picks its stages).
        chunks: stages per pipeline rank (Parallelism.chunks: virtual_stages for the multi-stage
            schedules, else 1), placed looped (parallelism.looped_stages).
    Returns:
        (stage modules, their global stage indices, total number of stages).
    """
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    num_stages = pp * chunks
    keys = sorted(model.blocks.keys(), key=int)
    first_extra = _params(model.tok_emb) + _params(getattr(model, "pos_emb", None))
    last_extra = _params(model.norm) + _params(model.head)
    bounds = balance_blocks([_params(model.blocks[k]) for k in keys], first_extra, last_extra, num_stages)
    indices = looped_stages(pp_rank, pp, chunks)
    modules = [split_stage(model, bounds[s], first=s == 0, last=s == num_stages - 1) for s in indices]
    return modules, indices, num_stages


def build_schedule(modules: list[nn.Module], indices: list[int], num_stages: int, pp_mesh: DeviceMesh, *,
                   schedule: str, num_microbatches: int, loss_fn: Callable, device: torch.device):
    """The torch.distributed.pipelining schedule over this rank's (materialized) stage modules.

    Stage shapes are inferred from the first micro-batch at run time, so sequence-parallel
    (seq-sharded) activations and any micro-batch size work without example inputs.

    Returns:
        (schedule, list of PipelineStage).
    """
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as S

    group = pp_mesh.get_group()
    stages = [PipelineStage(m, i, num_stages, device, group=group) for m, i in zip(modules, indices)]
    single = {"gpipe": S.ScheduleGPipe, "1f1b": S.Schedule1F1B}
    multi = {"interleaved-1f1b": S.ScheduleInterleaved1F1B, "zero-bubble": S.ScheduleInterleavedZeroBubble}
    # scale_grads=False: loss_fn returns each micro-batch's loss already divided by their number
    # (as gradient accumulation does), so the summed gradients are those of the mean loss.
    if schedule in single:
        sched = single[schedule](stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)
    else:
        sched = multi[schedule](stages, num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return sched, stages
