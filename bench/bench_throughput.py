"""(a) Steady-state tokens/s of `workbench run` (local Ray, DDP dp=2) against plain torchrun DDP.

Both run the same spec: same model, batches, shapes and optimizer. Runs alternate
(workbench, torchrun, torchrun, workbench, ...) and each is timed from the wall-clock ends of its
steps after a warm-up, so process and Ray start-up are left out. The ratio is taken per round.
`workbench.run` (the function behind the CLI) runs in this process, so the embedded Ray cluster
starts once and stays up, idle, during the torchrun rounds too.
Run: python -m bench.bench_throughput [--quick]
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

from bench.common import ROOT, interleave, paired_ratios, stats, steady_tokens_per_s, table, tiny_spec, write_result

GOAL = 0.97
RAY_START_ATTEMPTS = 6


def config(quick: bool) -> dict:
    if quick:
        return {"spec": tiny_spec("gpt-tiny", train={"steps": 6, "global_batch": 8, "micro_batch": 2},
                                  layout={"dp": 2}), "skip": 2, "reps": 1}
    return {"spec": tiny_spec("gpt-mini", train={"steps": 30, "global_batch": 8, "micro_batch": 2},
                              layout={"dp": 2}), "skip": 5, "reps": 3}


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def start_ray() -> None:
    """Start the embedded Ray cluster once, as `workbench run` does (backends.local_ray.ensure_ray).

    Ray waits a fixed 30 s for its raylet to register; on a heavily loaded machine that can
    time out ("timed out during startup"), which is not a training failure: start again.
    """
    import ray

    from backends.local_ray import ensure_ray

    for attempt in range(RAY_START_ATTEMPTS):
        try:
            ensure_ray()
            return
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
            if "timed out during startup" not in str(e) or attempt == RAY_START_ATTEMPTS - 1:
                raise
            ray.shutdown()
            time.sleep(5 * (attempt + 1))


def run_workbench(spec_path: Path, work: Path, timeout_s: float) -> dict:
    """`workbench.run(spec, metrics_out=F)` (what `workbench run SPEC --metrics-out F` calls) on the
    embedded Ray cluster this process started; step ends from the step events."""
    from workbench.launch import run as workbench_run

    metrics = work / "wb_metrics.jsonl"
    start_ray()
    workbench_run(str(spec_path), metrics_out=str(metrics), progress=False)
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = sorted((e for e in steps if e["event"] == "step"), key=lambda e: e["step"])
    return {"times": [e["time"] for e in steps], "losses": [e["loss"] for e in steps]}


def run_plain(spec_path: Path, work: Path, world: int, timeout_s: float) -> dict:
    """bench/plain_ddp.py under torchrun (python -m torch.distributed.run --standalone)."""
    out = work / "plain.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(ROOT / "bench" / "plain_ddp.py"), "--spec", str(spec_path), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    data = json.loads(out.read_text())
    per_rank = [data["losses"]] + [json.loads(Path(f"{out}.rank{r}").read_text())["losses"] for r in range(1, world)]
    losses = [sum(step) / world for step in zip(*per_rank)]  # the global-batch mean, as workbench reports
    return {"times": data["step_end_times"], "losses": losses, "threads": data["threads"]}


def run(quick: bool = False, reps: int | None = None) -> dict:
    """Measure both, alternating; return the result dict (also the JSON written to bench/results)."""
    cfg = config(quick)
    spec, skip = cfg["spec"], cfg["skip"]
    reps = reps or cfg["reps"]
    world = spec["layout"]["dp"]
    from workbench.spec import load_spec

    tokens_per_step = spec["train"]["global_batch"] * load_spec(spec).model.shape().seq_len
    timeout_s = 120 + 20 * spec["train"]["steps"]
    runs: dict[str, list[dict]] = {"workbench": [], "torchrun": []}
    with tempfile.TemporaryDirectory(prefix="bench-tput-") as tmp:
        work = Path(tmp)
        spec_path = work / "spec.json"
        spec_path.write_text(json.dumps(spec))

        def measure(name, fn):
            def once():
                try:
                    r = fn()
                except Exception as e:  # noqa: BLE001 - keep the other rounds; the reason is reported
                    failures.append(f"{name}: {str(e)[-300:]}")
                    runs[name].append(None)
                    return float("nan")
                runs[name].append(r)
                return steady_tokens_per_s(r["times"], tokens_per_step, skip)
            return once

        failures: list[str] = []
        start_ray()  # once, before the first round: its start-up is not part of any measurement
        raw = interleave({
            "workbench": measure("workbench", lambda: run_workbench(spec_path, work, timeout_s)),
            "torchrun": measure("torchrun", lambda: run_plain(spec_path, work, world, timeout_s)),
        }, reps=reps, warmup=0)
    import ray

    ray.shutdown()
    # Only rounds where both ran count: each ratio compares runs taken side by side.
    ok = [i for i in range(reps) if raw["workbench"][i] == raw["workbench"][i] and raw["torchrun"][i] == raw["torchrun"][i]]
    if not ok:
        raise RuntimeError("no round completed both runs: " + "; ".join(failures))
    tps = {k: [v[i] for i in ok] for k, v in raw.items()}
    runs = {k: [v[i] for i in ok] for k, v in runs.items()}
    ratios = paired_ratios(tps["workbench"], tps["torchrun"])
    # Noise-robust second view: tokens / median step interval (load spikes from other processes
    # on a shared machine hit single steps; the median ignores them).
    med = {k: [tokens_per_step / statistics.median(_diffs(r["times"])[skip:]) for r in v] for k, v in runs.items()}
    med_ratios = paired_ratios(med["workbench"], med["torchrun"])
    loss_gap = max(abs(a - b) for a, b in zip(runs["workbench"][0]["losses"], runs["torchrun"][0]["losses"]))
    return {
        "config": {"model": spec["model"]["preset"], "dp": world, "steps": spec["train"]["steps"],
                   "global_batch": spec["train"]["global_batch"], "micro_batch": spec["train"]["micro_batch"],
                   "warmup_steps_skipped": skip, "tokens_per_step": tokens_per_step, "reps": reps,
                   "rounds_completed": len(ok)},
        "tokens_per_s": {k: v for k, v in tps.items()},
        "workbench": stats(tps["workbench"]),
        "torchrun": stats(tps["torchrun"]),
        "ratio": stats(ratios),
        "ratios": ratios,
        "median_step": {"workbench": stats(med["workbench"]), "torchrun": stats(med["torchrun"]),
                        "ratio": stats(med_ratios), "ratios": med_ratios},
        "goal": GOAL,
        "max_loss_gap": loss_gap,  # the two do the same work: same losses up to reordering
        "step_times": {k: [_diffs(r["times"]) for r in v] for k, v in runs.items()},
        "failed_rounds": failures,
    }


def _diffs(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def summary_rows(result: dict) -> list[list]:
    r = result
    m = r["median_step"]["ratio"]
    return [["a) throughput", "workbench run / torchrun tokens/s (steady window)", r["ratio"]["median"],
             f"{r['ratio']['min']:.3f}..{r['ratio']['max']:.3f}", f">= {r['goal']}"],
            ["a) throughput", "same, from the median step time", m["median"], f"{m['min']:.3f}..{m['max']:.3f}",
             f">= {r['goal']}"]]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps, one round")
    p.add_argument("--reps", type=int, help="rounds (default 3)")
    args = p.parse_args(argv)
    result = run(args.quick, args.reps)
    path = write_result("throughput", result)
    w, t, q = result["workbench"], result["torchrun"], result["ratio"]
    print(table([["workbench run (Ray)", w["median"], w["min"], w["max"]],
                 ["torchrun plain DDP", t["median"], t["min"], t["max"]],
                 ["ratio", q["median"], q["min"], q["max"]],
                 ["ratio (median step)", result["median_step"]["ratio"]["median"], result["median_step"]["ratio"]["min"],
                  result["median_step"]["ratio"]["max"]]], ["tokens/s", "median", "min", "max"]))
    print(f"max |loss gap| = {result['max_loss_gap']:.2e}; wrote {path}")
    return result


if __name__ == "__main__":
    main()
