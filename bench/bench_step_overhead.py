"""(m) Per-step overhead (#35 item 3): the stop acknowledgement of the local Ray backend, and the
metrics and memory meters, each against the same job without it, in one script.

Stop acknowledgement: the same job (gpt-tiny, gpt-mini; dp 1) alternated in two arms: through the
local Ray backend, rank 0 deciding after step S once it holds the driver's acknowledgement of step
S - k + 1 (k = `STOP_WITHIN_STEPS`), and the loop in this process with a no-op sink and
`should_stop` False (no relay, no acknowledgement). The arm that waited for every step's
acknowledgement (before #35: 4.3-4.4 ms a step on 3 December, 14:33) is gone with k = 1: the
decision now precedes the step's report (one all-reduce carries the loss and the stop). Per step, from rank 0's step events: the interval between consecutive
steps' end times, and the gap, that interval less the step's own time (`step_time_s`): what the
loop does between two steps (events out, the stop poll and the acknowledgement wait, the memory
event every MEMORY_EVERY steps), far less noisy than whole steps on a shared machine.

Meters: the in-process loop with memory events every MEMORY_EVERY steps against none after step 1
(whole runs, alternated), and the meters' parts alone, timed in a loop: one memory measurement,
the loop's per-step clock reads, the peak reset, the inactive saved-tensor context.
Run: python -m bench.bench_step_overhead [--quick]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from bench.common import interleave, machine, stats, table, tiny_spec, write_result

GOAL_ACK_S = 1e-3  # the stop acknowledgement's cost per step
GOAL_METERS = 0.01  # the meters' share of a gpt-mini step
ARMS = ("relay, stop within k steps", "loop, no relay")


def config(quick: bool) -> dict:
    if quick:
        return {"models": {"gpt-tiny": 8}, "skip": 2, "reps": 1, "global_batch": 4, "micro_batch": 2, "iters": 20}
    return {"models": {"gpt-tiny": 40, "gpt-mini": 12}, "skip": 3, "reps": 3, "global_batch": 4, "micro_batch": 2,
            "iters": 200}


def _steady(events: list[dict], skip: int) -> dict:
    """Per steady step (after `skip`): the interval since the previous step's end, and that
    interval less the step's own time (the loop's work between steps)."""
    steps = [e for e in events if e["event"] == "step"]
    pairs = list(zip(steps[skip:], steps[skip + 1:]))
    interval = [b["time"] - a["time"] for a, b in pairs]
    return {"interval": interval, "gap": [i - b["step_time_s"] for i, (_, b) in zip(interval, pairs)],
            "steps": len(steps)}


def _spec(cfg: dict, preset: str) -> dict:
    return tiny_spec(preset, name=f"overhead-{preset}",
                     train={"steps": cfg["models"][preset], "global_batch": cfg["global_batch"],
                            "micro_batch": cfg["micro_batch"]})


def _relay_run(spec: dict) -> list[dict]:
    """One job on the local Ray backend."""
    from backends.local_ray import LocalRayJob
    from workbench.spec import load_spec

    job = LocalRayJob(load_spec(spec))
    status = job.wait(timeout_s=900)
    if status.state.value != "completed":
        raise RuntimeError(f"the relay run ended {status.state.value}: {status.message}")
    return job.events


def _loop_run(spec: dict, memory_events: bool = True) -> list[dict]:
    """The loop in this process, a no-op sink (events kept for their times), never stopping.
    `memory_events` False: none after step 1 (MEMORY_EVERY beyond the run)."""
    from workbench.runtime import loop

    events: list[dict] = []
    every = loop.MEMORY_EVERY
    if not memory_events:
        loop.MEMORY_EVERY = 10**9
    try:
        loop.train(spec, events.append, should_stop=lambda: False)
    finally:
        loop.MEMORY_EVERY = every
    return events


def acknowledgement(cfg: dict) -> dict:
    """The two arms per model, alternated; per run the median interval and gap."""
    from backends.ray_relay import STOP_WITHIN_STEPS

    out: dict = {"stop_within_steps": STOP_WITHIN_STEPS, "models": {}}
    for preset in cfg["models"]:
        spec = _spec(cfg, preset)
        runs: dict[str, list[dict]] = {a: [] for a in ARMS}

        def arm(name, fn):
            def once():
                r = _steady(fn(), cfg["skip"])
                runs[name].append(r)  # noqa: B023 (called in this iteration)
                return statistics.median(r["interval"])
            return once

        interleave({ARMS[0]: arm(ARMS[0], lambda: _relay_run(spec)),  # noqa: B023
                    ARMS[1]: arm(ARMS[1], lambda: _loop_run(spec))},  # noqa: B023
                   reps=cfg["reps"], warmup=1)
        runs = {a: r[1:] for a, r in runs.items()}  # the warm-up round's runs are not measurements
        m = {"runs": runs,
             "interval_s": {a: stats([statistics.median(r["interval"]) for r in runs[a]]) for a in ARMS},
             "gap_s": {a: stats([statistics.median(r["gap"]) for r in runs[a]]) for a in ARMS}}
        # paired by round: the ratio compares runs taken side by side
        m["ratio_relay_over_loop"] = stats([statistics.median(x["interval"]) / statistics.median(y["interval"])
                                            for x, y in zip(runs[ARMS[0]], runs[ARMS[1]])])
        # the acknowledgement's cost per step: the relay's gap beyond the in-process loop's
        m["ack_cost_s"] = stats([statistics.median(x["gap"]) - statistics.median(y["gap"])
                                 for x, y in zip(runs[ARMS[0]], runs[ARMS[1]])])
        out["models"][preset] = m
    return out


def meters(cfg: dict) -> dict:
    """Memory events on / off in whole in-process runs (alternated), and the meters' parts alone."""
    import torch

    from workbench.runtime import loop
    from workbench.spec import load_spec

    preset = "gpt-mini" if "gpt-mini" in cfg["models"] else "gpt-tiny"
    spec = _spec(cfg, preset)
    runs: dict[str, list[dict]] = {"meters on": [], "meters off": []}

    def arm(name, on):
        def once():
            r = _steady(_loop_run(spec, memory_events=on), cfg["skip"])
            runs[name].append(r)
            return statistics.mean(r["interval"])  # the mean: one step in MEMORY_EVERY measures
        return once

    whole = interleave({"meters on": arm("meters on", True), "meters off": arm("meters off", False)},
                       reps=cfg["reps"], warmup=1)
    runs = {a: r[1:] for a, r in runs.items()}  # the warm-up round's
    ratio = stats([a / b - 1 for a, b in zip(whole["meters on"], whole["meters off"])])

    # the parts, on this model after one step (optimizer state exists)
    run = loop._setup(load_spec(spec), lambda e: None, loop._Started(None, 0.0))
    loop._step(run, 1, 1, lambda e: None)
    meter, mods = run.meter, run.parallelized.modules
    meter.active = False  # as on every step after the first

    def measure():
        held = run.step_fn.measured_states()
        meter.measure(mods, held["optimizer"], master=held["master"], offloaded=held["offloaded"],
                      params_are_master=run.parallelized.params_are_master)

    def saving():
        with meter.saving():
            pass

    def timed(fn, n):
        def once():
            start = time.perf_counter()
            for _ in range(n):
                fn()
            return (time.perf_counter() - start) / n
        return once

    n = cfg["iters"]
    parts = interleave({"memory measurement": timed(measure, max(5, n // 10)),
                        "clock reads (2 process_time, perf_counter, time)": timed(
                            lambda: (time.process_time(), time.process_time(), time.perf_counter(), time.time()), n * 10),
                        "peak reset": timed(meter.reset_peak, n * 10),
                        "saved-tensor context, inactive": timed(saving, n * 10)}, reps=max(3, cfg["reps"]))
    parts_s = {k: stats(v) for k, v in parts.items()}
    step_s = stats([statistics.median(r["interval"]) for r in runs["meters off"]])["median"]
    per_step = (parts_s["memory measurement"]["median"] / loop.MEMORY_EVERY
                + sum(v["median"] for k, v in parts_s.items() if k != "memory measurement"))
    return {"preset": preset, "device": str(run.ctx.device), "cuda": torch.cuda.is_available(),
            "runs": runs, "whole_overhead": ratio, "parts_s": parts_s, "memory_every": loop.MEMORY_EVERY,
            "step_s": step_s, "parts_per_step_s": per_step, "parts_share": per_step / step_s}


def run(quick: bool = False) -> dict:
    import torch

    cfg = config(quick)
    load = os.getloadavg()[0]
    # one intra-op thread, as each rank has (Ray sets OMP_NUM_THREADS to its 1 CPU): two threads
    # in this process on a loaded 2-core machine made the in-process arm 100x slower (OpenMP spin)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = {"config": cfg, "ack": acknowledgement(cfg), "meters": meters(cfg), "goal_ack_s": GOAL_ACK_S,
                  "goal_meters": GOAL_METERS, "machine": machine()}
    finally:
        torch.set_num_threads(threads)
    result["load_average"] = [load, os.getloadavg()[0]]
    return result


def summary_rows(result: dict) -> list[list]:
    rows = []
    for preset, m in result["ack"]["models"].items():
        c, q = m["ack_cost_s"], m["ratio_relay_over_loop"]
        rows.append(["m) step overhead", f"{preset}: relay / loop without relay", q["median"],
                     f"{q['min']:.3f}..{q['max']:.3f}", ""])
        rows.append(["m) step overhead", f"{preset}: relay, gap beyond the loop's, ms", c["median"] * 1e3,
                     f"{c['min'] * 1e3:.2f}..{c['max'] * 1e3:.2f}", f"< {result['goal_ack_s'] * 1e3:g} ms"])
    mt = result["meters"]
    rows.append(["m) step overhead", f"{mt['preset']}: meters' parts / step", mt["parts_share"], "",
                 f"< {result['goal_meters']:.0%}"])
    rows.append(["m) step overhead", f"{mt['preset']}: whole runs, meters on / off - 1", mt["whole_overhead"]["median"],
                 f"{mt['whole_overhead']['min']:+.3f}..{mt['whole_overhead']['max']:+.3f}", f"< {result['goal_meters']:.0%}"])
    return rows


def section(r: dict, doc: str = "", img: str = "") -> str:
    """Markdown for docs/benchmarks.md (the integrator wires it into bench/report.py)."""
    title = "## m) Per-step overhead: the stop acknowledgement and the meters"
    if not r or "ack" not in r:
        return f"{title}\n\nnot run\n"
    a, mt = r["ack"], r["meters"]
    k = a["stop_within_steps"]
    lines = [title, "",
             f"Measured {r['machine']['date_utc']} on a {r['machine']['cpus']}-core machine, load average "
             f"{r['load_average'][0]:.1f} -> {r['load_average'][1]:.1f}; {r['config']['reps']} alternated rounds "
             f"(median, min..max). One job, dp 1, two arms: through the local Ray backend, rank 0 deciding after "
             f"step S once it holds the driver's acknowledgement of step S - {k - 1} (a cancel made at step N stops "
             f"every rank after step N + {k} at the latest), and the loop in one process without relay. Gap: a "
             "step's interval less its own step time, the loop's work between steps.", ""]
    for preset, m in a["models"].items():
        rows = [[arm, f"{m['interval_s'][arm]['median'] * 1e3:.1f}",
                 f"{m['interval_s'][arm]['min'] * 1e3:.1f}..{m['interval_s'][arm]['max'] * 1e3:.1f}",
                 f"{m['gap_s'][arm]['median'] * 1e3:.2f}",
                 f"{m['gap_s'][arm]['min'] * 1e3:.2f}..{m['gap_s'][arm]['max'] * 1e3:.2f}"] for arm in ARMS]
        lines += [f"{preset}:", "", "```", table(rows, ["arm", "step ms", "spread", "gap ms", "spread"]), "```", "",
                  f"Paired by round: relay / loop **{m['ratio_relay_over_loop']['median']:.3f}x** "
                  f"({m['ratio_relay_over_loop']['min']:.3f}..{m['ratio_relay_over_loop']['max']:.3f}). The "
                  f"acknowledgement's cost per step (gap beyond the loop's): **{m['ack_cost_s']['median'] * 1e3:.2f} ms** "
                  f"(goal < {r['goal_ack_s'] * 1e3:g} ms).", ""]
    parts = [[k_, f"{v['median'] * 1e6:.1f}", f"{v['min'] * 1e6:.1f}..{v['max'] * 1e6:.1f}"]
             for k_, v in mt["parts_s"].items()]
    lines += [f"Meters on {mt['preset']} ({mt['device']}; step {mt['step_s'] * 1e3:.0f} ms), the parts alone:", "",
              "```", table(parts, ["part", "us per call", "spread"]), "```", "",
              f"Per step (one measurement per {mt['memory_every']} steps, the rest every step): "
              f"{mt['parts_per_step_s'] * 1e6:.0f} us, **{mt['parts_share']:.3%}** of the step (goal < "
              f"{r['goal_meters']:.0%}). Whole runs, memory events on / off: {mt['whole_overhead']['median']:+.2%} "
              f"({mt['whole_overhead']['min']:+.2%}..{mt['whole_overhead']['max']:+.2%}; within the machine's noise).",
              ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    result = run(args.quick)
    path = write_result("step_overhead", result)
    print(table([[r[1], r[2] if isinstance(r[2], str) else f"{r[2]:.4f}", r[3], r[4]] for r in summary_rows(result)],
                ["figure", "median", "spread", "goal"]))
    print(section(result))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
