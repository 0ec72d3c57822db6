"""(f) What metrics collection and checkpointing cost per step, in one process.

Whole runs, alternated: the runtime loop with a JSONL sink (as `workbench run` writes), the same
with a no-op sink, a plain PyTorch loop on the same model and data, and the runtime saving a
checkpoint every few steps. Then the metrics' parts alone: the saved-tensor hooks of the memory
meter, one memory measurement, one JSONL event. Time is this process's CPU time per step (robust
on a shared machine), with the wall clock beside it.
Run: python -m bench.bench_overhead [--quick]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import interleave, stats, table, tiny_spec, write_result

GOAL_METRICS = 0.02


def config(quick: bool) -> dict:
    if quick:
        return {"preset": "gpt-tiny", "steps": 5, "skip": 1, "global_batch": 4, "micro_batch": 2, "reps": 1,
                "ckpt_every": 2, "iters": 3}
    return {"preset": "gpt-mini", "steps": 26, "skip": 4, "global_batch": 4, "micro_batch": 2, "reps": 10,
            "ckpt_every": 5, "iters": 5}


def _intervals(times: list[float], skip: int) -> list[float]:
    return [b - a for a, b in zip(times[skip:], times[skip + 1:])]


def whole_runs(cfg: dict, tmp: Path) -> dict:
    """Runtime (JSONL sink / no-op sink / checkpointing) and the plain loop, alternated.

    Each run records, at every step end, the wall clock and this process's CPU time. CPU time
    is the primary measure: on a shared machine, other processes stretch wall time at random,
    but the work a step does (all that an added hook or sink can add here) shows in CPU time.
    """
    from bench.plain_loop import train_plain
    from workbench.runtime.loop import train

    spec = tiny_spec(cfg["preset"], train={"steps": cfg["steps"], "global_batch": cfg["global_batch"],
                                           "micro_batch": cfg["micro_batch"]})
    ckpt_name = f"runtime, checkpoint every {cfg['ckpt_every']}"
    runs: dict[str, list[dict]] = {}

    def keep(name, wall, cpu, checkpoints=0):
        runs.setdefault(name, []).append({"wall": _intervals(wall, cfg["skip"]), "cpu": _intervals(cpu, cfg["skip"]),
                                          "checkpoints": checkpoints})
        return statistics.mean(runs[name][-1]["cpu"])

    def runtime(name, spec_, write_jsonl):
        def once():
            events, cpu = [], []
            f = open(tmp / "metrics.jsonl", "w") if write_jsonl else None

            def sink(e):
                if e["event"] == "step":
                    cpu.append(time.process_time())
                events.append(e)
                if f is not None:  # what `workbench run --metrics-out` does with each event
                    f.write(json.dumps(e) + "\n")
                    f.flush()
            train(spec_, sink)
            if f is not None:
                f.close()
            wall = [e["time"] for e in events if e["event"] == "step"]
            return keep(name, wall, cpu, sum(e["event"] == "checkpoint" for e in events))
        return once

    def plain():
        r = train_plain(spec)
        return keep("plain loop", r["times"], r["cpu_times"])

    ckpt_spec = {**spec, "checkpoint": {"every_steps": cfg["ckpt_every"], "uri": str(tmp / "ckpt"), "keep": 1}}
    variants = {"runtime, JSONL sink": runtime("runtime, JSONL sink", spec, True),
                "runtime, no-op sink": runtime("runtime, no-op sink", spec, False),
                "plain loop": plain,
                ckpt_name: runtime(ckpt_name, ckpt_spec, True)}
    interleave(variants, reps=cfg["reps"], warmup=1)
    if not all(r["checkpoints"] for r in runs[ckpt_name]):
        raise RuntimeError(f"'{ckpt_name}' wrote no checkpoint: the variant would measure nothing")
    out = {"checkpoint_name": ckpt_name, "runs": runs}
    for clock in ("cpu", "wall"):
        # mean over steps catches periodic costs (memory events, checkpoints); median resists spikes
        out[f"{clock}_mean_step_s"] = {k: stats([statistics.mean(r[clock]) for r in v]) for k, v in runs.items()}
        out[f"{clock}_median_step_s"] = {k: stats([statistics.median(r[clock]) for r in v]) for k, v in runs.items()}
    return out


def components(cfg: dict) -> dict:
    """The metrics' parts alone, on the same model: hooks, one measurement, one JSONL event."""
    import torch
    import torch.nn.functional as F

    from workbench.parallel.materialize import build_model
    from workbench.runtime.loop import MEMORY_EVERY
    from workbench.runtime.meter import MemoryMeter
    from workbench.spec import load_spec

    spec = tiny_spec(cfg["preset"])
    seq = load_spec(spec).model.shape().seq_len
    model = build_model(spec)
    opt = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 256, (cfg["micro_batch"], seq + 1), generator=torch.Generator().manual_seed(0))
    meter = MemoryMeter(torch.device("cpu"))
    meter.watch_params([model])

    def fwd_bwd():
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()

    def metered():
        with meter.saving():
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        meter.released()

    fwd_bwd()
    opt.step()  # optimizer state exists, as in a real measurement

    def timed(fn, iters):
        def once():
            start = time.process_time()
            for _ in range(iters):
                fn()
            return (time.process_time() - start) / iters
        return once

    with tempfile.TemporaryFile("w") as f:
        def event():
            f.write(json.dumps({"event": "step", "step": 1, "loss": 1.0, "tokens_per_s": 1.0, "step_time_s": 1.0}) + "\n")
            f.flush()

        t = interleave({"fwd+bwd": timed(fwd_bwd, cfg["iters"]), "fwd+bwd, meter hooks": timed(metered, cfg["iters"]),
                        "memory measurement": timed(lambda: meter.measure([model], opt), 20),
                        "JSONL event": timed(event, 200)}, reps=max(3, cfg["reps"] * 2))
    s = {k: stats(v) for k, v in t.items()}
    hooks = s["fwd+bwd, meter hooks"]["median"] - s["fwd+bwd"]["median"]
    return {"times": s, "hook_cost_per_micro_batch_s": hooks,
            "hook_share_of_fwd_bwd": hooks / s["fwd+bwd"]["median"],
            "measure_per_step_s": s["memory measurement"]["median"] / MEMORY_EVERY, "memory_every": MEMORY_EVERY}


