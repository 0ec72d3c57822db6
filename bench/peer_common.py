"""What the plain peer scripts share: the spec's model, batches and optimizer, and the record of a run.

A peer script is what a user writes with torch (or DeepSpeed) alone: it takes the same spec as
`workbench run` only to build the same model (`build_model`: same weights for the same seed) and
the same batches (`TokenSource.global_batch`), and trains with AdamW at the spec's learning rate,
with no schedule, clipping or metrics. Every peer module has `train_peer(job, emit)` (one rank's
run, called by bench/bench_peers.py on a spawn pool with the process group initialized) and a
`__main__` for torchrun: `python -m bench.torchrun --standalone --nproc_per_node 2 bench/peer_X.py --spec S`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file by torchrun

from workbench.data import build_token_source  # noqa: E402
from workbench.parallel.materialize import build_model  # noqa: E402
from workbench.spec import JobSpec, load_spec  # noqa: E402


def setup(job: dict) -> tuple[JobSpec, torch.nn.Module]:
    """The spec and its model, built on the CPU with the spec's seed (the weights workbench gets)."""
    spec = load_spec(job["spec"])
    torch.manual_seed(spec.train.seed)
    return spec, build_model(spec)


def adamw(spec: JobSpec, params) -> torch.optim.Optimizer:
    t = spec.train
    return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)


def rank_batch(spec: JobSpec, source, step: int, dp_rank: int, dp: int) -> torch.Tensor:
    """This dp rank's contiguous slice of the step's global batch (as DDP scripts take it)."""
    t = spec.train
    per = t.global_batch // dp
    return source.global_batch(step, t.global_batch)[dp_rank * per:(dp_rank + 1) * per]


def token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch (`tokens` holds inputs and targets)."""
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


class Record:
    """Wall-clock step ends and losses of one rank; `emit` sends them to the harness at the end."""

    def __init__(self, emit: Callable[[dict], None], **coords):
        self.emit, self.coords = emit, coords
        self.times: list[float] = []
        self.cpu: list[float] = []  # this process's CPU time at each step end (robust on a shared host)
        self.losses: list[float] = []

    def step(self, loss: float | None) -> None:
        self.times.append(time.perf_counter())
        self.cpu.append(time.process_time())
        if loss is not None:
            self.losses.append(loss)

    def done(self) -> None:
        self.emit({"event": "peer", "rank": dist.get_rank(), **self.coords, "times": self.times,
                   "cpu": self.cpu, "losses": self.losses})


def loop_micro(spec: JobSpec, source, model, opt, rec: Record, dp_rank: int, dp: int, *,
               micro_context: Callable[[int, int], object] | None = None,
               loss_context: Callable[[], object] | None = None) -> None:
    """The plain gradient-accumulation loop: forward/backward per micro-batch, one optimizer step."""
    import contextlib

    t = spec.train
    for step in range(1, t.steps + 1):
        micro = rank_batch(spec, source, step, dp_rank, dp).split(t.micro_batch)
        total = 0.0
        for i, mb in enumerate(micro):
            ctx = micro_context(i, len(micro)) if micro_context else contextlib.nullcontext()
            with ctx, (loss_context() if loss_context else contextlib.nullcontext()):
                loss = token_loss(model(mb[:, :-1]), mb) / len(micro)
                loss.backward()
            total += float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())
        opt.step()
        opt.zero_grad()
        rec.step(total)
    rec.done()


def main(train_peer: Callable[[dict, Callable[[dict], None]], None], extra: list[str] | None = None) -> None:
    """torchrun entry: `--spec S [--out O]` plus the peer's own `--name value` options."""
    p = argparse.ArgumentParser()
    p.add_argument("--spec", required=True)
    p.add_argument("--out", help="write every rank's record as JSON lines to OUT.rank<r>")
    for name in extra or []:
        p.add_argument(f"--{name}")
    args = p.parse_args()
    dist.init_process_group("gloo")
    job = {"spec": json.loads(Path(args.spec).read_text())}
    job.update({k: v for k, v in vars(args).items() if k not in ("spec", "out") and v is not None})
    events: list[dict] = []
    train_peer(job, events.append)
    if args.out:
        Path(f"{args.out}.rank{dist.get_rank()}").write_text("\n".join(json.dumps(e) for e in events) + "\n")
    dist.destroy_process_group()


__all__ = ["Record", "adamw", "build_token_source", "loop_micro", "main", "rank_batch", "setup", "token_loss"]
