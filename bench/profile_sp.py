"""Sequence parallel against plain tensor parallel on the same tp=2 layout (issue #35 item 2):
step-time ratio, and where SP spends the difference.

`time`: both arms (tp=2 with and without sequence_parallel) train the same spec on the same 2 gloo
ranks of one spawn pool, alternated A B, B A round by round; per round, rank 0's median steady step
(wall and process CPU) of each arm, and the ratio SP / TP; also the ratio of each arm's fastest step,
the least disturbed by other processes on a loaded machine. The load average is printed with it:
the machine is shared, so read the ratio, not the milliseconds.
`profile`: one run of each arm under torch.profiler on rank 0, with per-step counts of the
collectives (c10d), DTensor op dispatches and redistributions, and the ops that take the most
self CPU time.
Run: python -m bench.profile_sp [--mode time|profile|both] [--reps 6] [--steps 8] [--preset gpt-tiny]

Findings (2026-12-03, gpt-tiny, tp=2, 4 micro-batches per step, 2 shared CPUs, gloo): a gloo
collective of these sizes costs ~0.5 ms (reduce-scatter ~0.65 ms: gloo runs it as an all-reduce of
the whole buffer, plus copies), so the step follows the collective count. Per step, plain TP issued
85; sequence parallel 190 before (per block and micro-batch 10: 2 all-gathers + 2 reduce-scatters
forward, 2 all-gathers + 2 reduce-scatters + 2 re-gathers of the saved shard backward; plus
DTensor's redistributions at the embedding and head), 122 after (6 per block: sequence_parallel.py).
DTensor dispatch was not the difference (the blocks already ran on local shards). SP / TP wall,
median of 8 alternated rounds: before 1.38 and 1.43 (load 12, 7), after 1.15, 1.24, 1.15 (load 16,
11, 10); CPU time 1.37 -> 1.15..1.22. What is left is backward: 4 collectives per block against TP's 2.
2026-12-05: backward carries full rows too (sequence_parallel.BackwardRows): SP issues 86 all-reduces
and 4 all-gathers a step (one per micro-batch, the last region's) against TP's 85 all-reduces.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

from bench.common import stats, tiny_spec

ARMS = {"tp": {"tp": 2}, "sp": {"tp": 2, "sequence_parallel": True}}


def _spec(preset: str, layout: dict, steps: int) -> dict:
    return tiny_spec(preset, train={"steps": steps, "global_batch": 8, "micro_batch": 2, "lr": 3e-3}, layout=layout)


def _timed(job: dict, emit) -> None:
    import torch.distributed as dist

    from workbench.runtime.loop import train

    marks, losses = [], []

    def sink(event):
        if event["event"] == "step":
            marks.append((time.perf_counter(), time.process_time()))
            losses.append(event["loss"])

    train(job["spec"], sink)
    emit({"event": "marks", "rank": dist.get_rank(), "marks": marks, "losses": losses})


def _counting():
    """Count DTensor redistributions (by placements) and the dispatches that leave torch's C++ fast
    path for Python (sharding propagation, the Python tail) while a job runs."""
    from torch.distributed.tensor import _api, _redistribute

    counts: collections.Counter = collections.Counter()
    dispatcher = _api.DTensor._op_dispatcher
    saved = {name: getattr(dispatcher, name) for name in ("_propagate_op_sharding_dispatch_slow_path",
                                                          "_dispatch_fast_path_python_tail")
             if hasattr(dispatcher, name)}
    redistribute = _redistribute.redistribute_local_tensor

    def counter(name, fn):
        def counted(*a, **k):
            counts[f"dtensor {name}"] += 1
            return fn(*a, **k)
        return counted

    def counted_redistribute(local, current, target, *a, **k):
        counts[f"redistribute {current.placements} -> {target.placements}"] += 1
        return redistribute(local, current, target, *a, **k)

    for name, fn in saved.items():
        setattr(dispatcher, name, counter(name, fn))
    _redistribute.redistribute_local_tensor = counted_redistribute

    def restore():
        for name in saved:
            delattr(dispatcher, name)
        _redistribute.redistribute_local_tensor = redistribute

    return counts, restore


def _profiled(job: dict, emit) -> None:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from workbench.runtime.loop import train

    steps = []
    counts, restore = _counting()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        try:
            train(job["spec"], lambda e: steps.append(e) if e["event"] == "step" else None)
        finally:
            restore()
    n = max(1, len(steps))
    if dist.get_rank() != 0:
        return
    avg = prof.key_averages()
    comm = {e.key: e.count / n for e in avg if any(s in e.key.lower() for s in ("c10d", "gloo", "all_gather",
                                                                                 "reduce_scatter", "allreduce",
                                                                                 "all_reduce", "broadcast"))}
    top = sorted(avg, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
    emit({"event": "profile", "steps": n, "comm": comm,
          "counts": {k: v / n for k, v in counts.items()},
          "top": [(e.key, e.count / n, e.self_cpu_time_total / n / 1e3) for e in top],
          "copies": {e.key: e.count / n for e in avg if e.key in ("aten::copy_", "aten::clone", "aten::contiguous",
                                                                  "aten::cat", "aten::empty_like")}})


def measure(pool, preset: str, steps: int, skip: int, reps: int) -> dict:
    per_arm: dict[str, list[dict]] = {a: [] for a in ARMS}
    ratios_wall, ratios_cpu, ratios_best, loads = [], [], [], []
    losses = {}
    for r in range(reps):
        order = list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]
        row = {}
        for arm in order:
            events = pool.run({"spec": _spec(preset, ARMS[arm], steps + skip)}, fn=_timed, timeout_s=600)
            (e,) = [e for e in events if e.get("rank") == 0]
            m = e["marks"][skip:]
            walls = [b[0] - a[0] for a, b in zip(m, m[1:])]
            cpus = [b[1] - a[1] for a, b in zip(m, m[1:])]
            row[arm] = {"wall": statistics.median(walls), "cpu": statistics.median(cpus), "best": min(walls)}
            losses[arm] = e["losses"]
            per_arm[arm].append(row[arm])
        loads.append(os.getloadavg()[0])
        ratios_wall.append(row["sp"]["wall"] / row["tp"]["wall"])
        ratios_cpu.append(row["sp"]["cpu"] / row["tp"]["cpu"])
        ratios_best.append(row["sp"]["best"] / row["tp"]["best"])
        print(f"round {r}: SP/TP wall {ratios_wall[-1]:.3f} cpu {ratios_cpu[-1]:.3f} best step {ratios_best[-1]:.3f} "
              f"(tp {row['tp']['wall'] * 1e3:.1f} ms, sp {row['sp']['wall'] * 1e3:.1f} ms; load {loads[-1]:.1f})",
              flush=True)
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses["sp"], losses["tp"]))
    return {"wall_ratio": stats(ratios_wall), "cpu_ratio": stats(ratios_cpu), "best_ratio": stats(ratios_best),
            "load": stats(loads),
            "loss_rel_diff": diff,
            "ms": {a: {"wall": statistics.median(x["wall"] for x in v) * 1e3,
                       "cpu": statistics.median(x["cpu"] for x in v) * 1e3} for a, v in per_arm.items()}}


def profile_arms(pool, preset: str, steps: int) -> None:
    for arm, layout in ARMS.items():
        events = pool.run({"spec": _spec(preset, layout, steps)}, fn=_profiled, timeout_s=600)
        (p,) = [e for e in events if e["event"] == "profile"]
        print(f"\n=== {arm}: per step ({p['steps']} steps, rank 0)")
        print("collectives / comm ops:")
        for k, v in sorted(p["comm"].items()):
            print(f"  {v:8.1f}  {k}")
        print("DTensor dispatch / redistribute:")
        for k, v in sorted(p["counts"].items(), key=lambda kv: -kv[1]):
            print(f"  {v:8.1f}  {k}")
        print("copies:", {k: round(v, 1) for k, v in p["copies"].items()})
        print("top self CPU (calls/step, ms/step):")
        for k, c, ms in p["top"]:
            print(f"  {c:8.1f} {ms:8.2f}  {k}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mode", default="both", choices=("time", "profile", "both"))
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--preset", default="gpt-tiny")
    args = ap.parse_args(argv)
    from workbench.runtime.spawn import SpawnPool

    with SpawnPool(2) as pool:
        if args.mode in ("profile", "both"):
            profile_arms(pool, args.preset, args.steps)
        if args.mode in ("time", "both"):
            r = measure(pool, args.preset, args.steps, args.skip, args.reps)
            w, c, b, ld = r["wall_ratio"], r["cpu_ratio"], r["best_ratio"], r["load"]
            print(f"\nSP/TP {args.preset} tp=2, {args.reps} rounds: wall median {w['median']:.3f} "
                  f"(min {w['min']:.3f}, q1 {w['q1']:.3f}, q3 {w['q3']:.3f}, max {w['max']:.3f}); "
                  f"CPU median {c['median']:.3f} ({c['min']:.3f}..{c['max']:.3f}); "
                  f"fastest step median {b['median']:.3f} ({b['min']:.3f}..{b['max']:.3f}); "
                  f"load avg {ld['median']:.1f} ({ld['min']:.1f}..{ld['max']:.1f}) on {os.cpu_count()} CPUs; "
                  f"medians tp {r['ms']['tp']['wall']:.1f} ms, sp {r['ms']['sp']['wall']:.1f} ms; "
                  f"losses differ by <= {r['loss_rel_diff']:.1e}")


if __name__ == "__main__":
    main()
