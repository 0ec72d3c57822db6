"""The peer of `workbench run` in the throughput benchmark: a plain torchrun DDP script.

Written the way a person writes one: DDP with default buckets, AdamW, gradient accumulation with
no_sync, nothing else. Same model (`workbench.build_model`), same batches (`TokenSource`), same
shapes and optimizer as the spec. Run:
    python -m torch.distributed.run --nproc_per_node 2 bench/plain_ddp.py --spec SPEC.json --out T.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file by torchrun

from workbench.data import build_token_source  # noqa: E402
from workbench.parallel.materialize import build_model  # noqa: E402
from workbench.spec import load_spec  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--spec", required=True, help="spec JSON/YAML (model, data, train)")
    p.add_argument("--out", help="rank 0 writes {'step_end_times': [...], 'losses': [...]} here, rank r OUT.rank<r>")
    args = p.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = load_spec(args.spec)
    t = spec.train
    torch.manual_seed(t.seed)
    model = DistributedDataParallel(build_model(spec))
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    source = build_token_source(spec)
    per_rank = t.global_batch // world
    num_micro = per_rank // t.micro_batch

    ends, losses = [], []
    for step in range(1, t.steps + 1):
        batch = source.global_batch(step, t.global_batch)[rank * per_rank : (rank + 1) * per_rank]
        total = 0.0
        for i, mb in enumerate(batch.split(t.micro_batch)):
            with model.no_sync() if i < num_micro - 1 else contextlib.nullcontext():
                logits = model(mb[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), mb[:, 1:].flatten()) / num_micro
                loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        ends.append(time.time())
        if step == 1:
            cpu_at_step_1 = time.process_time()  # this process's CPU seconds, imports included
        losses.append(total)
    if args.out:  # each rank writes its own file: no extra collective just to log the loss
        out = args.out if rank == 0 else f"{args.out}.rank{rank}"
        Path(out).write_text(json.dumps({"step_end_times": ends, "losses": losses, "world": world,
                                         "threads": torch.get_num_threads(), "cpu_at_step_1_s": cpu_at_step_1,
                                         "omp": os.environ.get("OMP_NUM_THREADS")}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
