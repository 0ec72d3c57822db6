"""Plain peer of workbench's ZeRO and CPU offload: the FSDP2 / ZeroRedundancyOptimizer loop a user writes.

  zero=1   DDP + `ZeroRedundancyOptimizer(AdamW)` (torch's optimizer-state sharding), `no_sync` on
           all but the last micro-batch;
  zero=2   `fully_shard(block, reshard_after_forward=False)` per block, then the root;
  zero=3   `fully_shard(block)` per block (resharded after forward), then the root;
  offload  zero=3 with `offload_policy=CPUOffloadPolicy()` (FSDP2's own).
FSDP2's gradients are reduce-scattered on every micro-batch (the loop as FSDP2's docs show it).
Same model, batches and AdamW as the spec (bench/peer_common.py). Run:
    python -m bench.torchrun --standalone --nproc_per_node 2 bench/peer_fsdp2.py --spec S --zero 3
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file by torchrun

from bench.peer_common import Record, adamw, build_token_source, loop_micro, main, setup  # noqa: E402


def train_peer(job: dict, emit) -> None:
    """One rank: job = {"spec": dict, "zero": 1|2|3, "offload": bool}."""
    from torch.distributed.device_mesh import init_device_mesh

    spec, model = setup(job)
    zero, offload = int(job.get("zero", 3)), str(job.get("offload", "")).lower() in ("1", "true", "cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    micro_context = None
    if zero == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        t = spec.train
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=type(adamw(spec, [model.module.tok_emb.weight])),
                                      lr=t.lr, weight_decay=t.weight_decay)

        def micro_context(i, n):
            return model.no_sync() if i < n - 1 else contextlib.nullcontext()
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        # pinned host memory needs an accelerator: on a CPU-only host the policy runs unpinned
        policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh, reshard_after_forward=zero == 3, offload_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=False, offload_policy=policy)
        opt = adamw(spec, model.parameters())
    rec = Record(emit, dp_rank=rank)
    loop_micro(spec, build_token_source(spec), model, opt, rec, rank, world, micro_context=micro_context)


if __name__ == "__main__":
    main(train_peer, ["zero", "offload"])
