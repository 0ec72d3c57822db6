"""Fit the step-time model's constants on the `fit` half of workbench/calibration.yaml; print the
fit and held-out errors side by side (the table in docs/planning.md).

The fitted constants are global (per device generation at most), never per case: the fit
minimises the squared log error of predicted vs published tokens/s per GPU over the fit cases
with a coordinate search from the current values. Paste the printed constants into
workbench/steptime.py. Run: python bench/calibrate.py [--fit]
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from workbench import steptime  # noqa: E402
from workbench.calibration import errors, load_cases, predict  # noqa: E402

# (name, getter, setter, lower bound, upper bound)
PARAMS = [
    ("GEMM_EFFICIENCY[a100]", lambda: steptime.GEMM_EFFICIENCY["a100"],
     lambda v: steptime.GEMM_EFFICIENCY.__setitem__("a100", v), 0.3, 0.95),
    ("GEMM_EFFICIENCY[h100]", lambda: steptime.GEMM_EFFICIENCY["h100"],
     lambda v: steptime.GEMM_EFFICIENCY.__setitem__("h100", v), 0.3, 0.95),
    ("GEMM_HALF_WIDTH", lambda: steptime.GEMM_HALF_WIDTH,
     lambda v: setattr(steptime, "GEMM_HALF_WIDTH", v), 0.0, 2000.0),
    ("ATTENTION_EFFICIENCY", lambda: steptime.ATTENTION_EFFICIENCY,
     lambda v: setattr(steptime, "ATTENTION_EFFICIENCY", v), 0.1, 1.0),
    ("OVERLAP", lambda: steptime.OVERLAP, lambda v: setattr(steptime, "OVERLAP", v), 0.0, 1.0),
]


def loss(cases) -> float:
    out = 0.0
    for c in cases:
        pred = predict(c).tokens_per_s / c.world_size
        out += math.log(pred / c.published_tokens_per_s_per_gpu()) ** 2
    return out


def fit(rounds: int = 40) -> None:
    cases = [c for c in load_cases() if c.split == "fit"]
    best = loss(cases)
    for _ in range(rounds):
        improved = False
        for _name, get, put, lo, hi in PARAMS:
            x = get()
            for step in (0.2, 0.05, 0.01):
                for cand in (x * (1 + step), x * (1 - step)):
                    cand = min(hi, max(lo, cand))
                    put(cand)
                    val = loss(cases)
                    if val < best - 1e-12:
                        best, x, improved = val, cand, True
                    else:
                        put(x)
        if not improved:
            break
    print("fitted constants (workbench/steptime.py):")
    for name, get, *_ in PARAMS:
        print(f"  {name} = {get():.3g}")


def table() -> str:
    rows = ["| case | source | split | published tok/s/GPU | predicted | error |", "|---|---|---|---:|---:|---:|"]
    by_split = {"fit": [], "held_out": []}
    for c, pred, pub in errors():
        err = pred / pub - 1
        by_split[c.split].append(abs(err))
        rows.append(f"| {c.name} | {c.where} | {c.split} | {pub:,.1f} | {pred:,.1f} | {err:+.1%} |")
    for split, errs in by_split.items():
        rows.append(f"\n{split}: {len(errs)} cases, mean |error| {sum(errs) / len(errs):.1%}, max {max(errs):.1%}")
    return "\n".join(rows)


if __name__ == "__main__":
    if "--fit" in sys.argv:
        fit()
    print(table())
