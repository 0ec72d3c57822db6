"""Plain peer of workbench's pipeline parallel: a `torch.distributed.pipelining` script.

What a user writes from torch's pipelining docs: cut the model's blocks into equal runs (stage s
of S keeps blocks [s L/S, (s+1) L/S), the first also the embeddings, the last the norm and head),
wrap each in a `PipelineStage`, and step `Schedule1F1B` (one stage per rank) or
`ScheduleInterleaved1F1B` (`--virtual 2`: stages r and r + pp on rank r) with a mean cross-entropy
`loss_fn` (the schedule scales the gradients by the number of micro-batches). Same model, batches
and AdamW as the spec (bench/peer_common.py). The equal runs are what a user writes; workbench
balances the stages by parameter count instead, so the two splits can differ (gpt-mini, 4 stages:
blocks 1/2/1/2 here against 1/2/2/1, i.e. 2 and 4 blocks per rank against 3 and 3): then one
rank's CPU per step compares different work, and only the whole pipeline's compares the same. Run:
    python -m bench.torchrun --standalone --nproc_per_node 2 bench/peer_pp.py --spec S --schedule 1f1b
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file by torchrun

from bench.peer_common import Record, adamw, build_token_source, main, rank_batch, setup  # noqa: E402


def stage_module(model, s: int, num_stages: int):
    """Stage s of num_stages: an equal run of the blocks, and the ends on the first/last stage."""
    stage = copy.deepcopy(model)
    n = len(model.blocks)
    keep = range(s * n // num_stages, (s + 1) * n // num_stages)
    for key in list(stage.blocks.keys()):
        if int(key) not in keep:
            del stage.blocks[key]
    if s > 0:
        stage.tok_emb, stage.pos_emb = None, None
    if s < num_stages - 1:
        stage.norm, stage.head = None, None
    return stage


def train_peer(job: dict, emit) -> None:
    """One rank: job = {"spec": dict, "schedule": "1f1b" | "interleaved-1f1b", "virtual": int}."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    spec, model = setup(job)
    rank, pp = dist.get_rank(), dist.get_world_size()
    interleaved = job.get("schedule", "1f1b") != "1f1b"
    chunks = int(job.get("virtual", 2)) if interleaved else 1
    num_stages = pp * chunks
    ids = [rank + i * pp for i in range(chunks)]
    modules = [stage_module(model, s, num_stages) for s in ids]
    del model
    stages = [PipelineStage(m, s, num_stages, torch.device("cpu")) for m, s in zip(modules, ids)]
    t = spec.train
    n_micro = t.global_batch // t.micro_batch

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    sched = (ScheduleInterleaved1F1B(stages, n_micro, loss_fn=loss_fn) if interleaved
             else Schedule1F1B(stages[0], n_micro, loss_fn=loss_fn))
    opt = adamw(spec, [p for m in modules for p in m.parameters()])
    source = build_token_source(spec)
    first, last = 0 in ids, num_stages - 1 in ids
    rec = Record(emit, dp_rank=0, last_stage=last)
    for step in range(1, t.steps + 1):
        batch = rank_batch(spec, source, step, 0, 1)
        losses: list[torch.Tensor] = []
        kwargs = {"target": batch[:, 1:], "losses": losses} if last else {}
        if first:
            sched.step(batch[:, :-1], **kwargs)
        else:
            sched.step(**kwargs)
        opt.step()
        opt.zero_grad()
        rec.step(float(torch.stack(losses).mean()) if last else None)
    rec.done()


if __name__ == "__main__":
    main(train_peer, ["schedule", "virtual"])
