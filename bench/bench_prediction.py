"""Predicted vs measured step time on this machine (#28 item 3): calibrate once per model (CPU, gloo,
2 ranks; what `workbench calibrate` on the user's spec measures: its own GEMM and attention shapes,
and the runtime's step on its model), then for each layout of gpt-mini / gpt-tiny take the planner's
prediction for the spec's own layout from its model's profile
(`plan(spec, profile=profile).given.step_time_s`) and run it for real through `workbench.run` (local
Ray, as `workbench run`), the median step_time_s of the metrics after warm-up. Prints per layout
predicted, measured and their ratio, and how well the predicted order matches the measured one
(Spearman's rho, pairs out of order).

    python bench/bench_prediction.py                   # calibrate (full), run every layout
    python bench/bench_prediction.py --quick           # calibrate --quick, fewer steps
    python bench/bench_prediction.py --reuse-measured  # keep the last run's measurements and profiles;
                                                       # only predict again (after a step-time change)
    python bench/bench_prediction.py --profile P --only tp2,zero3   # measure these again, keep the rest

Writes bench/results/prediction.json and prediction.md, and the table to /tmp/bench_prediction_latest.txt.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench.common import RESULTS, machine  # noqa: E402
from workbench.hwprofile import OVERHEAD_KEYS  # noqa: E402

PROFILE = RESULTS / "prediction_profile.yaml"  # gpt-mini's; another model's: profile_path(model)
LATEST = Path("/tmp/bench_prediction_latest.txt")
GOAL = 0.25  # every layout within +-25%
# A layout runs at least this long after warm-up: gpt-tiny's steps settle over its first ~10 (25 ms each:
# 51 ms at step 1, 37 at step 5, 27 at step 10 on 4 December), so 12 steps measured the warm-up, not the step.
MIN_MEASURED_S = 3.0


def _spec(name: str, model: str = "gpt-mini", ranks: int = 2, global_batch: int = 8, micro_batch: int = 4,
          dtype: str = "fp32", **layout) -> dict:
    layout = {"dp": ranks // (layout.get("tp", 1) * layout.get("pp", 1)), **layout}
    return {"name": f"pred-{name}", "model": {"preset": model}, "data": {"source": "synthetic", "seed": 0},
            "train": {"steps": 10, "global_batch": global_batch, "micro_batch": micro_batch, "optimizer": "adamw",
                      "lr": 3e-4, "seed": 0},
            "layout": layout, "precision": {"dtype": dtype},
            "resources": {"gpu": "cpu", "gpus_per_node": ranks, "nodes": 1}, "backend": {"name": "local"}}


# name -> spec: gpt-mini (4 sequences of 128 tokens per micro-batch) on 2 ranks, with 1-rank baselines
LAYOUTS = {
    "dp2": _spec("dp2"),
    "zero1": _spec("zero1", zero=1),
    "zero2": _spec("zero2", zero=2),
    "zero3": _spec("zero3", zero=3),
    "tp2": _spec("tp2", tp=2),
    "pp2-1f1b": _spec("pp2-1f1b", pp=2, pp_schedule="1f1b"),
    "pp2-gpipe": _spec("pp2-gpipe", pp=2, pp_schedule="gpipe"),
    "pp2-interleaved": _spec("pp2-interleaved", pp=2, pp_schedule="interleaved-1f1b", virtual_stages=3),
    "dp2-ac-full": _spec("dp2-ac-full", activation_checkpointing="full"),
    "dp2-ac-selective": _spec("dp2-ac-selective", activation_checkpointing="selective"),
    "dp2-accum4": _spec("dp2-accum4", global_batch=32),
    "dp2-bf16": _spec("dp2-bf16", dtype="bf16"),
    "1rank": _spec("1rank", ranks=1),
    "1rank-accum2": _spec("1rank-accum2", ranks=1, global_batch=16),
    "tiny-dp2": _spec("tiny-dp2", model="gpt-tiny", global_batch=16),
    "tiny-1rank": _spec("tiny-1rank", model="gpt-tiny", ranks=1, global_batch=8),
}


def profile_path(model: str) -> Path:
    """Where the profile calibrated on `model`'s spec is kept."""
    return PROFILE if model == "gpt-mini" else RESULTS / f"prediction_profile_{model}.yaml"


