"""Where a GPU step's time goes: the runtime's step against the plain loop's, under torch.profiler.

For issue #35 (the single arm of bench/gpu/run_all.py measured the runtime at 0.90x the plain loop
on an H200): each trains the same spec (`gpt-1.3b` in bf16, bench/gpu/train_1b.py's) for a few
steps; the profiler records steps `wait + 2` .. `wait + 1 + active`. Per variant it prints the wall
time per step, the GPU's kernel time per step (busy = kernel time / wall), the host-side waits
(synchronizations, device-to-host copies) per step and the top operators by GPU time. Also: the
allocator's bytes after the first GEMM on this thread and after a backward (autograd's thread),
which are cuBLAS's workspaces (workbench/memory/estimate.py, CUBLAS_WORKSPACE_BYTES).

    python -m bench.gpu.profile_step [--out profile.json]
CPU smoke run of the same code (no GPU figures): --device cpu --preset gpt-tiny
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runnable as a file from anywhere

WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync")


def workspace_bytes() -> dict:
    """The allocator's bytes in use: at start, after one bf16 GEMM, after its backward."""
    import torch

    torch.cuda.init()
    before = torch.cuda.memory_allocated()
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    tensors = 2 * a.numel() * a.element_size()  # a and its product
    y = a @ a
    torch.cuda.synchronize()
    forward = torch.cuda.memory_allocated() - before - tensors
    y.sum().backward()
    torch.cuda.synchronize()
    backward = torch.cuda.memory_allocated() - before - tensors - a.numel() * a.element_size()  # + a.grad
    return {"after_forward_gemm": forward, "after_backward": backward}


def profiled(name: str, run, wait: int, active: int, cuda: bool) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    ends: list[float] = []
    sched = schedule(wait=wait, warmup=1, active=active, repeat=1)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities, schedule=sched) as prof:
        def on_step():
            if cuda:
                torch.cuda.synchronize()
            ends.append(time.perf_counter())
            prof.step()
        run(on_step)
    window = ends[wait + 1:wait + 1 + active + 1]
    wall = (window[-1] - window[0]) / (len(window) - 1)
    rows = prof.key_averages()

    def dev_us(e) -> float:
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    kernels = [e for e in rows if e.device_type == torch.autograd.DeviceType.CUDA]
    ops = [e for e in rows if e.device_type == torch.autograd.DeviceType.CPU]  # self GPU time: their kernels
    gpu_s = sum(dev_us(e) for e in kernels) / 1e6 / active
    waits = {e.key: {"count": e.count / active, "cpu_ms": e.cpu_time_total / 1e3 / active}
             for e in rows if e.key in WAITS}
    top = sorted(ops, key=dev_us, reverse=True)[:15]
    out = {"wall_s": wall, "gpu_kernel_s": gpu_s, "busy": gpu_s / wall, "waits_per_step": waits,
           "launches_per_step": sum(e.count for e in rows if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                      "cudaLaunchKernelExC")) / active,
           "top": [{"op": e.key[:80], "gpu_ms_per_step": dev_us(e) / 1e3 / active, "calls_per_step": e.count / active}
                   for e in top]}
    print(f"\n== {name}: {wall:.3f} s/step, GPU kernels {gpu_s:.3f} s/step (busy {gpu_s / wall:.1%}), "
          f"{out['launches_per_step']:.0f} launches/step; waits/step {json.dumps(waits)}")
    for t in out["top"]:
        print(f"  {t['gpu_ms_per_step']:9.2f} ms {t['calls_per_step']:7.0f} x  {t['op']}")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt-1.3b")
    ap.add_argument("--wait", type=int, default=4, help="steps before the profiler's warm-up step")
    ap.add_argument("--active", type=int, default=3, help="steps recorded")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if not cuda:
        import os

        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the runtime picks CUDA whenever it sees one
    import torch

    from bench.gpu.train_1b import build_spec, gpu_catalog_name
    from bench.plain_loop import train_plain
    from workbench.runtime.loop import train

    result = {"workspace": workspace_bytes()} if cuda else {}
    print("allocator bytes beyond the tensors:", result.get("workspace"))
    steps = args.wait + 1 + args.active + 1
    spec = build_spec(argparse.Namespace(preset=args.preset, seq_len=None, dtype="bf16", steps=steps,
                                         global_batch=8, micro_batch=4),
                      gpu_catalog_name(torch.cuda.get_device_name()) if cuda else "cpu")

    def runtime(on_step):
        train(spec, lambda e: on_step() if e["event"] == "step" else None)

    def plain(on_step):
        train_plain(spec, device=args.device, autocast_dtype=torch.bfloat16, on_step=on_step)

    for name, run in (("runtime", runtime), ("plain", plain)):
        result[name] = profiled(name, run, args.wait, args.active, cuda)
        if cuda:
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
