"""Run every benchmark, print one table, write bench/results/*.json, redraw the figures and
docs/benchmarks.md.

    .venv/bin/python -m bench.run_all            # everything (~35 min on a quiet 2-core VM)
    .venv/bin/python -m bench.run_all --quick    # tiny sizes, one round: checks the scripts run
    .venv/bin/python -m bench.run_all --only overhead,memory
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

from bench.common import NOT_AVAILABLE, RESULTS, table, write_result

# name -> module; in the order the issue lists them (a..f)
BENCHMARKS = {
    "throughput": "bench.bench_throughput",
    "cpu_share": "bench.bench_cpu_share",  # (a)'s why: who gets the cores
    "memory": "bench.bench_memory",
    "pipeline": "bench.bench_pipeline",
    "overlap": "bench.bench_overlap",
    "activation_ckpt": "bench.bench_activation_ckpt",
    "overhead": "bench.bench_overhead",
    "data": "bench.bench_data",  # (g) token shards and data prepare
    "tp": "bench.bench_tp",  # (h) tensor parallel on local shards vs DTensor's styles
    # (i) bench/bench_hf_load.py and (j) bench/bench_prediction.py run alone: 10 and 30 minutes
    "peers": "bench.bench_peers",  # (k) ZeRO, offload, TP, SP, PP against plain scripts and DeepSpeed
    "nvme": "bench.bench_nvme",  # (l) ZeRO-Infinity against CPU offload and none; file I/O against dd
    "step_overhead": "bench.bench_step_overhead",  # (m) the stop acknowledgement and the meters per step
    "startup": "bench.bench_startup",  # (s) launch to the end of step 1 against torchrun, by phase
}


def run_one(name: str, quick: bool, results_dir: Path) -> dict:
    """Run one benchmark; a failure is recorded as not available with its reason, not raised."""
    import importlib

    module = importlib.import_module(BENCHMARKS[name])
    start = time.monotonic()
    try:
        result = module.run(quick)
    except Exception as e:  # noqa: BLE001 - one broken benchmark must not hide the others
        result = {"status": NOT_AVAILABLE, "reason": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc()[-4000:]}
    result["wall_s"] = time.monotonic() - start
    result["quick"] = quick
    write_result(name, result, results_dir)
    return result


def summary(results: dict[str, dict]) -> str:
    import importlib

    rows = []
    for name, result in results.items():
        if result.get("status") == NOT_AVAILABLE:
            rows.append([name, NOT_AVAILABLE, "", "", result["reason"][:80]])
            continue
        for row in importlib.import_module(BENCHMARKS[name]).summary_rows(result):
            rows.append([row[0], row[1], row[2] if isinstance(row[2], str) else f"{row[2]:.3f}", row[3], row[4]])
    return table(rows, ["benchmark", "figure", "median", "spread", "goal / reference"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes and one round (a smoke run)")
    ap.add_argument("--only", help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder for the JSON results")
    ap.add_argument("--img", type=Path, help="folder for the figures (default docs/img)")
    ap.add_argument("--doc", type=Path, help="markdown report to write (default docs/benchmarks.md)")
    ap.add_argument("--no-docs", action="store_true", help="do not redraw figures or rewrite the doc")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",")] if args.only else list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}", file=sys.stderr)
        return 2
    # One intra-op thread per process: every rank of the multi-process benchmarks has one, and on
    # a small shared machine more threads than cores make timings erratic.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    results = {}
    for name in names:
        print(f"== {name} ...", file=sys.stderr, flush=True)
        results[name] = run_one(name, args.quick, args.results)
        print(f"   {name}: {results[name]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    print(summary(results))
    if not args.no_docs:
        from bench.plots import plot_all
        from bench.report import write_report

        plot_all(args.results, args.img)
        print(f"wrote {write_report(args.results, args.doc, args.img)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
