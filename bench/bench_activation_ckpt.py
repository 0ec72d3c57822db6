"""(e) Activation checkpointing: activation memory saved against step time added.

In one process, the runtime trains the same spec with activation_checkpointing none, selective
(the attention core), full every 2nd block (`every-2`) and full, alternating. Memory: the activations saved for backward (the
runtime's meter, beside `estimate_memory`'s prediction); time: the median step's CPU time (robust
on a shared machine; recomputation is CPU work), with the wall clock beside it.
Run: python -m bench.bench_activation_ckpt [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import time

from bench.common import NOT_AVAILABLE, interleave, mib, stats, table, tiny_spec, write_result

MODES = ["none", "selective", "every-2", "full"]


def config(quick: bool) -> dict:
    if quick:
        return {"preset": "gpt-tiny", "steps": 4, "skip": 1, "global_batch": 4, "micro_batch": 2, "reps": 1}
    return {"preset": "gpt-mini", "steps": 8, "skip": 2, "global_batch": 4, "micro_batch": 2, "reps": 3}


def job_spec(cfg: dict, mode: str) -> dict:
    return tiny_spec(cfg["preset"], train={"steps": cfg["steps"], "global_batch": cfg["global_batch"],
                                           "micro_batch": cfg["micro_batch"]},
                     layout={"activation_checkpointing": "full", "checkpoint_every": 2} if mode == "every-2"
                     else {"activation_checkpointing": mode})


def run(quick: bool = False) -> dict:
    from workbench.errors import ConfigError
    from workbench.runtime.loop import train

    cfg = config(quick)
    memory: dict[str, list[int]] = {m: [] for m in MODES}
    wall: dict[str, list[float]] = {m: [] for m in MODES}
    refused: dict[str, str] = {}

    def once(mode):
        def measure():
            if mode in refused:
                return float("nan")
            events, cpu = [], []

            def sink(e):
                if e["event"] == "step":
                    cpu.append(time.process_time())
                events.append(e)
            try:
                train(job_spec(cfg, mode), sink)
            except ConfigError as e:
                refused[mode] = str(e)
                return float("nan")
            wall[mode].append(_median_interval([e["time"] for e in events if e["event"] == "step"], cfg["skip"]))
            memory[mode] += [e["measured"]["activations"] for e in events if e["event"] == "memory"]
            return _median_interval(cpu, cfg["skip"])
        return measure

    step_s = interleave({m: once(m) for m in MODES}, reps=cfg["reps"], warmup=0)
    rows = {}
    for mode in MODES:
        if mode in refused:
            rows[mode] = {"measured": NOT_AVAILABLE, "reason": refused[mode]}
            continue
        rows[mode] = {"step_s": stats(step_s[mode]), "wall_step_s": stats(wall[mode]), "activations": max(memory[mode]),
                      "predicted_activations": _predicted(job_spec(cfg, mode))}
    base = rows["none"]
    for r in rows.values():
        if "step_s" in r and "step_s" in base:
            r["memory_saved"] = 1 - r["activations"] / base["activations"]
            r["time_added"] = r["step_s"]["median"] / base["step_s"]["median"] - 1
            r["time_added_wall"] = r["wall_step_s"]["median"] / base["wall_step_s"]["median"] - 1
    return {"config": cfg, "modes": rows, "step_s_raw": step_s}


def _median_interval(times: list[float], skip: int) -> float:
    return statistics.median(b - a for a, b in zip(times[skip:], times[skip + 1:]))


def _predicted(spec: dict) -> int | str:
    try:
        from workbench.memory import estimate_memory
    except ImportError:
        return NOT_AVAILABLE
    return int(estimate_memory(spec).to_dict()["per_rank"][0]["activations"])


def summary_rows(result: dict) -> list[list]:
    out = []
    for mode in ("selective", "every-2", "full"):
        r = result["modes"][mode]
        if "memory_saved" not in r:
            out.append(["e) act. ckpt", f"{mode}: memory saved / time added", NOT_AVAILABLE, "", ""])
            continue
        out.append(["e) act. ckpt", f"{mode}: activation memory saved", r["memory_saved"], "", ""])
        out.append(["e) act. ckpt", f"{mode}: step time added (CPU; wall {r['time_added_wall']:+.1%})", r["time_added"],
                    f"{r['step_s']['min']:.3g}..{r['step_s']['max']:.3g} s", ""])
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    result = run(args.quick)
    path = write_result("activation_ckpt", result)
    rows = []
    for mode, r in result["modes"].items():
        if "step_s" not in r:
            rows.append([mode, "-", "-", "-", "-", "-"])
            continue
        pred = r["predicted_activations"]
        rows.append([mode, mib(r["activations"]), mib(pred) if isinstance(pred, int) else pred, r["step_s"]["median"],
                     r.get("memory_saved", float("nan")), r.get("time_added", float("nan"))])
    print(table(rows, ["mode", "activations MiB", "predicted MiB", "CPU s/step", "memory saved", "time added"]))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
