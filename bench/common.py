"""Shared helpers of the benchmarks: interleaved repetitions, robust statistics, specs, results.

Every benchmark measures a figure against its peer in the same run, alternating the two so that
load from other processes on a shared machine hits both alike; we report medians and spread.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
NOT_AVAILABLE = "not available"


def stats(values: list[float]) -> dict:
    """Median and spread (min, max, quartiles) of repeated measurements."""
    vals = sorted(float(v) for v in values)
    if not vals:
        return {"n": 0, "median": float("nan"), "min": float("nan"), "max": float("nan"),
                "q1": float("nan"), "q3": float("nan")}
    if len(vals) >= 2:
        q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    else:
        q1 = q3 = vals[0]
    return {"n": len(vals), "median": statistics.median(vals), "min": vals[0], "max": vals[-1], "q1": q1, "q3": q3}


def interleave(named: dict[str, Callable[[], float]], reps: int, warmup: int = 1) -> dict[str, list[float]]:
    """Call each function `reps` times, alternating A B A B ... (order flipped every round).

    Args:
        named: name -> a function returning one measurement (seconds, bytes, ...).
        reps: measured rounds.
        warmup: unmeasured rounds first (allocator, caches, lazy imports).
    Returns:
        name -> the list of measurements, in round order.
    """
    names = list(named)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + reps):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            value = named[n]()
            if r >= warmup:
                out[n].append(value)
    return out


def paired_ratios(a: list[float], b: list[float]) -> list[float]:
    """a[i] / b[i] per round: each ratio compares runs taken side by side."""
    return [x / y for x, y in zip(a, b) if y]


def median_ci(values: list[float], level: float = 0.95, resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """Bootstrap confidence interval of the median (percentile method, seeded: reproducible)."""
    import random

    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - level) / 2
    return meds[int(tail * (resamples - 1))], meds[int((1 - tail) * (resamples - 1))]


def steady_tokens_per_s(times: list[float], tokens_per_step: int, skip: int) -> float:
    """Throughput between the end of step `skip` and the last step, from wall-clock step ends.

    Args:
        times: wall-clock time at the end of each step, in step order.
        tokens_per_step: tokens in one optimizer step (global batch x seq_len).
        skip: warm-up steps left out (process start, first allocations, lazy init).
    """
    if len(times) <= skip + 1:
        raise ValueError(f"need more than {skip + 1} steps to measure steady state, got {len(times)}")
    window = times[skip:]
    return tokens_per_step * (len(window) - 1) / (window[-1] - window[0])


def tiny_spec(preset: str = "gpt-tiny", **sections) -> dict:
    """A CPU spec dict; `sections` override whole keys, e.g. layout={"dp": 2}."""
    spec = {
        "name": "bench",
        "model": {"preset": preset},
        "data": {"source": "synthetic", "seed": 0},
        "train": {"steps": 10, "global_batch": 8, "micro_batch": 4, "optimizer": "adamw", "lr": 3e-4, "seed": 0},
        "layout": {"dp": 1},
        "resources": {"gpu": "cpu", "gpus_per_node": 1, "nodes": 1},
    }
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    world = spec["layout"].get("dp", 1) * spec["layout"].get("tp", 1) * spec["layout"].get("pp", 1)
    spec["resources"] = {**spec["resources"], "gpus_per_node": world}
    return spec


def machine() -> dict:
    """Where the numbers were taken: they mean little without it."""
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    import torch

    return {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
            "load_avg_1m": round(load[0], 2), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform()}


def write_result(name: str, result: dict, results_dir: Path | None = None) -> Path:
    """Write one benchmark's result as bench/results/<name>.json (with the machine it ran on)."""
    out_dir = Path(results_dir or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"name": name, "machine": machine(), **result}, indent=2, default=float) + "\n")
    return path


def read_result(name: str, results_dir: Path | None = None) -> dict | None:
    path = Path(results_dir or RESULTS) / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def table(rows: list[list], headers: list[str]) -> str:
    """A plain fixed-width text table."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value) -> str:
    if isinstance(value, float):
        if value != value:
            return "-"
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def mib(n_bytes: float) -> float:
    return n_bytes / 2**20


# How the benchmarks and the suite start a process they must be able to end with whatever it
# started: a process group of its own (`os.killpg(proc.pid, sig)` reaches them all), inside the
# caller's session. Not a session of its own: with Linux's autogroup (on by default,
# /proc/sys/kernel/sched_autogroup_enabled) every session is a scheduling group, and on this
# machine's kernel a process in another session than busy ones got 2-5 % of a core
# (docs/testing.md, "Under load"). Python 3.10 has no `process_group`; there a new session is
# the only way to a group of its own.
OWN_GROUP: dict = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}


def popen_own_group(*args, start_new_session: bool = False, **kwargs) -> subprocess.Popen:
    """`subprocess.Popen` for a launcher that asks for a session of its own (torchelastic for each
    rank, jupyter_client for each kernel): a process group of its own instead."""
    return subprocess.Popen(*args, **kwargs, **(OWN_GROUP if start_new_session else {}))
