"""(c) Measured pipeline bubble per schedule against (p-1)/(m+p-1), for m micro-batches.

Each (schedule, m) runs pp=2 gloo ranks through the runtime; its "timeline" event lists when
every forward (F), backward (B) and weight-gradient (W) pass ran on each rank during one step.
Bubble = 1 - (busy time over all ranks) / (p x the step's span): the share of the pipeline's
time that ranks sit idle (waiting on neighbours, including the activations' transfer).
Run: python -m bench.bench_pipeline [--quick]
"""
from __future__ import annotations

import argparse

from bench.common import NOT_AVAILABLE, stats, table, tiny_spec, write_result
from workbench.parallelism import PIPELINE_SCHEDULES, is_multi_stage

SCHEDULES = list(PIPELINE_SCHEDULES)


def config(quick: bool) -> dict:
    if quick:
        return {"preset": "gpt-tiny", "pp": 2, "ms": [2], "schedules": ["gpipe", "1f1b"], "reps": 1, "micro_batch": 1}
    # micro-batches of 2 sequences: enough work per F/B that message latency does not dominate
    return {"preset": "gpt-mini", "pp": 2, "ms": [1, 2, 4, 8, 16], "schedules": SCHEDULES, "reps": 2, "micro_batch": 2}


def theory(p: int, m: int, v: int = 1) -> float:
    """Bubble share of a synchronous pipeline: (p-1)/(v*m + p-1); v = stages per rank."""
    return (p - 1) / (v * m + p - 1)


def bubble(timelines: dict[int, list[dict]]) -> dict:
    """Bubble share of one step from each rank's F/B/W items (times from that rank's step start)."""
    items = [i for rank_items in timelines.values() for i in rank_items]
    start = min(i["start_s"] for i in items)
    span = max(i["end_s"] for i in items) - start
    busy = sum(i["end_s"] - i["start_s"] for i in items)
    return {"bubble": 1 - busy / (len(timelines) * span), "span_s": span, "busy_s": busy}


def job_spec(cfg: dict, schedule: str, m: int) -> dict:
    mb = cfg["micro_batch"]
    return tiny_spec(cfg["preset"], train={"steps": 2, "global_batch": m * mb, "micro_batch": mb},
                     layout={"pp": cfg["pp"], "pp_schedule": schedule})


def run(quick: bool = False, pool=None) -> dict:
    """Run every (schedule, m) on a pp-rank SpawnPool; rounds alternate the schedules."""
    from workbench.errors import ConfigError
    from workbench.runtime.spawn import SpawnPool
    from workbench.spec import LayoutSpec, load_spec
    from workbench.validate import check_runnable

    cfg = config(quick)
    p = cfg["pp"]
    own = pool is None
    pool = pool or SpawnPool(p)
    cells: dict[str, dict] = {}
    try:
        for rep in range(cfg["reps"]):
            for m in cfg["ms"]:
                order = cfg["schedules"] if rep % 2 == 0 else cfg["schedules"][::-1]
                for schedule in order:
                    cell = cells.setdefault(f"{schedule}|{m}", {"schedule": schedule, "m": m, "samples": []})
                    spec = job_spec(cfg, schedule, m)
                    try:
                        check_runnable(load_spec(spec))
                    except ConfigError as e:
                        cell["refused"] = str(e)
                        continue
                    events = pool.run(spec, timeout_s=600)
                    timelines = {e["rank"]: e["items"] for e in events if e["event"] == "timeline"}
                    if not timelines:
                        cell["refused"] = f"{NOT_AVAILABLE}: no timeline events in this build"
                        continue
                    cell["samples"].append(bubble(timelines))
                    cell["timeline"] = timelines  # the last one, for the Gantt figure
    finally:
        if own:
            pool.close()
    rows = []
    for cell in cells.values():
        v = LayoutSpec().virtual_stages if is_multi_stage(cell["schedule"]) else 1
        row = {"schedule": cell["schedule"], "m": cell["m"], "theory": theory(p, cell["m"]),
               "theory_interleaved": theory(p, cell["m"], v), "virtual_stages": v}
        if cell["samples"]:
            row["measured"] = stats([s["bubble"] for s in cell["samples"]])
            row["span_s"] = stats([s["span_s"] for s in cell["samples"]])
            row["timeline"] = cell["timeline"]
        else:
            row["measured"] = NOT_AVAILABLE
            row["reason"] = cell.get("refused", NOT_AVAILABLE)
        rows.append(row)
    return {"config": cfg, "rows": rows}


def summary_rows(result: dict) -> list[list]:
    out = []
    for schedule in result["config"]["schedules"]:
        rows = [r for r in result["rows"] if r["schedule"] == schedule and isinstance(r["measured"], dict)]
        if not rows:
            out.append(["c) pipeline", f"{schedule}: bubble", NOT_AVAILABLE, "", ""])
            continue
        hi = max(rows, key=lambda r: r["m"])
        out.append(["c) pipeline", f"{schedule}: bubble at m={hi['m']} (p={result['config']['pp']})",
                    hi["measured"]["median"], f"{hi['measured']['min']:.3f}..{hi['measured']['max']:.3f}",
                    f"theory {hi['theory']:.3f}"])
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    result = run(args.quick)
    path = write_result("pipeline", result)
    rows = [[r["schedule"], r["m"], r["measured"]["median"] if isinstance(r["measured"], dict) else "refused",
             r["theory"], r["theory_interleaved"]] for r in sorted(result["rows"], key=lambda r: (r["schedule"], r["m"]))]
    print(table(rows, ["schedule", "m", "measured bubble", "(p-1)/(m+p-1)", "(p-1)/(vm+p-1)"]))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
