"""(a, why) Who gets the CPU while ranks train: `workbench run` (local Ray) against the same runtime
under torchrun, every process's CPU time and context switches over the same steady window.

On a machine whose cores all run ranks, anything else that runs comes out of the ranks. This
splits the machine's CPU between the ranks, Ray's actors (the relays that start the ranks and
pass their events on, any other Ray worker process), Ray's daemons (raylet, GCS, agents) and the
rest, from /proc (psutil) at the start and end of steps `window` of a gpt-mini dp=2 run.
Run: python -m bench.bench_cpu_share [--quick] [--reps N]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_throughput import _env, start_ray
from bench.common import ROOT, interleave, stats, table, tiny_spec, write_result

GROUPS = ("ranks", "Ray actors", "Ray daemons", "other")
_DAEMONS = ("raylet", "gcs_server", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray/dashboard", "ray/_private",
            "ray/autoscaler")
_POLICIES = {getattr(os, f"SCHED_{n}"): n for n in ("OTHER", "BATCH", "IDLE") if hasattr(os, f"SCHED_{n}")}


def config(quick: bool) -> dict:
    if quick:
        # steps of ~25 ms: a window of ~2 s (each step's event reaches the driver as it happens)
        return {"spec": tiny_spec("gpt-tiny", train={"steps": 100, "global_batch": 8, "micro_batch": 2},
                                  layout={"dp": 2}), "window": (20, 90), "reps": 1}
    return {"spec": tiny_spec("gpt-mini", train={"steps": 110, "global_batch": 8, "micro_batch": 2},
                              layout={"dp": 2}), "window": (20, 100), "reps": 3}


def group(cmdline: str) -> str:
    launcher = "torch.distributed.run" in cmdline or "bench.torchrun" in cmdline  # torchrun's agent, not a rank
    if "_rank_main" in cmdline or ("workbench.cloud_entry" in cmdline and not launcher):
        return "ranks"
    if any(d in cmdline for d in _DAEMONS):
        return "Ray daemons"
    if cmdline.startswith("ray::"):
        return "Ray actors"
    return "other"


def label(cmdline: str) -> str:
    """A command line short enough for a table: no interpreter or site-packages paths, and an
    actor named by its class (Ray retitles it `ray::Class.method` while a call runs)."""
    short = re.sub(r"\S*site-packages/", "", cmdline.replace(sys.executable, "python"))
    return re.sub(r"^(ray::\w+)\.\w+", r"\1", short)[:64]


def snapshot() -> dict[int, tuple]:
    """pid -> (group, command, CPU seconds, context switches, scheduling policy), for every process
    of the machine. Only this process's descendants (the embedded cluster, torchrun and their
    ranks) can be ranks, Ray actors or Ray daemons: another job's on the same machine is "other"."""
    import psutil

    ours = {p.pid for p in psutil.Process().children(recursive=True)}
    out = {}
    for p in psutil.process_iter(["cmdline", "name"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [p.info["name"] or ""]).strip()  # Ray pads its titles
            t, c = p.cpu_times(), p.num_ctx_switches()
            policy = _POLICIES.get(os.sched_getscheduler(p.pid), "?") if _POLICIES else "?"
            grp = group(cmd) if p.pid in ours else "other"
            out[p.pid] = (grp, label(cmd), t.user + t.system, c.voluntary + c.involuntary, policy)
        except (psutil.Error, OSError):  # exited between listing and reading, or not ours to read
            continue
    return out


class Window:
    """Snapshots at the ends of two steps, from the events as they arrive."""

    def __init__(self, first: int, last: int):
        self.first, self.last = first, last
        self.snaps: dict[int, tuple[float, dict]] = {}
        self.step_times: dict[int, float] = {}
        self.rank_pids: set[int] = set()  # the job's rank processes, from the relays' worker events

    def see(self, event: dict) -> None:
        if event.get("event") == "worker" and "rank_pid" in event:
            self.rank_pids.add(event["rank_pid"])
        if event.get("event") == "step" and event["step"] in (self.first, self.last):
            self.snaps[event["step"]] = (time.monotonic(), snapshot())
            self.step_times[event["step"]] = event["time"]

    def result(self) -> dict:
        (t0, s0), (t1, s1) = self.snaps[self.first], self.snaps[self.last]
        wall = t1 - t0
        procs = []
        for pid, (grp, cmd, cpu, cs, policy) in s1.items():
            if pid in s0:
                procs.append({"pid": pid, "group": grp, "cmd": cmd, "cores": (cpu - s0[pid][2]) / wall,
                              "switches_per_s": (cs - s0[pid][3]) / wall, "policy": policy})
        for p in procs:  # this job's ranks only: the relays name theirs (worker events); without relays (torchrun)
            # a rank is a cloud_entry process. A rank process Ray keeps for a next job (backends/ray_warm.py) is other.
            mine = p["pid"] in self.rank_pids if self.rank_pids else "_rank_main" not in p["cmd"]
            if p["group"] == "ranks" and not mine:
                p["group"] = "other"
        ranks = [p for p in procs if p["group"] == "ranks"]
        ms = 1000 * (self.step_times[self.last] - self.step_times[self.first]) / (self.last - self.first)
        return {"ms_per_step": ms, "ranks": len(ranks), "rank_cores": statistics.mean(p["cores"] for p in ranks),
                "rank_switches_per_s": statistics.mean(p["switches_per_s"] for p in ranks),
                "cores": {g: sum(p["cores"] for p in procs if p["group"] == g) for g in GROUPS},
                "processes": sorted(procs, key=lambda p: -p["cores"])}


def run_workbench(spec: dict, window: tuple[int, int]) -> dict:
    from workbench.launch import start

    w = Window(*window)
    handle = start(spec)
    for event in handle.follow(timeout_s=900):
        w.see(event)
    handle.raise_for_failure()
    return w.result()


def run_torchrun(spec: dict, window: tuple[int, int]) -> dict:
    w = Window(*window)
    with tempfile.TemporaryDirectory(prefix="bench-cpu-") as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "bench.torchrun", "--standalone", f"--nproc_per_node={spec['layout']['dp']}",
               "-m", "workbench.cloud_entry", "--spec", str(path)]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for line in proc.stdout:
            if line.startswith("{"):
                w.see(json.loads(line))
        if proc.wait() != 0:
            raise RuntimeError(f"torchrun exited with {proc.returncode}")
    return w.result()


