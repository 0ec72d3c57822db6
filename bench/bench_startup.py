"""(s) Start-up: launch to the end of step 1 of `workbench run` on a warm machine, against torchrun.

Three arms run the same spec (bench_throughput's gpt-mini dp=2, two steps), alternating:
  first job  `workbench.launch.start` and its events followed to step 1 (what `workbench.run`
             does) on the embedded Ray cluster this process started before the first round; the
             relays a previous job left are released first, so it starts them as a driver's first
             job does;
  again      the same, right after a job of the same shape in the same driver (the notebook that
             runs twice: relays and rank processes kept, backends/ray_warm.py);
  torchrun   bench/plain_ddp.py under `python -m bench.torchrun --standalone`, the plain DDP script.
The workbench arms time launch to the arrival of step 1's event on this process's monotonic clock
and take the phases from the run's `startup` event (workbench/startup.py: the driver's phases on
its clock, each rank's as durations on its own). The torchrun arm compares the wall clock at launch
with its rank 0's at the end of step 1: one host, one clock (as bench_throughput does). After each
workbench arm the kept rank processes finish their imports before the next arm starts, so that no
arm competes with another's start. Also reported: each rank's process CPU seconds at the end of
step 1 (imports included), a figure the machine's load moves much less than wall time.
Run: python -m bench.bench_startup [--quick] [--reps N]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import interleave, machine, median_ci, paired_ratios, stats, table, tiny_spec, write_result

GOAL = 1.3  # launch to step 1 of `workbench run` / torchrun's
ARMS = ("first job", "again", "torchrun")


def config(quick: bool) -> dict:
    if quick:
        return {"spec": tiny_spec("gpt-tiny", train={"steps": 2, "global_batch": 8, "micro_batch": 2},
                                  layout={"dp": 2}), "reps": 1}
    return {"spec": tiny_spec("gpt-mini", train={"steps": 2, "global_batch": 8, "micro_batch": 2},
                              layout={"dp": 2}), "reps": 5}


def run_workbench(spec: dict, first_job: bool, timeout_s: float) -> dict:
    """One job through `workbench.launch.start`, followed to its end: launch to step 1's arrival and its `startup` event."""
    from backends import ray_warm
    from workbench.launch import start

    if first_job:
        ray_warm.release_warm()
    launched = time.monotonic()
    handle = start(spec)
    step_1, startup = None, None
    for event in handle.follow(timeout_s=timeout_s):
        if event["event"] == "step" and step_1 is None:
            step_1 = time.monotonic() - launched
        elif event["event"] == "startup":
            startup = event
    handle.raise_for_failure()
    if step_1 is None or startup is None:
        raise RuntimeError(f"the run ended without {'a step' if step_1 is None else 'a startup event'}")
    ray_warm.wait_ready()  # the kept rank processes' imports: not during the next arm
    cpu = [p["cpu_s"] for p in startup["ranks"].values()]
    return {"launch_to_step_1_s": step_1, "startup": startup, "rank_cpu_s": max(cpu)}


def run_torchrun(spec_path: Path, work: Path, world: int, timeout_s: float) -> dict:
    from bench.bench_throughput import run_plain

    launched = time.time()
    r = run_plain(spec_path, work, world, timeout_s)
    data = json.loads((work / "plain.json").read_text())
    cpu = [data["cpu_at_step_1_s"]] + [json.loads(Path(f"{work / 'plain.json'}.rank{i}").read_text())["cpu_at_step_1_s"]
                                       for i in range(1, world)]
    return {"launch_to_step_1_s": r["times"][0] - launched, "rank_cpu_s": max(cpu)}


def run(quick: bool = False, reps: int | None = None) -> dict:
    """Alternate the three arms `reps` rounds after one unmeasured round; the result dict."""
    from bench.bench_throughput import start_ray

    cfg = config(quick)
    spec, reps = cfg["spec"], reps or cfg["reps"]
    world, timeout_s = spec["layout"]["dp"], 600.0
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        work = Path(tmp)
        spec_path = work / "spec.json"
        spec_path.write_text(json.dumps(spec))
        arms = {"first job": lambda: run_workbench(spec, True, timeout_s),
                "again": lambda: run_workbench(spec, False, timeout_s),
                "torchrun": lambda: run_torchrun(spec_path, work, world, timeout_s)}

        def measure(name):
            def once():
                r = arms[name]()
                runs[name].append(r)
                return r["launch_to_step_1_s"]
            return once

        start_ray()  # once, before the first round: a warm machine
        raw = interleave({name: measure(name) for name in ARMS}, reps=reps, warmup=1)
    for name in ARMS:
        del runs[name][: len(runs[name]) - reps]  # the unmeasured round's
    return summarize(spec, raw, runs, load_before)


