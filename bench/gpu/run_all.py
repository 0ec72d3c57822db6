"""Every GPU measurement of issue #35 item 5 in one run, within a time budget.

Arms (bench/gpu/arms.py), in this order, each in spawned ranks (never in this process, so that a
stuck arm can be stopped at its deadline):
  single  ~1.3B GPT in bf16 on one device: the per-rank runtime against a plain PyTorch loop,
          alternated (bench/gpu/train_1b.py): tokens/s, MFU, peak memory against `estimate_memory`;
  zero3   dp = every device, zero = 3 (FSDP2), nccl;
  tp      tp = every device, nccl;
  calibrate  `workbench calibrate` on every device (its profile: bench/results/gpu-profile.yaml);
  ckpt    the single arm's spec with full activation checkpointing, one device;
  llama   llama3.2-1b at the same sequence length, one device;
each with tokens/s, MFU, every rank's allocated peak and reserve against `estimate_memory` for the
same layout, and the measured step time against the step-time model's: from the catalog's figures
for the GPU, and from the calibrate arm's profile (added to every measured arm once it has run).
With one device, zero3 and tp say "needs >= 2 GPUs". An arm that would not fit in what is left of
the budget is skipped and says so; an arm that fails or overruns is recorded with its error, and the
others still run. Writes bench/results/gpu.json and, on a GPU, regenerates docs/benchmarks.md (its
GPU section is bench/gpu/section.py's rendering of that file).

On a GPU host (within the budget; with one GPU only `single` runs):
    python -m bench.gpu.run_all --budget-s 540
On a machine lent through the device tool: bench/gpu/device_run.sh (it says how to prepare it).
CPU smoke run of the same code (gloo, 2 ranks; writes nothing unless --out):
    python -m bench.gpu.run_all --device cpu --preset gpt-tiny --steps 4 --warmup 1 --reps 1 --global-batch 4 --micro-batch 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runnable as a file from anywhere

from bench.gpu.arms import ARMS  # noqa: E402

SLACK = 3.0  # an arm's steps are budgeted at 3x the predicted step time (the model's misses, warm-up)
SETUP_S = {"cuda": 60.0, "cpu": 20.0}  # per run, until an arm has measured it: start, model build, first step
CALIBRATE_S = {"full": 180.0, "quick": 60.0}  # the calibrate arm's budget (GEMM time is capped at 60 / 8 s)
RESERVE_S = 10.0  # kept back for writing the results


def run(args: argparse.Namespace, pools: dict | None = None, save: Callable[[dict], None] | None = None) -> dict:
    """Run the arms of `args.arms` within `args.budget_s`; return the result dict.

    Args:
        args: run_all's options (see `parser`), with `device` and `world` resolved.
        pools: SpawnPools by world size to use (their backend must fit the device); missing ones
            are started here and closed at the end.
        save: called with the result so far after each arm (a run stopped from outside keeps
            the arms it finished).
    """
    from bench.gpu import arms as A
    from bench.gpu.train_1b import gpu_catalog_name

    t0 = time.monotonic()
    gpu = gpu_catalog_name(args.gpu_name) if args.device == "cuda" else "cpu"
    base = A.base_spec(args.preset, args.seq_len, args.dtype, args.steps, args.global_batch, args.micro_batch, gpu)
    pools, own = dict(pools or {}), set[int]()
    out: dict[str, dict] = {}
    setup_s = SETUP_S[args.device]
    state: dict = {"profile": None}  # the calibrate arm's HardwareProfile
    specs: dict[str, dict] = {}
    try:
        for name in args.arms:
            world = A.arm_world(name, args.world)
            spec = A.arm_spec(name, world, base)
            left = args.budget_s - (time.monotonic() - t0) - RESERVE_S
            specs[name] = spec
            out[name] = _arm(name, spec, world, args, left, setup_s, pools, own, state)
            if state["profile"] is not None:
                _add_calibrated(out, specs, state["profile"])
            print(f"{name}: {_line(out[name])}", flush=True)
            if out[name]["status"] == "ok" and name != "calibrate":
                setup_s = max(5.0, out[name]["wall_s"] / _runs(name, args)
                              - args.steps * out[name]["step_time_s"]["measured"])
            if save:
                save(_result(args, gpu, out, t0))
    finally:
        for world in own:
            pools[world].close()
    return _result(args, gpu, out, t0)


def _add_calibrated(arms: dict, specs: dict, profile) -> None:
    """Each measured arm's step time as the calibrated profile predicts it (whichever ran first)."""
    from bench.gpu import arms as A

    for name, a in arms.items():
        if a["status"] == "ok" and "step_time_s" in a:
            a["step_time_s"].update(A.predicted_steps(specs[name], a["step_time_s"]["measured"], profile))