ARMS = ("workbench", "runtime")


def run(quick: bool = False, reps: int | None = None) -> dict:
    cfg = config(quick)
    spec, window = cfg["spec"], cfg["window"]
    reps = reps or cfg["reps"]
    rounds: dict[str, list[dict]] = {name: [] for name in ARMS}
    arms = {"workbench": lambda: run_workbench(spec, window), "runtime": lambda: run_torchrun(spec, window)}

    def measure(name):
        def once():
            r = arms[name]()
            rounds[name].append(r)
            return r["ms_per_step"]
        return once

    start_ray()  # the embedded cluster is up (idle) through the torchrun rounds too, as in (a)
    interleave({name: measure(name) for name in ARMS}, reps=reps, warmup=0)
    import ray

    ray.shutdown()
    summary = {name: {"ms_per_step": stats([r["ms_per_step"] for r in rs]),
                      "rank_cores": stats([r["rank_cores"] for r in rs]),
                      "rank_switches_per_s": stats([r["rank_switches_per_s"] for r in rs]),
                      "cores": {g: stats([r["cores"][g] for r in rs])["median"] for g in GROUPS}}
               for name, rs in rounds.items()}
    return {"config": {"model": spec["model"]["preset"], "dp": spec["layout"]["dp"], "window": list(window),
                       "reps": reps},
            "arms": summary, "rounds": rounds}


def summary_rows(result: dict) -> list[list]:
    a = result["arms"]
    return [["a) CPU share", "rank's cores, workbench run / torchrun",
             a["workbench"]["rank_cores"]["median"] / a["runtime"]["rank_cores"]["median"], "", "1.0"]]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny model, one round")
    p.add_argument("--reps", type=int, help="rounds per arm (default 3)")
    args = p.parse_args(argv)
    result = run(args.quick, args.reps)
    path = write_result("cpu_share", result)
    rows = [[name, a["ms_per_step"]["median"], a["rank_cores"]["median"], a["rank_switches_per_s"]["median"],
             *(a["cores"][g] for g in GROUPS)] for name, a in result["arms"].items()]
    print(table(rows, ["arm", "ms/step", "cores per rank", "switches/s per rank", *(f"{g} (cores)" for g in GROUPS)]))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
