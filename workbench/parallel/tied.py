"""Tied embeddings across pipeline stages, as Megatron-LM and DeepSpeed keep them.

The first stage holds the embedding weight, the last stage a copy of it for its head: equal at
initialization (the copy is initialized under the embedding's name, see `mark_head_copy`) and kept
equal by summing the two gradients over a group of the first and the last stage, so both take
the same update. The copy is counted once in the gradient norm. Checkpoints (model, optimizer and
fp32 master state) and the gathered final state name the copy, and a tied head, as the embedding:
a checkpoint holds one weight whatever the layout (`saved_names`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from workbench.parallel.local import local

EMBEDDING, HEAD = "tok_emb.weight", "head.weight"


def is_tied(model: nn.Module) -> bool:
    """Does `model` (a whole GPT, before the pipeline split) share its embedding with its head?"""
    tok, head = getattr(model, "tok_emb", None), getattr(model, "head", None)
    return tok is not None and head is not None and head.weight is tok.weight


def mark_head_copy(stage: nn.Module) -> None:
    """Mark a last stage's head weight (which lost its embedding) as the embedding's copy.

    `init_aliases` (parameter name -> the name it copies) is read by materialize.param_name: the
    copy is initialized, saved and gathered under the embedding's name.
    """
    stage.init_aliases = {HEAD: EMBEDDING}


def saved_names(modules: list[nn.Module]) -> dict[str, str]:
    """Parameter name -> the name its checkpoint state is saved under, for this rank's modules.

    A last stage's copy (`init_aliases`) and a tied head (one parameter, two names) are saved as
    the embedding, so a tied checkpoint holds `tok_emb.weight` alone under any pp degree and a
    resume under another one fills the copy from it.
    """
    out: dict[str, str] = {}
    for m in modules:
        out.update(getattr(m, "init_aliases", {}))
        if is_tied(m):
            out[HEAD] = EMBEDDING
    return out


def tied_params(modules: list[nn.Module], indices: list[int], num_stages: int) -> list[nn.Parameter]:
    """This pipeline rank's tied parameters: the embedding (first stage), the copy (last stage)."""
    out = []
    for m, i in zip(modules, indices):
        if i == 0:
            out.append(m.tok_emb.weight)
        if i == num_stages - 1:
            out.append(m.head.weight)
    return out


def build_tied_group(mesh: DeviceMesh):
    """The group of the first and the last pipeline rank at this rank's (dp, tp) coordinates.

    Collective: every rank calls it (new_group needs every rank), middle stages get None.
    """
    pp = mesh["pp"].size()
    if pp == 2:
        return mesh.get_group("pp")
    grid, me, mine = mesh.mesh, dist.get_rank(), None
    for d in range(grid.shape[1]):
        for t in range(grid.shape[2]):
            ranks = [int(grid[0, d, t]), int(grid[pp - 1, d, t])]
            group = dist.new_group(ranks)
            if me in ranks:
                mine = group
    return mine


def sync_tied_grads(params: list[nn.Parameter], group) -> None:
    """Sum the embedding's and the copy's gradients (after the step's last backward)."""
    for p in params:
        if p.grad is None:  # a stage that did not use it this step still joins with zeros
            p.grad = torch.zeros_like(p)
        dist.all_reduce(local(p.grad), group=group)