def calibrate_once(quick: bool, model: str = "gpt-mini"):
    from workbench.calibrate import calibrate, summary

    spec = _spec("calibrate", model=model)
    t0 = time.perf_counter()
    profile, path = calibrate(spec, out=profile_path(model), quick=quick)
    print(summary(profile))
    print(f"calibrated in {time.perf_counter() - t0:.0f} s; profile {path}\n", flush=True)
    return profile


def predict(spec: dict, profile) -> tuple[float | None, str]:
    """(predicted step seconds of the spec's own layout, the planner's source label or its refusal)."""
    from workbench.planner import plan

    try:
        result = plan(spec, profile=profile)
    except TypeError:  # a planner without profile= (before the step-time model reads profiles)
        result = plan(spec)
    if result.given is None:
        return None, (result.given_error or "not scored").splitlines()[0]
    return result.given.step_time_s, getattr(result, "source", "catalog defaults")


def measure(spec: dict, steps: int, warmup: int) -> dict:
    """Run the spec through workbench.run; the median step_time_s after `warmup` steps."""
    from workbench.launch import run

    spec = {**spec, "train": {**spec["train"], "steps": steps}}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "metrics.jsonl")
        t0 = time.perf_counter()
        run(spec, metrics_out=out, progress=False)
        wall = time.perf_counter() - t0
        with open(out) as f:
            events = [json.loads(line) for line in f]
    times = [e["step_time_s"] for e in events if e["event"] == "step"][warmup:]
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "steps": len(times),
            "warmup": warmup,
            "wall_s": round(wall, 1), "load_1m": [round(load_before, 1), round(os.getloadavg()[0], 1)]}


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(xs):
        order = sorted(range(len(xs)), key=xs.__getitem__)
        r = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def discordant(names: list[str], pred: list[float], meas: list[float]) -> list[str]:
    """Pairs the prediction orders the other way round from the measurement."""
    out = []
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            if (pred[i] - pred[j]) * (meas[i] - meas[j]) < 0:
                out.append(f"{names[i]} vs {names[j]}")
    return out


def separated(a: dict, b: dict) -> bool:
    """Whether two measurements order themselves: their step-time ranges (fastest to slowest step after
    warm-up) do not overlap. Within the overlap, the run-to-run spread decides the order, not the layout."""
    return a["max_s"] < b["min_s"] or b["max_s"] < a["min_s"]


def table(rows: list[dict], source: str) -> str:
    lines = [f"predicted vs measured step time (CPU, gloo; prediction source: {source})", "",
             "| layout | ranks | predicted s | measured s (median) | ratio pred/meas | within ±25% | load 1-min |",
             "|---|---:|---:|---:|---:|:---:|---:|"]
    for r in rows:
        pred = f"{r['predicted_s']:.4f}" if r["predicted_s"] is not None else f"n/a ({r['note']})"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        ok = "yes" if r["ratio"] is not None and abs(r["ratio"] - 1) <= GOAL else "no"
        load = r["measured"].get("load_1m")
        shown = f"{load[0]:.1f}-{load[1]:.1f}" if load else "-"
        lines.append(f"| {r['layout']} | {r['ranks']} | {pred} | {r['measured']['median_s']:.4f} | {ratio} | {ok} "
                     f"| {shown} |")
    scored = [r for r in rows if r["ratio"] is not None]
    if len(scored) >= 2:
        names = [r["layout"] for r in scored]
        pred, meas = [r["predicted_s"] for r in scored], [r["measured"]["median_s"] for r in scored]
        bad = discordant(names, pred, meas)
        by_name = {r["layout"]: r["measured"] for r in scored}
        resolved = sum(separated(by_name[a], by_name[b]) for i, a in enumerate(names) for b in names[i + 1:])
        bad_resolved = [p for p in bad if separated(*(by_name[n] for n in p.split(" vs ")))]
        within = sum(abs(r["ratio"] - 1) <= GOAL for r in scored)
        lines += ["", f"within ±25%: {within} of {len(scored)}; Spearman rho {spearman(pred, meas):.3f}; "
                  f"order preserved: {'yes' if not bad else 'no'} ({len(bad)} of {len(names) * (len(names) - 1) // 2} "
                  "pairs out of order" + (": " + ", ".join(bad[:12]) + (" ..." if len(bad) > 12 else "") if bad else "")
                  + f"); among the {resolved} pairs whose measured step-time ranges do not overlap: "
                  f"{len(bad_resolved)} out of order" + (f" ({', '.join(bad_resolved)})" if bad_resolved else "")]
    return "\n".join(lines)


