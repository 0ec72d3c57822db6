"""How fast `workbench plan` answers, for 64, 512 and 4096 GPUs (llama-70b, 8 per node).

Prints the time of a cold and a warm plan() and, as a peer, what pricing the same number of
layouts through the public `estimate_memory(JobSpec)` path would cost (measured on a sample).
Then the commands as a user runs them (`workbench plan/memory/validate` in a fresh process, virtual
stages searched included) at 64 and 4096 GPUs: wall and CPU seconds against the goals (1 s at 64,
3 s at 4096) and, as peers in the same run, a bare interpreter and `import torch` (which the
commands no longer pay). On a shared machine wall > CPU; the CPU column is the comparable one.
Run: python bench/bench_planner.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import os
import resource
import subprocess
import tempfile
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


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall s, CPU s) of a fresh process running `cmd`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def commands() -> None:
    py = sys.executable
    print(f"\n{'command':<34} {'GPUs':>6} {'wall s':>7} {'CPU s':>7} {'goal s':>7} {'CPU/goal':>9}")
    for label, cmd in (("python -c pass (peer)", [py, "-c", "pass"]),
                       ("python -c 'import torch' (peer)", [py, "-c", "import torch"])):
        wall, cpu = timed(cmd)
        print(f"{label:<34} {'':>6} {wall:>7.2f} {cpu:>7.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        for nodes, gb, goal in ((8, 256, 1.0), (512, 16384, 3.0)):
            path = Path(tmp) / f"plan-{nodes}.yaml"
            spec_for(nodes, gb).save(path)
            for command in ("plan", "memory", "validate"):
                wall, cpu = timed([py, "-m", "workbench.cli", command, str(path)])
                print(f"{'workbench ' + command:<34} {nodes * 8:>6} {wall:>7.2f} {cpu:>7.2f} {goal:>7.1f} "
                      f"{cpu / goal:>9.2f}")


ROOT = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    main()
    commands()