def _result(args, gpu: str, arms: dict, t0: float) -> dict:
    return {"config": {**{k: v for k, v in vars(args).items() if k not in ("out", "doc", "profile_out")}, "catalog_gpu": gpu},
            "arms": dict(arms), "used_s": time.monotonic() - t0}


def _runs(name: str, args) -> int:
    return 2 * args.reps if name == "single" else 1


def _arm(name: str, spec: dict, world: int, args, left: float, setup_s: float, pools: dict, own: set,
         state: dict) -> dict:
    """One arm: skipped (why), failed (its error) or measured; never raises."""
    from bench.gpu import arms as A

    try:
        why = A.skip_reason(name, world, spec)
        if why:
            return {"status": "skipped", "world": world, "layout": spec["layout"], "reason": why}
        if name == "calibrate":
            need = CALIBRATE_S[args.calibrate]
        else:
            need = _runs(name, args) * (setup_s + args.steps * A.predict(spec)["step_time_s"] * SLACK)
        if need > left:
            return {"status": "skipped", "world": world, "layout": spec["layout"],
                    "reason": f"would take ~{need:.0f} s; {max(left, 0):.0f} s of the {args.budget_s:.0f} s budget left"}
        start = time.monotonic()
        pool = _pool(world, args.device, pools, own)
        try:
            result = _measure(name, spec, world, args, pool, left, state)
        except Exception:
            # SpawnPool.run closes a pool whose job failed; one that ran but whose figures could not
            # be read is closed here if this run started it. The next arm starts a fresh one.
            failed = pools.pop(world, None)
            if world in own and failed is not None:
                failed.close()
            own.discard(world)
            raise
        return {**result, "wall_s": time.monotonic() - start}
    except Exception as e:  # noqa: BLE001 - every arm's failure is recorded; the others still run
        return {"status": "failed", "world": world, "layout": spec["layout"], "error": f"{type(e).__name__}: {e}"[-3000:]}


def _pool(world: int, device: str, pools: dict, own: set):
    """The pool of `world` ranks; the pools this run started for other sizes are closed first (an
    idle rank still holds its CUDA context on a device the next arm measures)."""
    from workbench.runtime.spawn import SpawnPool

    for other in [w for w in own if w != world]:
        pools.pop(other).close()
        own.discard(other)
    if world not in pools:
        pools[world] = SpawnPool(world, backend="nccl" if device == "cuda" else "gloo")
        own.add(world)
    return pools[world]


def _measure(name: str, spec: dict, world: int, args, pool, left: float, state: dict) -> dict:
    from bench.gpu import arms as A

    if name == "calibrate":
        from workbench.hwprofile import save_profile

        profile, table = A.calibrate(spec, pool, args.calibrate == "quick", max(left, 1.0))
        state["profile"] = profile
        if args.profile_out:
            save_profile(profile, args.profile_out)
        print(table, flush=True)
        return {"status": "ok", "world": world, "layout": spec["layout"], "mode": args.calibrate,
                "profile": profile.to_dict(), "summary": table}
    if name != "single":
        events = pool.run({"spec": spec}, fn=A.rank_job, timeout_s=max(left, 1.0))
        return A.summarize(events, spec, args.warmup, world)
    job = {"args": {"preset": args.preset, "seq_len": args.seq_len, "dtype": args.dtype, "steps": args.steps,
                    "warmup": args.warmup, "global_batch": args.global_batch, "micro_batch": args.micro_batch,
                    "reps": args.reps, "device": args.device}}
    events = pool.run(job, fn=A.single_job, timeout_s=max(left, 1.0))
    r = next(e["result"] for e in events if e["event"] == "single")
    pred = A.predict(spec)
    peak = r["peak_flops"] if r["peak_flops"] == r["peak_flops"] else None  # NaN on the CPU
    pred["mfu"] = pred["tokens_per_s"] * r["flops_per_token"] / peak if peak else None
    tokens = spec["train"]["global_batch"] * r["config"]["seq_len"]
    measured = tokens / r["variants"]["runtime"]["tokens_per_s"]["median"]
    return {"status": "ok", "world": 1, "layout": spec["layout"], **r, "predicted": pred,
            "predicted_device_used_gib": A.predicted_memory(spec)["device_used"] / 2**30,
            "step_time_s": {"measured": measured, **A.predicted_steps(spec, measured)}}


