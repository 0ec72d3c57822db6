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
from workbench.calibration import errors, load_cases, predict, priced  # noqa: E402


def _dict_param(name: str, table: dict, key: str, lo: float, hi: float):
    return (f"{name}[{key}]", lambda: table[key], lambda v: table.__setitem__(key, v), lo, hi)


def _attr_param(name: str, lo: float, hi: float):
    return (name, lambda: getattr(steptime, name), lambda v: setattr(steptime, name, v), lo, hi)


# (name, getter, setter, lower bound, upper bound): the fitted constants of workbench/steptime.py.
PARAMS = [
    _dict_param("GEMM_EFFICIENCY", steptime.GEMM_EFFICIENCY, "a100", 0.3, 0.95),
    _dict_param("GEMM_EFFICIENCY", steptime.GEMM_EFFICIENCY, "h100", 0.3, 0.95),
    _attr_param("GEMM_HALF_WIDTH", 0.0, 2000.0),
    _attr_param("TOKENS_HALF", 1.0, 4096.0),
    _attr_param("ATTENTION_EFFICIENCY", 0.1, 1.0),
    _dict_param("FLASH_RELATIVE", steptime.FLASH_RELATIVE, "a100", 0.1, 1.5),
    _dict_param("FLASH_RELATIVE", steptime.FLASH_RELATIVE, "h100", 0.1, 1.5),
    _attr_param("OVERLAP", 0.0, 1.0),
]


def fitting_cases():
    """The fit split, on hardware the catalog describes, priced by the model."""
    return [c for c in load_cases() if c.split == "fit" and c.catalog_match and priced(c)]


def loss(cases) -> float:
    """Squared log error of predicted vs published tokens/s per GPU, summed over the cases."""
    out = 0.0
    for c in cases:
        pred = predict(c).tokens_per_s / c.world_size
        out += math.log(pred / c.published_tokens_per_s_per_gpu()) ** 2
    return out


def fit(rounds: int = 40) -> None:
    """Coordinate search from the current values, steps of 20%, 5% and 1%, until none helps."""
    cases = fitting_cases()
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
    steptime.GEMM_EFFICIENCY_DEFAULT = sum(steptime.GEMM_EFFICIENCY.values()) / len(steptime.GEMM_EFFICIENCY)
    print(f"fitted constants (workbench/steptime.py) on {len(cases)} fit cases:")
    for name, get, *_ in PARAMS:
        print(f"  {name} = {get():.3g}")


def table() -> str:
    """Every priced case: published vs predicted tokens/s per GPU (bench/results/calibration.md)."""
    rows = ["| case | where | engine | gpu | split | published tok/s/GPU | predicted | error |",
            "|---|---|---|---|---|---:|---:|---:|"]
    for c, pred, pub in errors():
        rows.append(f"| {c.name} | {c.where[:90]} | {c.engine} | {c.gpu}{'' if c.catalog_match else ' (not the catalog part)'} "
                    f"| {c.split} | {pub:,.1f} | {pred:,.1f} | {pred / pub - 1:+.1%} |")
    return "\n".join(rows)


def summary() -> str:
    """Errors per source and split: the table in docs/planning.md."""
    groups: dict = {}
    for c, pred, pub in errors():
        groups.setdefault((c.engine, c.gpu, c.catalog_match), {"fit": [], "held_out": []})[c.split].append(pred / pub - 1)
    rows = ["| engine (source) | GPU | split | rows | mean abs error | max abs error | within 20% | within 25% |",
            "|---|---|---|---:|---:|---:|---:|---:|"]

    def line(name, gpu, split, e):
        a = [abs(x) for x in e]
        return (f"| {name} | {gpu} | {split} | {len(e)} | {sum(a) / len(a):.1%} | {max(a):.1%} | "
                f"{sum(x <= 0.2 for x in a)} | {sum(x <= 0.25 for x in a)} |")

    for (engine, gpu, match), by in sorted(groups.items()):
        for split, e in by.items():
            if e:
                rows.append(line(engine, gpu + ("" if match else " (96 GB, 500 W)"), split, e))
    every = [x for by in groups.values() for x in by["fit"]], [x for by in groups.values() for x in by["held_out"]]
    rows.append(line("**all**", "", "fit", every[0]))
    rows.append(line("**all**", "", "held_out", every[1]))
    not_priced = [c.name for c in load_cases() if not priced(c)]
    rows.append(f"\nNot priced: {len(not_priced)} fp8 rows (neither the runtime nor the catalog has an fp8 path).")
    return "\n".join(rows)


if __name__ == "__main__":
    if "--fit" in sys.argv:
        fit()
    out = Path(__file__).resolve().parent / "results" / "calibration.md"
    out.write_text("# Published runs: predicted vs published tokens/s per GPU (python bench/calibrate.py)\n\n"
                   + table() + "\n")
    print(summary())
    print(f"\nevery row: {out}")
