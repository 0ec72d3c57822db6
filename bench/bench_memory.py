"""(b) Measured per-rank model-state memory against dp for ZeRO 0/1/2/3, beside the prediction.

Each (dp, zero) runs a few real steps on dp gloo processes; the runtime's memory events give
the bytes each rank holds (params + grads + master + optimizer state, local shards), and
`workbench.estimate_memory` gives the predicted bytes for the same spec.
Run: python -m bench.bench_memory [--quick]
"""
from __future__ import annotations

import argparse

from bench.common import NOT_AVAILABLE, mib, table, tiny_spec, write_result

STATE = ("params", "grads", "master", "optimizer")


def config(quick: bool) -> dict:
    if quick:
        return {"preset": "gpt-tiny", "dps": [1, 2], "zeros": [0, 3], "global_batch": 4, "dtype": "fp32"}
    return {"preset": "gpt-mini", "dps": [1, 2, 4], "zeros": [0, 1, 2, 3], "global_batch": 8, "dtype": "fp32"}


def job_spec(cfg: dict, dp: int, zero: int) -> dict:
    return tiny_spec(cfg["preset"], train={"steps": 2, "global_batch": cfg["global_batch"], "micro_batch": 1},
                     layout={"dp": dp, "zero": zero}, precision={"dtype": cfg["dtype"]})


def predicted(spec: dict) -> dict | None:
    """Rank 0's predicted breakdown, or None when the estimator is not in this build."""
    try:
        from workbench.memory import estimate_memory
    except ImportError:
        return None
    return estimate_memory(spec).to_dict()["per_rank"][0]


def measured(events: list[dict]) -> dict:
    """The largest state bytes over ranks, from each rank's last memory event."""
    last: dict[int, dict] = {}
    for e in events:
        if e["event"] == "memory":
            last[e["rank"]] = e["measured"]
    worst = max(last.values(), key=lambda m: sum(m.get(k, 0) for k in STATE))
    return {k: int(worst.get(k, 0)) for k in (*STATE, "activations", "peak")}


def run(quick: bool = False, pools: dict | None = None) -> dict:
    """Measure every (dp, zero); `pools` may hold ready SpawnPools by world size."""
    from workbench.errors import ConfigError
    from workbench.runtime.loop import train
    from workbench.runtime.spawn import SpawnPool

    cfg = config(quick)
    pools = dict(pools or {})
    own = [w for w in cfg["dps"] if w > 1 and w not in pools]
    rows = []
    try:
        for dp in cfg["dps"]:
            if dp > 1 and dp not in pools:
                pools[dp] = SpawnPool(dp)
            for zero in cfg["zeros"]:
                spec = job_spec(cfg, dp, zero)
                row = {"dp": dp, "zero": zero}
                try:
                    if dp == 1:
                        events: list[dict] = []
                        train(spec, events.append)
                    else:
                        events = pools[dp].run(spec, timeout_s=600)
                    row["measured"] = measured(events)
                except ConfigError as e:  # e.g. a stage the build refuses at this dp
                    row["measured"] = NOT_AVAILABLE
                    row["reason"] = str(e)
                pred = predicted(spec)
                row["predicted"] = pred if pred is not None else NOT_AVAILABLE
                rows.append(row)
    finally:
        for w in own:
            pools[w].close()
    for row in rows:
        row["measured_state"] = _state(row["measured"])
        row["predicted_state"] = _state(row["predicted"])
    return {"config": cfg, "rows": rows}


def _state(breakdown) -> int | str:
    return sum(int(breakdown.get(k, 0)) for k in STATE) if isinstance(breakdown, dict) else NOT_AVAILABLE


def summary_rows(result: dict) -> list[list]:
    rows = [r for r in result["rows"] if isinstance(r["measured_state"], int) and isinstance(r["predicted_state"], int)]
    if not rows:
        return [["b) memory", "measured / predicted state bytes", NOT_AVAILABLE, "", ""]]
    ratios = [r["measured_state"] / r["predicted_state"] for r in rows if r["predicted_state"]]
    top = max(result["config"]["dps"])
    z0 = next((r for r in rows if r["dp"] == top and r["zero"] == 0), None)
    z3 = next((r for r in rows if r["dp"] == top and r["zero"] == 3), None)
    out = [["b) memory", "measured / predicted state bytes, all (dp, zero)", sorted(ratios)[len(ratios) // 2],
            f"{min(ratios):.3f}..{max(ratios):.3f}", "1.0"]]
    if z0 and z3:
        out.append(["b) memory", f"zero 3 / zero 0 state bytes at dp={top} (measured)",
                    z3["measured_state"] / z0["measured_state"], "", f"~1/{top}"])
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    result = run(args.quick)
    path = write_result("memory", result)
    rows = []
    for r in result["rows"]:
        m, pr = r["measured_state"], r["predicted_state"]
        rows.append([r["dp"], r["zero"], mib(m) if isinstance(m, int) else m, mib(pr) if isinstance(pr, int) else pr,
                     m / pr if isinstance(m, int) and isinstance(pr, int) and pr else "-"])
    print(table(rows, ["dp", "zero", "measured state MiB", "predicted MiB", "ratio"]))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