def _line(a: dict) -> str:
    if a["status"] == "skipped":
        return f"skipped: {a['reason']}"
    if a["status"] == "failed":
        return "failed: " + a["error"].strip().splitlines()[-1][:300]
    if "profile" in a:
        return f"{a['mode']} profile, {a['wall_s']:.0f} s"
    st = a["step_time_s"]
    tps = a["tokens_per_s"] if "variants" not in a else a["variants"]["runtime"]["tokens_per_s"]["median"]
    cal = f", calibrated {st['predicted_calibrated']:.3f} s" if "predicted_calibrated" in st else ""
    return (f"{tps:,.0f} tokens/s, step {st['measured']:.3f} s (predicted {st['predicted']:.3f} s, "
            f"x{st['measured_over_predicted']:.2f}{cal}), {a['wall_s']:.0f} s")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    ap.add_argument("--gpus", type=int, help="devices for zero3/tp (default: every visible GPU; 2 ranks on CPU)")
    ap.add_argument("--preset", default="gpt-1.3b")
    ap.add_argument("--seq-len", type=int, help="override the preset's sequence length")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the steady state")
    ap.add_argument("--global-batch", type=int, default=8, help="per data-parallel rank (zero3 scales it with dp)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2, help="alternated rounds of (runtime, plain) in the single arm")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated, from " + ",".join(ARMS))
    ap.add_argument("--calibrate", choices=["full", "quick"], help="the calibrate arm's plan (default: full on "
                    "a GPU, quick on CPU)")
    ap.add_argument("--profile-out", type=Path, help="the calibrate arm's profile (default on a GPU: "
                    "bench/results/gpu-profile.yaml)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="the whole run's wall-clock budget")
    ap.add_argument("--out", type=Path, help="result JSON (default on a GPU: bench/results/gpu.json)")
    ap.add_argument("--no-doc", dest="doc", action="store_false", help="do not regenerate docs/benchmarks.md")
    return ap


def resolve(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse and check the options; pick the device, the world size and the GPU's name."""
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the runtime picks CUDA whenever it sees one
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    count = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and count == 0:
        ap.error("--device cuda: no CUDA device visible")
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        ap.error(f"--arms: unknown {unknown}; choose from {list(ARMS)}")
    if args.steps <= args.warmup + 1:
        ap.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) + 1 to leave a steady window")
    if args.gpus is not None and not 1 <= args.gpus <= (count or args.gpus):
        ap.error(f"--gpus {args.gpus}: between 1 and the {count} visible GPUs")
    args.world = args.gpus or (count if args.device == "cuda" else 2)
    args.gpu_name = _gpu_name() if args.device == "cuda" else "cpu"
    args.device_count = count
    args.calibrate = args.calibrate or ("full" if args.device == "cuda" else "quick")
    if args.profile_out is None and args.device == "cuda":
        args.profile_out = Path(__file__).resolve().parents[1] / "results" / "gpu-profile.yaml"
    return args


def _gpu_name() -> str:
    """torch's name of cuda:0, asked in a child process: this one never creates a CUDA context,
    which would hold memory on the device that rank 0 measures for the whole run."""
    import subprocess

    code = "import torch; print(torch.cuda.get_device_name(0))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    return done.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None, pools: dict | None = None) -> dict:
    from bench.common import machine

    args = resolve(parser(), argv)
    out = args.out or (Path(__file__).resolve().parents[1] / "results" / "gpu.json" if args.device == "cuda" else None)

    def save(result: dict) -> None:
        result["machine"] = {**machine(), "gpu": args.gpu_name, "device_count": args.device_count}
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"name": "gpu", **result}, indent=2, default=float) + "\n")

    result = run(args, pools, save)
    save(result)
    if out:
        print(f"wrote {out}")
    if out and args.device == "cuda" and args.doc:
        from bench.report import write_report

        print(f"wrote {write_report()}")
    return result


if __name__ == "__main__":
    main()