def summarize(spec: dict, raw: dict, runs: dict, load_before) -> dict:
    ratios = {f"{arm} / torchrun": paired_ratios(raw[arm], raw["torchrun"]) for arm in ARMS[:2]}
    cpu = {arm: [r["rank_cpu_s"] for r in runs[arm]] for arm in ARMS}
    phases = {arm: _median_phases([r["startup"] for r in runs[arm]]) for arm in ARMS[:2]}
    return {
        "config": {"model": spec["model"]["preset"], "dp": spec["layout"]["dp"], "steps": spec["train"]["steps"],
                   "reps": len(raw["torchrun"])},
        "machine": machine(), "load_average": [load_before[0], os.getloadavg()[0]],
        "launch_to_step_1_s": {arm: stats(v) for arm, v in raw.items()}, "raw": raw,
        "ratios": ratios, "ratio": {k: stats(v) for k, v in ratios.items()},
        "ratio_ci95": {k: median_ci(v) for k, v in ratios.items()},
        "rank_cpu_s": {arm: stats(v) for arm, v in cpu.items()}, "phases": phases, "goal": GOAL,
        "owners": {arm: _median_owners([r["startup"] for r in runs[arm]]) for arm in ARMS[:2]},
    }


def _median_phases(events: list[dict]) -> dict:
    """The median of each driver phase and each of rank 0's phases, as a `startup` event."""
    def med(dicts):
        return {k: statistics.median(d[k] for d in dicts if k in d) for k in dicts[0]}

    return {"event": "startup", "reused": events[0]["reused"], "driver": med([e["driver"] for e in events]),
            "ranks": {"0": med([e["ranks"]["0"] for e in events])},
            "launch_to_step_1_s": statistics.median(e["launch_to_step_1_s"] for e in events)}


def _median_owners(events: list[dict]) -> dict:
    from workbench.startup import by_owner

    owners = [by_owner(e) for e in events]
    return {k: statistics.median(o[k] for o in owners) for k in owners[0]}


def summary_rows(result: dict) -> list[list]:
    q = result["ratio"]["first job / torchrun"]
    a = result["ratio"]["again / torchrun"]
    goal = f"<= {result['goal']}"
    return [["s) start-up", "workbench run / torchrun, launch to step 1 (first job)", q["median"],
             f"{q['min']:.2f}..{q['max']:.2f}", goal],
            ["s) start-up", "same, the driver's second run (kept relays)", a["median"], f"{a['min']:.2f}..{a['max']:.2f}", goal]]


def section(r: dict, doc: str = "", img: str = "") -> str:
    """Markdown for docs/benchmarks.md (the integrator wires it into bench/report.py)."""
    title = "## s) Start-up: launch to the end of step 1"
    if not r or "phases" not in r:
        return f"{title}\n\nnot run\n"
    from workbench.startup import startup_rows

    cfg, lt = r["config"], r["launch_to_step_1_s"]
    first = {row[0]: row for row in startup_rows(r["phases"]["first job"])}
    again = {row[0]: row for row in startup_rows(r["phases"]["again"])}
    again = {name.replace(" (before launch)", " (overlapped)"): row for name, row in again.items()}
    rows = [[name, who, f"{sec:.2f}", f"{again[name][2]:.2f}" if name in again else "-"] for name, (_, who, sec) in
            ((n, row) for n, row in first.items())]
    ratio = {k: f"**{v['median']:.2f}x** ({v['min']:.2f}..{v['max']:.2f}, 95% interval of the median "
                f"{r['ratio_ci95'][k][0]:.2f}..{r['ratio_ci95'][k][1]:.2f})" for k, v in r["ratio"].items()}
    owners = "; ".join(f"{arm}: " + ", ".join(f"{k} {v:.1f} s" for k, v in o.items()) for arm, o in r["owners"].items())
    return "\n".join([
        title, "",
        f"Measured {r['machine']['date_utc']} on a {r['machine']['cpus']}-core machine (load average "
        f"{r['load_average'][0]:.1f} -> {r['load_average'][1]:.1f}); {cfg['model']} dp={cfg['dp']}, "
        f"{cfg['reps']} alternated rounds after an unmeasured one, the embedded Ray cluster already up. "
        "Medians (min..max).", "",
        "```", table([[arm, f"{s['median']:.2f}", f"{s['min']:.2f}..{s['max']:.2f}",
                       f"{r['rank_cpu_s'][arm]['median']:.2f}"] for arm, s in lt.items()],
                     ["arm", "launch to step 1 s", "spread", "rank CPU s at step 1"]), "```", "",
        f"workbench / torchrun: first job {ratio['first job / torchrun']}; the driver's second run "
        f"{ratio['again / torchrun']} (goal <= {r['goal']}x).", "",
        "Where the time goes (medians of the `startup` events; rank 0's phases, those marked overlapped ran "
        "while the driver waited for the relays and the store, or, for the second run, before its launch):", "",
        "```", table(rows, ["phase", "who", "first job s", "again s"]), "```", "",
        f"By owner, launch to step 1: {owners}.", ""])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny model, one round")
    p.add_argument("--reps", type=int, help="rounds (default 5)")
    args = p.parse_args(argv)
    result = run(args.quick, args.reps)
    path = write_result("startup", result)
    print(section(result))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
