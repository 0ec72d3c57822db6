"""How fast `workbench plan` answers, for 64, 512 and 4096 GPUs (llama-70b, 8 per node).

Prints the time of a cold and a warm plan() and, as a peer, what pricing the same number of
layouts through the public `estimate_memory(JobSpec)` path would cost (measured on a sample).
Run: python bench/bench_planner.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import time

from workbench.memory import estimate_memory
from workbench.planner import plan
from workbench.spec import load_spec


def spec_for(nodes: int, global_batch: int):
    return load_spec({
        "name": "bench", "model": {"preset": "llama-70b"},
        "train": {"global_batch": global_batch, "micro_batch": 1},
        "layout": {"dp": nodes, "tp": 8, "pp": 1, "zero": 3},
        "precision": {"dtype": "bf16"},
        "resources": {"gpu": "h100-80gb", "gpus_per_node": 8, "nodes": nodes},
    })


def per_spec_seconds(spec, samples: int = 20) -> float:
    """Seconds to price one layout the naive way: build a JobSpec, estimate every rank."""
    t = time.perf_counter()
    for i in range(samples):
        estimate_memory(spec.replace(**{"train.micro_batch": 1 + i % 2}))
    return (time.perf_counter() - t) / samples


def main() -> None:
    print(f"{'GPUs':>6} {'layouts':>8} {'fit':>6} {'cold s':>8} {'warm s':>8} {'naive s (est.)':>15} {'speed-up':>9}")
    for nodes, gb in ((8, 256), (64, 2048), (512, 16384)):
        spec = spec_for(nodes, gb)
        t = time.perf_counter()
        result = plan(spec)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        plan(spec)
        warm = time.perf_counter() - t
        naive = per_spec_seconds(spec) * result.searched
        fit = sum(c.fits for c in result.candidates)
        print(f"{nodes * 8:>6} {result.searched:>8} {fit:>6} {cold:>8.3f} {warm:>8.3f} {naive:>15.1f} {naive / cold:>8.0f}x")
    best = plan(spec_for(8, 256), top=1).candidates[0]
    print(f"best for 64 x H100, llama-70b: {best.layout} mb={best.micro_batch} {best.tokens_per_s:,.0f} tok/s, "
          f"${best.usd_per_hour_spot:,.0f}/h spot ({best.cloud})")


if __name__ == "__main__":
    main()
