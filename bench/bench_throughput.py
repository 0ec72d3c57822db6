"""(a) Steady-state tokens/s of `workbench run` (local Ray, DDP dp=2) against plain torchrun DDP.

Three arms run the same spec (same model, batches, shapes and optimizer):
  workbench  `workbench.run` (the function behind `workbench run`): embedded Ray, one relay
             actor per rank, the per-rank runtime with its metrics, memory meter and stop polling;
  runtime    the same per-rank runtime under torchrun (`-m workbench.cloud_entry`, as on a cloud
             or a GPU host without Ray): separates what Ray adds from what the runtime adds;
  torchrun   bench/plain_ddp.py under torchrun: the plain DDP script a user would write.
Runs alternate (A B C, C B A, ...) and each is timed from the wall-clock ends of its steps after a
warm-up, so process and Ray start-up are left out. Ratios are taken per round. The embedded Ray
cluster starts once and stays up, idle, through the torchrun arms too.
Run: python -m bench.bench_throughput [--quick] [--reps N]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import (
    ROOT,
    interleave,
    median_ci,
    paired_ratios,
    stats,
    steady_tokens_per_s,
    table,
    tiny_spec,
    write_result,
)

GOAL = 0.97


def config(quick: bool) -> dict:
    if quick:
        return {"spec": tiny_spec("gpt-tiny", train={"steps": 6, "global_batch": 8, "micro_batch": 2},
                                  layout={"dp": 2}), "skip": 2, "reps": 1}
    # Rounds are many and short: this VM's speed drifts by ~10% over tens of seconds, and a paired
    # ratio per round with a median over many rounds averages that drift out.
    return {"spec": tiny_spec("gpt-mini", train={"steps": 40, "global_batch": 8, "micro_batch": 2},
                              layout={"dp": 2}), "skip": 8, "reps": 20}


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def start_ray() -> None:
    """Start the embedded Ray cluster once, as `workbench run` does (backends.local_ray.ensure_ray,
    which retries a start that times out on a loaded machine and cleans up after it)."""
    from backends.local_ray import ensure_ray

    ensure_ray()


def run_workbench(spec_path: Path, work: Path, timeout_s: float) -> dict:
    """`workbench.run(spec, metrics_out=F)` (what `workbench run SPEC --metrics-out F` calls) on the
    embedded Ray cluster this process started; step ends from the step events."""
    from backends.ray_warm import wait_ready
    from workbench.launch import run as workbench_run

    metrics = work / "wb_metrics.jsonl"
    start_ray()
    workbench_run(str(spec_path), metrics_out=str(metrics), progress=False)
    wait_ready()  # the rank processes kept for the next job import torch now: not during the next arm
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = sorted((e for e in steps if e["event"] == "step"), key=lambda e: e["step"])
    return {"times": [e["time"] for e in steps], "losses": [e["loss"] for e in steps]}


def _torchrun(args: list[str], world: int, timeout_s: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "bench.torchrun", "--standalone", f"--nproc_per_node={world}", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def run_plain(spec_path: Path, work: Path, world: int, timeout_s: float) -> dict:
    """bench/plain_ddp.py under torchrun (python -m bench.torchrun --standalone)."""
    out = work / "plain.json"
    _torchrun([str(ROOT / "bench" / "plain_ddp.py"), "--spec", str(spec_path), "--out", str(out)], world, timeout_s)
    data = json.loads(out.read_text())
    per_rank = [data["losses"]] + [json.loads(Path(f"{out}.rank{r}").read_text())["losses"] for r in range(1, world)]
    losses = [sum(step) / world for step in zip(*per_rank)]  # the global-batch mean, as workbench reports
    return {"times": data["step_end_times"], "losses": losses, "threads": data["threads"]}


def run_runtime_torchrun(spec_path: Path, world: int, timeout_s: float) -> dict:
    """The per-rank runtime under torchrun (`-m workbench.cloud_entry`): its events are JSON lines on stdout."""
    proc = _torchrun(["-m", "workbench.cloud_entry", "--spec", str(spec_path)], world, timeout_s)
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    steps = sorted((e for e in events if e["event"] == "step"), key=lambda e: e["step"])
    return {"times": [e["time"] for e in steps], "losses": [e["loss"] for e in steps]}


ARMS = ("workbench", "runtime", "torchrun")
RATIOS = {"workbench / torchrun": ("workbench", "torchrun"), "runtime / torchrun": ("runtime", "torchrun"),
          "workbench / runtime": ("workbench", "runtime")}


def run(quick: bool = False, reps: int | None = None) -> dict:
    """Measure the three arms, alternating; return the result dict (also the JSON in bench/results)."""
    cfg = config(quick)
    spec, skip = cfg["spec"], cfg["skip"]
    reps = reps or cfg["reps"]
    world = spec["layout"]["dp"]
    from workbench.spec import load_spec

    tokens_per_step = spec["train"]["global_batch"] * load_spec(spec).model.shape().seq_len
    timeout_s = 120 + 20 * spec["train"]["steps"]
    runs: dict[str, list[dict | None]] = {name: [] for name in ARMS}
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-tput-") as tmp:
        work = Path(tmp)
        spec_path = work / "spec.json"
        spec_path.write_text(json.dumps(spec))
        arms = {"workbench": lambda: run_workbench(spec_path, work, timeout_s),
                "runtime": lambda: run_runtime_torchrun(spec_path, world, timeout_s),
                "torchrun": lambda: run_plain(spec_path, work, world, timeout_s)}

        def measure(name):
            def once():
                launched = time.time()
                try:
                    r = arms[name]()
                    r["startup_s"] = r["times"][0] - launched  # launch to the end of step 1
                except Exception as e:  # noqa: BLE001 - keep the other rounds; the reason is reported
                    failures.append(f"{name}: {str(e)[-300:]}")
                    runs[name].append(None)
                    return float("nan")
                runs[name].append(r)
                return steady_tokens_per_s(r["times"], tokens_per_step, skip)
            return once

        start_ray()  # once, before the first round: its start-up is not part of any measurement
        raw = interleave({name: measure(name) for name in ARMS}, reps=reps, warmup=0)
    import ray

    ray.shutdown()
    # Only rounds where every arm ran count: each ratio compares runs taken side by side.
    ok = [i for i in range(reps) if all(raw[name][i] == raw[name][i] for name in ARMS)]
    if not ok:
        raise RuntimeError("no round completed every arm: " + "; ".join(failures))
    tps = {k: [v[i] for i in ok] for k, v in raw.items()}
    done = {k: [v[i] for i in ok] for k, v in runs.items()}
    # Noise-robust second view: tokens / median step interval (load spikes from other processes
    # on a shared machine hit single steps; the median ignores them).
    med = {k: [tokens_per_step / statistics.median(_diffs(r["times"])[skip:]) for r in v] for k, v in done.items()}
    ratios = {label: paired_ratios(tps[a], tps[b]) for label, (a, b) in RATIOS.items()}
    med_ratios = {label: paired_ratios(med[a], med[b]) for label, (a, b) in RATIOS.items()}
    reference = done["torchrun"][0]["losses"]
    loss_gap = max(abs(a - b) for name in ("workbench", "runtime") for a, b in zip(done[name][0]["losses"], reference))
    return {
        "config": {"model": spec["model"]["preset"], "dp": world, "steps": spec["train"]["steps"],
                   "global_batch": spec["train"]["global_batch"], "micro_batch": spec["train"]["micro_batch"],
                   "warmup_steps_skipped": skip, "tokens_per_step": tokens_per_step, "reps": reps,
                   "rounds_completed": len(ok)},
        "tokens_per_s": tps,
        "arms": {k: stats(v) for k, v in tps.items()},
        "ratios": ratios,
        "ratio": {label: stats(v) for label, v in ratios.items()},
        "ratio_ci95": {label: median_ci(v) for label, v in ratios.items()},  # of the median, bootstrap
        "median_step": {"arms": {k: stats(v) for k, v in med.items()},
                        "ratio": {label: stats(v) for label, v in med_ratios.items()}, "ratios": med_ratios},
        "startup_s": {k: stats([r["startup_s"] for r in v]) for k, v in done.items()},
        "goal": GOAL,
        "max_loss_gap": loss_gap,  # the three do the same work: same losses up to reordering
        "step_times": {k: [_diffs(r["times"]) for r in v] for k, v in done.items()},
        "failed_rounds": failures,
    }


def _diffs(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def summary_rows(result: dict) -> list[list]:
    q, m = result["ratio"]["workbench / torchrun"], result["median_step"]["ratio"]["workbench / torchrun"]
    goal = f">= {result['goal']}"
    return [["a) throughput", "workbench run / torchrun tokens/s (steady window)", q["median"],
             f"{q['min']:.3f}..{q['max']:.3f}", goal],
            ["a) throughput", "same, from the median step time", m["median"], f"{m['min']:.3f}..{m['max']:.3f}", goal]]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps, one round")
    p.add_argument("--reps", type=int, help="rounds (default 20)")
    args = p.parse_args(argv)
    result = run(args.quick, args.reps)
    path = write_result("throughput", result)
    rows = [[name, *(result["arms"][name][k] for k in ("median", "min", "max"))] for name in ARMS]
    rows += [[label, *(q[k] for k in ("median", "min", "max"))] for label, q in result["ratio"].items()]
    rows += [[f"{label} (median step)", *(q[k] for k in ("median", "min", "max"))]
             for label, q in result["median_step"]["ratio"].items()]
    print(table(rows, ["tokens/s", "median", "min", "max"]))
    print(f"max |loss gap| = {result['max_loss_gap']:.2e}; wrote {path}")
    return result


if __name__ == "__main__":
    main()