def section(result: dict, doc=None, img=None, profile=None) -> str:
    """The docs/benchmarks.md section for a prediction.json (bench/report.py's sec_* signature; `doc` and
    `img` are unused: no figure). The profile's summary comes from bench/results/prediction_profile.yaml."""
    from workbench.calibrate import summary
    from workbench.hwprofile import load_profile

    if profile is None and PROFILE.is_file():
        profile = load_profile(PROFILE)

    rows = result["rows"]
    out = ["## j) Predicted against measured step time (`workbench calibrate`)",
           "`python bench/bench_prediction.py` calibrates this machine once per model, as a user calibrates on "
           "the spec they will run (`workbench calibrate`: 2 CPU ranks through local Ray, gloo; the model's own "
           "GEMM and attention shapes and the runtime's step on it), then for each layout takes the planner's "
           "prediction for the spec's own layout from its model's profile "
           "(`plan(spec, profile=profile).given.step_time_s`) and runs the layout through `workbench.run` (what "
           "`workbench run` calls), taking the median `step_time_s` of the metrics after warm-up: the first third "
           f"of the steps (at least {result['warmup']}), with at least {MIN_MEASURED_S:.0f} s of predicted steps "
           "(so gpt-tiny runs ~150 steps). gpt-mini (6 x 256, 128 tokens) with 4 sequences per micro-batch "
           "unless the name says otherwise; 2 ranks, and 1-rank baselines. Goal (#28): every layout within "
           "±25%, the order preserved. `--reuse-measured` predicts again against the stored measurements (after a "
           "change to the step-time model) in seconds."]
    if profile is not None:
        out.append("The gpt-mini layouts' profile (`bench/results/prediction_profile.yaml`; gpt-tiny's, taken "
                   "the same way, is `prediction_profile_gpt-tiny.yaml`):\n\n```\n" + summary(profile) + "\n```")
    out.append(table(rows, result["source"]).split("\n", 2)[2])
    load = result.get("load_average")
    if load:
        out.append(f"_Measured {result.get('when', '')}, 1-minute load average {load[0]:.1f} at its end on 2 cores "
                   "(other jobs shared the host; calibration and runs were disturbed alike only roughly)._")
    return "\n\n".join(out)


def _profile_facts(profile, path) -> dict:
    return {"path": str(path), "label": profile.label(), "gemm_fp32_flops": profile.gemm_flops("fp32"),
            "memory_bw": profile.memory_bw, "op_overhead_s": profile.op_overhead_s,
            "overheads": {f: dict(zip(OVERHEAD_KEYS, costs)) for f, *costs in profile.overheads}}