def run(quick: bool = False) -> dict:
    cfg = config(quick)
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        whole = whole_runs(cfg, Path(tmp))
    parts = components(cfg)

    def overhead(clock, a, b):
        """Median over rounds of run a / run b - 1, each round's runs taken side by side (paired)."""
        per_round = [statistics.mean(x[clock]) / statistics.mean(y[clock]) - 1
                     for x, y in zip(whole["runs"][a], whole["runs"][b])]
        return statistics.median(per_round)

    ck = whole["checkpoint_name"]
    return {"config": cfg, "whole": whole, "components": parts,
            "metrics_overhead": overhead("cpu", "runtime, JSONL sink", "plain loop"),
            "metrics_overhead_wall": overhead("wall", "runtime, JSONL sink", "plain loop"),
            "sink_overhead": overhead("cpu", "runtime, JSONL sink", "runtime, no-op sink"),
            "checkpoint_overhead": overhead("cpu", ck, "runtime, JSONL sink"),
            "checkpoint_overhead_wall": overhead("wall", ck, "runtime, JSONL sink"),
            "goal_metrics": GOAL_METRICS}


def summary_rows(result: dict) -> list[list]:
    every = result["config"]["ckpt_every"]
    return [["f) overhead", "runtime (metrics on, JSONL) vs plain loop, CPU s/step", result["metrics_overhead"], "",
             f"< {GOAL_METRICS:.0%}"],
            ["f) overhead", "same, wall-clock median step", result["metrics_overhead_wall"], "", f"< {GOAL_METRICS:.0%}"],
            ["f) overhead", "meter hooks / fwd+bwd (CPU)", result["components"]["hook_share_of_fwd_bwd"], "", ""],
            ["f) overhead", f"checkpoint every {every} steps, CPU s/step", result["checkpoint_overhead"], "", ""],
            ["f) overhead", f"checkpoint every {every} steps, wall s/step", result["checkpoint_overhead_wall"], "", ""]]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    result = run(args.quick)
    path = write_result("overhead", result)
    w = result["whole"]
    rows = [[k, s["median"], s["min"], s["max"], w["wall_median_step_s"][k]["median"]]
            for k, s in w["cpu_mean_step_s"].items()]
    print(table(rows, ["variant", "CPU s/step", "min", "max", "wall s/step (median)"]))
    print(table([[k, s["median"], s["min"], s["max"]] for k, s in result["components"]["times"].items()],
                ["part (CPU s)", "median", "min", "max"]))
    for row in summary_rows(result):
        print(f"{row[1]}: {row[2] if isinstance(row[2], str) else f'{row[2]:+.2%}'}")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
