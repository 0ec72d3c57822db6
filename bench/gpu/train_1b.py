"""bf16 training of a ~1.3B GPT on one GPU: the per-rank runtime in-process against a plain loop.

Both train `model: {preset: gpt-1.3b}` on the same batches, alternating runs: the runtime
(`workbench.runtime.loop.train`, world size 1, no Ray; bf16 weights + fp32 master) and a plain
PyTorch loop (autocast bf16, fp32 weights, AdamW). Prints tokens/s, MFU and peak memory against
`estimate_memory`. On a GPU host:
    python bench/gpu/train_1b.py --steps 30
CPU smoke test of the same path:
    python bench/gpu/train_1b.py --device cpu --preset gpt-tiny --steps 4 --warmup 1 --reps 1
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runnable as a file from anywhere


def gpu_catalog_name(device_name: str) -> str:
    """torch.cuda.get_device_name() -> our catalog's name (for peak FLOP/s and memory)."""
    name = device_name.lower()
    if "h200" in name:
        return "h200"
    if "h100" in name:
        return "h100-80gb"
    if "a100" in name:
        return "a100-80gb" if "80" in name else "a100-40gb"
    return "h100-80gb"


def flops_per_token(shape) -> float:
    """Training FLOPs per token: 6 N (weights, fwd + bwd) + 12 L h s (attention scores), PaLM's count."""
    return 6 * shape.num_params() + 12 * shape.layers * shape.hidden * shape.seq_len


def build_spec(args, gpu: str) -> dict:
    model = {"preset": args.preset}
    if args.seq_len:
        model["seq_len"] = args.seq_len
    return {"name": "gpu-1b", "model": model, "data": {"source": "synthetic", "seed": 0},
            "train": {"steps": args.steps, "global_batch": args.global_batch, "micro_batch": args.micro_batch,
                      "optimizer": "adamw", "lr": 1e-4, "seed": 0},
            "layout": {"dp": 1}, "precision": {"dtype": args.dtype},
            "resources": {"gpu": gpu, "gpus_per_node": 1, "nodes": 1}}


def run_runtime(spec: dict) -> dict:
    from workbench.runtime.loop import train

    events: list[dict] = []
    train(spec, events.append)
    steps = [e for e in events if e["event"] == "step"]
    peaks = [e["measured"]["peak"] for e in events if e["event"] == "memory"]
    return {"times": [e["time"] for e in steps], "losses": [e["loss"] for e in steps], "peak_bytes": max(peaks)}


def run_plain(spec: dict, device: str, dtype: str) -> dict:
    import torch

    from bench.plain_loop import train_plain

    return train_plain(spec, device=device, autocast_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype))


def measure(args) -> dict:
    import torch

    from bench.common import interleave, machine, paired_ratios, stats, steady_tokens_per_s
    from workbench.catalog import get_device
    from workbench.spec import load_spec

    cuda = args.device == "cuda"
    gpu = gpu_catalog_name(torch.cuda.get_device_name()) if cuda else "cpu"
    spec = build_spec(args, gpu)
    shape = load_spec(spec).model.shape()
    tokens_per_step = args.global_batch * shape.seq_len
    peak_flops = get_device(gpu).compute_flops[args.dtype] if cuda else float("nan")
    peaks: dict[str, list[int]] = {"runtime": [], "plain": []}
    reserved: dict[str, list[int]] = {"runtime": [], "plain": []}  # the allocator's reserve after each run (CUDA)
    losses: dict[str, list[float]] = {}

    def once(name, fn):
        def go():
            if cuda:
                # The previous run's model and optimizer may live on in reference cycles (its
                # process groups, hooks): collected first, or this run's peak would count them.
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            r = fn()
            peaks[name].append(r["peak_bytes"])
            if cuda:  # the run's tensors are freed, their blocks still cached: what it reserved
                reserved[name].append(torch.cuda.memory_reserved())
            losses[name] = r["losses"]
            return steady_tokens_per_s(r["times"], tokens_per_step, args.warmup)
        return go

    tps = interleave({"runtime": once("runtime", lambda: run_runtime(spec)),
                      "plain": once("plain", lambda: run_plain(spec, args.device, args.dtype))}, reps=args.reps, warmup=0)
    fpt = flops_per_token(shape)
    predicted = _predicted_peak(spec)
    variants = {k: {"tokens_per_s": stats(v), "mfu": stats([x * fpt / peak_flops for x in v]),
                    "peak_gib": max(peaks[k]) / 2**30 if peaks[k] else float("nan"),
                    "reserved_gib": max(reserved[k]) / 2**30 if reserved[k] else None} for k, v in tps.items()}
    info = machine()
    if cuda:
        info["gpu"] = torch.cuda.get_device_name()
    return {"config": {"preset": args.preset, "params": shape.num_params(), "seq_len": shape.seq_len,
                       "global_batch": args.global_batch, "micro_batch": args.micro_batch, "dtype": args.dtype,
                       "steps": args.steps, "warmup": args.warmup, "reps": args.reps, "device": args.device},
            "machine": info, "variants": variants, "ratio": stats(paired_ratios(tps["runtime"], tps["plain"])),
            "flops_per_token": fpt, "peak_flops": peak_flops,
            "predicted_peak_gib": predicted / 2**30 if predicted else float("nan"),
            "first_losses": {k: v[:3] for k, v in losses.items()}}


def _predicted_peak(spec: dict) -> float | None:
    try:
        from workbench.memory import estimate_memory
    except ImportError:
        return None
    return float(estimate_memory(spec).to_dict()["per_rank"][0]["total"])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    ap.add_argument("--preset", default="gpt-1.3b")
    ap.add_argument("--seq-len", type=int, help="override the preset's sequence length")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the steady state")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2, help="alternated rounds of (runtime, plain)")
    ap.add_argument("--out", type=Path, help="write the result JSON here (default bench/results/gpu_1b.json on GPU)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the runtime picks CUDA whenever it sees one
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device visible")
    if args.steps <= args.warmup + 1:
        ap.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) + 1")
    result = measure(args)
    out = args.out or (Path(__file__).resolve().parents[1] / "results" / "gpu_1b.json" if args.device == "cuda" else None)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"name": "gpu_1b", **result}, indent=2, default=float) + "\n")
    for k, v in result["variants"].items():
        print(f"{k:8s} tokens/s {v['tokens_per_s']['median']:>12,.0f}  MFU {v['mfu']['median']:6.1%}  "
              f"peak {v['peak_gib']:.2f} GiB")
    print(f"runtime / plain: {result['ratio']['median']:.3f}; predicted peak {result['predicted_peak_gib']:.2f} GiB"
          + (f"; wrote {out}" if out else ""))
    return result


if __name__ == "__main__":
    main()