def _write(rows: list, source: str, profiles: dict, args, partial: bool) -> str:
    """Write prediction.json / .md and /tmp/bench_prediction_latest.txt (after each layout too, so the
    table so far is there while the rest run); return the table."""
    text = table(rows, source)
    scored = [r for r in rows if r["ratio"] is not None]
    pred, meas = [r["predicted_s"] for r in scored], [r["measured"]["median_s"] for r in scored]
    result = {"profiles": {m: _profile_facts(p, args.profile or profile_path(m)) for m, p in profiles.items()},
              "source": source, "warmup": args.warmup, "partial": partial, "rows": rows,
              "spearman": spearman(pred, meas) if len(scored) >= 2 else None,
              "discordant": discordant([r["layout"] for r in scored], pred, meas),
              "machine": machine(), "load_average": os.getloadavg(),
              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.reuse_measured:  # the measurements' machine and time, not this re-prediction's
        result.update({k: args.previous[k] for k in ("machine", "load_average", "when") if k in args.previous},
                      predicted_when=result["when"])
    (RESULTS / "prediction.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "prediction.md").write_text(text + "\n")
    head = f"bench/bench_prediction.py at {result['when']}, load average {os.getloadavg()[0]:.1f} on 2 cores"
    LATEST.write_text(head + (" (partial: still running)" if partial else "") + f"\n{text}\n")
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="calibrate --quick and 8 steps per layout")
    p.add_argument("--steps", type=int, default=None, help="steps per layout (default 12; --quick 8)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    p.add_argument("--only", help="comma-separated layout names")
    p.add_argument("--reuse-measured", action="store_true",
                   help="predict again against the measurements and profile of the last run (no runs)")
    p.add_argument("--profile", help="use this profile instead of calibrating")
    args = p.parse_args(argv)
    from workbench.hwprofile import load_profile

    RESULTS.mkdir(parents=True, exist_ok=True)
    out_json = RESULTS / "prediction.json"
    previous = json.loads(out_json.read_text()) if out_json.exists() else None
    args.previous = previous
    if args.reuse_measured and previous is None:
        print("no previous bench/results/prediction.json to reuse: run without --reuse-measured first", file=sys.stderr)
        return 2
    names = args.only.split(",") if args.only else list(LAYOUTS)  # measured now; the others keep the last run's
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        print(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    profiles = {}
    for model in dict.fromkeys(spec["model"]["preset"] for spec in LAYOUTS.values()):
        if args.profile or args.reuse_measured:
            profiles[model] = load_profile(args.profile or profile_path(model))
        else:
            profiles[model] = calibrate_once(args.quick, model)
    steps = args.steps or (8 if args.quick else 12)
    measured_before = {r["layout"]: r["measured"] for r in previous["rows"]} if previous else {}
    rows, source = [], "catalog defaults"
    for name, spec in LAYOUTS.items():
        run_now = name in names and not args.reuse_measured
        if not run_now and name not in measured_before:
            continue
        predicted, note = predict(spec, profiles[spec["model"]["preset"]])
        if run_now:
            n = max(steps, math.ceil(MIN_MEASURED_S / predicted)) if predicted else steps
            measured = measure(spec, n, max(args.warmup, n // 3))
        else:
            measured = measured_before[name]
        if predicted is not None:
            source = note
        ratio = predicted / measured["median_s"] if predicted else None
        ranks = spec["resources"]["gpus_per_node"]
        rows.append({"layout": name, "ranks": ranks, "model": spec["model"]["preset"], "layout_spec": spec["layout"],
                     "global_batch": spec["train"]["global_batch"], "micro_batch": spec["train"]["micro_batch"],
                     "dtype": spec["precision"]["dtype"], "predicted_s": predicted, "measured": measured,
                     "ratio": ratio, "note": "" if predicted is not None else note})
        _write(rows, source, profiles, args, partial=True)
        shown = f"{predicted:.4f}" if predicted is not None else "n/a"
        print(f"{name:>18}: predicted {shown} s, measured {measured['median_s']:.4f} s "
              f"(min {measured['min_s']:.4f}, max {measured['max_s']:.4f})"
              + (f", ratio {ratio:.2f}" if ratio else f" ({note})"), flush=True)
    text = _write(rows, source, profiles, args, partial=False)
    print("\n" + text + f"\n\nwrote {RESULTS / 'prediction.json'}, {RESULTS / 'prediction.md'}, {LATEST}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
