"""DeepSpeed's ZeRO as a peer of workbench's: `deepspeed.initialize` with the user's torch AdamW.

The engine a DeepSpeed user writes: ZeRO stage k in the config, `train_micro_batch_size_per_gpu`
and `gradient_accumulation_steps` from the spec, `engine.backward(loss)` and `engine.step()` per
micro-batch (DeepSpeed scales by the accumulation steps and steps the optimizer on the boundary).
A torch AdamW is passed in (a client optimizer), so no DeepSpeed optimizer op is compiled; on CPU,
DeepSpeed's communication backend still JIT-builds its shared-memory op (`deepspeed_shm_comm`,
a C++ build of minutes on this 2-core VM; cached in TORCH_EXTENSIONS_DIR after the first).
Run: python -m bench.torchrun --standalone --nproc_per_node 2 bench/peer_deepspeed.py --spec S --zero 3
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file by torchrun

from bench.peer_common import Record, adamw, build_token_source, main, rank_batch, setup, token_loss  # noqa: E402


def _forget_groups(groups) -> None:
    """Drop the process groups DeepSpeed cached in module globals for an earlier job's group."""
    for name, value in vars(groups).items():
        if name.startswith("_") and name.isupper() and name.endswith(("_GROUP", "_GROUP_RANKS")):
            setattr(groups, name, {} if isinstance(value, dict) else None)


def train_peer(job: dict, emit) -> None:
    """One rank: job = {"spec": dict, "zero": 1|2|3}; the process group is already up (gloo)."""
    import deepspeed

    spec, model = setup(job)
    rank, world = dist.get_rank(), dist.get_world_size()
    t = spec.train
    micro = t.global_batch // world // t.micro_batch
    # DeepSpeed keeps its communication backend in a module global bound to the process group it
    # first saw; the benchmark's pool gives each job a new group, so let it bind to this one.
    # Its groups module caches the world group the same way (a stale one fails in get_global_rank).
    deepspeed.comm.comm.cdb = None
    _forget_groups(deepspeed.utils.groups)
    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": t.micro_batch, "gradient_accumulation_steps": micro,
              "zero_optimization": {"stage": int(job.get("zero", 3))}, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adamw(spec, model.parameters()), config=config)
    source = build_token_source(spec)
    rec = Record(emit, dp_rank=rank)
    for step in range(1, t.steps + 1):
        total = 0.0
        for mb in rank_batch(spec, source, step, rank, world).split(t.micro_batch):
            loss = token_loss(engine(mb[:, :-1]), mb)
            engine.backward(loss)
            engine.step()
            total += float(loss.detach()) / micro
        rec.step(total)
    rec.done()


if __name__ == "__main__":
    main(train_peer, ["zero"])
