"""What a checkpoint costs: seconds and bytes per save against the step time, sync vs async.

Runs in one process on CPU (or one GPU): trains a few steps of a preset, then saves with the
real Checkpointer to a local directory (or --uri), synchronously and in the background, and
prints the ratios. Usage: python bench/bench_checkpoint.py [--preset gpt-mini] [--steps 6]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from workbench.data import build_token_source
from workbench.parallel.materialize import build_model
from workbench.runtime.checkpoint import Checkpointer
from workbench.runtime.checkpoint_store import Store
from workbench.spec import load_spec


def train_step(model, optimizer, batch) -> None:
    x, y = batch[:, :-1], batch[:, 1:]
    loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="gpt-mini")
    p.add_argument("--steps", type=int, default=6, help="timed training steps")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--uri", help="checkpoint location (default: a temporary directory)")
    args = p.parse_args()

    uri = args.uri or tempfile.mkdtemp(prefix="bench-ckpt-")
    spec = load_spec({"name": "bench-ckpt", "model": {"preset": args.preset},
                      "train": {"steps": 2 * args.steps, "global_batch": args.global_batch,
                                "micro_batch": args.global_batch},
                      "checkpoint": {"uri": uri, "keep": 2}})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(spec).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.train.lr)
    source = build_token_source(spec)
    batches = [source.global_batch(k, args.global_batch).to(device) for k in range(1, 2 * args.steps + 2)]

    def timed_step(k: int) -> float:
        start = time.perf_counter()
        train_step(model, optimizer, batches[k])
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    timed_step(0)  # warm-up (and the optimizer state exists from here on)
    step_s = statistics.median(timed_step(k) for k in range(1, args.steps + 1))

    sync = Checkpointer(spec.to_dict(), [model], optimizer)
    sync.save(1)  # warm-up: first-call costs (imports, plans) are not per save
    start = time.perf_counter()
    sync.save(2)
    sync_s = time.perf_counter() - start
    store = Store(uri)
    manifest = store.read_manifest(2)
    ckpt_bytes = sum(f["bytes"] for f in manifest["files"].values())

    async_spec = spec.to_dict()
    async_spec["checkpoint"]["async_save"] = True
    bg = Checkpointer(async_spec, [model], optimizer)
    bg.save(3)  # warm-up: allocates the staging buffers that later saves reuse
    bg.wait()
    start = time.perf_counter()
    bg.save(4)
    block_s = bg.last_blocking_s  # what training waits for: the state dict and its copy to CPU memory
    overlapped = [timed_step(k) for k in range(args.steps + 1, 2 * args.steps + 1)]
    bg.wait()
    async_total_s = time.perf_counter() - start

    num_params = sum(p.numel() for p in model.parameters())
    result = {
        "preset": args.preset, "device": device.type, "params": num_params, "step_s": round(step_s, 4),
        "checkpoint_bytes": ckpt_bytes, "bytes_per_param": round(ckpt_bytes / num_params, 2),
        "sync_save_s": round(sync_s, 4), "sync_save_over_step": round(sync_s / step_s, 2),
        "async_blocking_s": round(block_s, 4), "async_blocking_over_step": round(block_s / step_s, 3),
        "async_total_s": round(async_total_s, 4),
        "step_s_during_async_save": round(statistics.median(overlapped), 4),
        "sync_MB_per_s": round(ckpt_bytes / sync_s / 1e6, 1),
    }
    print(json.dumps(result, indent=1))
    print(f"one synchronous save = {result['sync_save_over_step']}x a training step "
          f"({ckpt_bytes / 1e6:.1f} MB, {result['bytes_per_param']} B/param); an async save blocks training "
          f"for {result['async_blocking_over_step']}x a step")
    every = max(1, round(sync_s / step_s / 0.01))
    print(f"to keep synchronous checkpointing under 1% of the run, save every >= {every} steps")


if __name__ == "__main__":
    main()
