"""Plain peer of workbench's tensor parallel: torch's `parallelize_module` with its own styles.

The plan a user copies from torch's TP tutorial (and torchtitan's llama plan): the embedding
`RowwiseParallel`, attention's q/k/v and the MLP's up/gate `ColwiseParallel`, their outputs
`RowwiseParallel`, the head `ColwiseParallel` with vocab-sharded logits under `loss_parallel`.
With sequence parallel (`--sp 1`): the norms `SequenceParallel`, attention and the MLP entered
through `PrepareModuleInput(Shard(1) -> Replicate())`, the row-parallel outputs `Shard(1)`, and
the position embedding's slice (GPT-2 shapes) through `PrepareModuleOutput(Replicate -> Shard(0))`.
Same model, batches and AdamW as the spec (bench/peer_common.py). Run:
    python -m bench.torchrun --standalone --nproc_per_node 2 bench/peer_tp.py --spec S --sp 1
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file by torchrun

from bench.peer_common import Record, adamw, build_token_source, loop_micro, main, setup  # noqa: E402


def tp_plan(model, sp: bool) -> tuple[dict, list[dict]]:
    """(top-level plan, one plan per block) in torch's styles."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    stream = Shard(1) if sp else Replicate()
    top = {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
           "head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)}
    if sp:
        top["norm"] = SequenceParallel()
        if model.pos_emb is not None:
            top["pos_emb"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
    blocks = []
    for block in model.blocks.values():
        plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(output_layouts=stream), "mlp.w1": ColwiseParallel(),
                "mlp.w2": RowwiseParallel(output_layouts=stream)}
        if block.mlp.w3 is not None:
            plan["mlp.w3"] = ColwiseParallel()
        if sp:
            plan |= {"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                     "attn": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
                     "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
        blocks.append(plan)
    return top, blocks


def train_peer(job: dict, emit) -> None:
    """One rank: job = {"spec": dict, "sp": bool}; the whole world is the tp group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    spec, model = setup(job)
    sp = str(job.get("sp", "")).lower() in ("1", "true")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    top, blocks = tp_plan(model, sp)
    parallelize_module(model, mesh, top)
    for block, plan in zip(model.blocks.values(), blocks):
        parallelize_module(block, mesh, plan)
    opt = adamw(spec, model.parameters())
    rec = Record(emit, dp_rank=0)
    loop_micro(spec, build_token_source(spec), model, opt, rec, 0, 1, loss_context=loss_parallel)


if __name__ == "__main__":
    main(train_peer, ["sp"])
