"""(h) Tensor parallel: the blocks on local shards (workbench) against DTensor's own styles.

Both arms run the same tp=2 job on the same 2 gloo ranks, alternated round by round: the
runtime as it is (attention and the MLP on local shards with Megatron's f/g, parallel/tp.py) and
the runtime with the blocks under DTensor's `ColwiseParallel` / `RowwiseParallel` and a replicated
`PrepareModuleInput`, which issue the same all-reduces. The difference is DTensor dispatching every
op of a block through its sharding propagation in Python. Measured per steady step on rank 0 (the
ranks of a tp group do the same work): the process's CPU time (robust on a shared machine) and the
wall clock. The two arms must train
the same model: their losses are compared.
Run: python -m bench.bench_tp [--quick]
"""
from __future__ import annotations

import argparse
import time

from bench.common import paired_ratios, stats, table, tiny_spec, write_result

ARMS = ("local shards", "DTensor styles")


def config(quick: bool) -> dict:
    if quick:
        return {"preset": "gpt-tiny", "steps": 2, "skip": 1, "reps": 1, "warmup": 0}
    return {"preset": "gpt-mini", "steps": 8, "skip": 2, "reps": 4, "warmup": 1}


def dtensor_block_plan(block, sp: bool) -> dict:
    """The peer: DTensor's styles for a block, with the same all-reduces as workbench's plan."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    from workbench.parallel.sequence_parallel import column_parallel_linears

    assert not sp, "the peer is the plan without sequence parallel"
    plan = {"attn": PrepareModuleInput(input_layouts=(Replicate(), None), desired_input_layouts=(Replicate(), None)),
            "mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
            "attn.wo": RowwiseParallel(), "mlp.w2": RowwiseParallel()}
    return plan | {name: ColwiseParallel() for name in column_parallel_linears(block)}


def _timed_job(job: dict, emit) -> None:
    """On each rank: train job["spec"] with the arm's block plan; emit (wall, CPU) at each step end."""
    import torch.distributed as dist

    from workbench.parallel import tp
    from workbench.runtime.loop import train

    marks, losses = [], []

    def sink(event):
        if event["event"] == "step":
            marks.append((time.perf_counter(), time.process_time()))
            losses.append(event["loss"])

    plan = tp._block_plan
    if job["arm"] == "DTensor styles":
        tp._block_plan = dtensor_block_plan
    try:
        train(job["spec"], sink)
    finally:
        tp._block_plan = plan
    emit({"event": "marks", "rank": dist.get_rank(), "marks": marks, "losses": losses})


def _per_step(events: list[dict], skip: int) -> dict:
    """Rank 0's mean steady-step wall and CPU seconds (the step events come from rank 0; tp ranks
    do the same work), and its losses."""
    (e,) = [e for e in events if e["rank"] == 0]
    steady = e["marks"][skip:]
    n = len(steady) - 1
    return {"wall_s": (steady[-1][0] - steady[0][0]) / n, "cpu_s": (steady[-1][1] - steady[0][1]) / n,
            "losses": e["losses"]}


def run(quick: bool = False, pool=None) -> dict:
    """Alternate the two arms for `reps` rounds on a 2-rank SpawnPool, after `warmup` unmeasured ones."""
    from workbench.runtime.spawn import SpawnPool

    cfg = config(quick)
    spec = tiny_spec(cfg["preset"], train={"steps": cfg["steps"] + cfg["skip"], "global_batch": 8, "micro_batch": 2},
                     layout={"tp": 2})
    own = pool is None
    pool = pool or SpawnPool(2)
    rounds: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    try:
        for r in range(cfg["warmup"] + cfg["reps"]):
            for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
                events = pool.run({"spec": spec, "arm": arm}, fn=_timed_job, timeout_s=600)
                if r >= cfg["warmup"]:
                    rounds[arm].append(_per_step(events, cfg["skip"]))
    finally:
        if own:
            pool.close()
    local, peer = rounds[ARMS[0]], rounds[ARMS[1]]
    return {
        "config": cfg,
        "arms": {arm: {"cpu_s": stats([x["cpu_s"] for x in rs]), "wall_s": stats([x["wall_s"] for x in rs])}
                 for arm, rs in rounds.items()},
        "cpu_ratio": stats(paired_ratios([x["cpu_s"] for x in peer], [x["cpu_s"] for x in local])),
        "wall_ratio": stats(paired_ratios([x["wall_s"] for x in peer], [x["wall_s"] for x in local])),
        # the same model either way: the largest relative loss difference between the arms
        "loss_rel_diff": max(abs(a - b) / abs(b) for x, y in zip(local, peer) for a, b in zip(x["losses"], y["losses"])),
    }


def summary_rows(result: dict) -> list[list]:
    out = []
    for what in ("cpu", "wall"):
        r = result[f"{what}_ratio"]
        out.append(["h) tensor parallel", f"DTensor styles / local shards: {what} per step (tp=2)", r["median"],
                    f"{r['min']:.2f}..{r['max']:.2f}", "> 1: the local shards are cheaper"])
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    result = run(args.quick)
    path = write_result("tp", result)
    rows = [[arm, f"{a['cpu_s']['median'] * 1e3:.1f}", f"{a['wall_s']['median'] * 1e3:.1f}"]
            for arm, a in result["arms"].items()]
    print(table(rows, ["arm", "CPU ms/step (median)", "wall ms/step (median)"]))
    print(f"DTensor styles / local shards: CPU {result['cpu_ratio']['median']:.2f}x, "
          f"wall {result['wall_ratio']['median']:.2f}x; losses differ by at most {result['loss_rel_diff']:.1e} (relative)")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
