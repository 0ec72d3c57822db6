"""The arms of bench/gpu/run_all.py: what each one trains, how a rank measures it, what was predicted.

`single` is bench/gpu/train_1b.py (the runtime against a plain loop on one device) run as a job of a
1-rank pool. `zero3` (dp = world, zero = 3) and `tp` (tp = world) run the per-rank runtime
(`workbench.runtime.loop.train`) on `world` spawned ranks, one device each (nccl on GPUs, gloo on
CPU), the same model and batches per data-parallel rank as `single`: zero3 scales the global batch
with dp (each rank trains what the one GPU trains), tp keeps it (the ranks share each sequence).
`ckpt` (the single arm's spec with full activation checkpointing) and `llama` (llama3.2-1b at the
single arm's sequence length: grouped-query attention, SwiGLU, a 128k vocabulary; llama-tiny beside
the CPU smoke run's gpt-tiny) run the runtime on one device: two more shapes of work for the
step-time and memory models. `calibrate` is `workbench calibrate` (GEMMs by shape, memory
bandwidth, collectives, the runtime's strategy probes) on every device, through a pool instead of
Ray: its profile gives every measured arm a second step-time prediction, the calibrated one,
beside the catalog's.
Each rank reports its step ends, CPU time, allocator peaks and reserve; rank 0 its losses. The
prediction is `estimate_memory` and the step-time model (`workbench.steptime`: the catalog's
figures for the GPU, and the calibrated profile's) for exactly that spec.
"""
from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time

ARMS = ("single", "zero3", "tp", "calibrate", "ckpt", "llama")
ONE_DEVICE = ("single", "ckpt", "llama")


def base_spec(preset: str, seq_len: int | None, dtype: str, steps: int, global_batch: int, micro_batch: int,
              gpu: str) -> dict:
    """The one-device spec every arm starts from (train_1b's, with `gpu` the catalog name)."""
    from bench.gpu.train_1b import build_spec

    args = argparse.Namespace(preset=preset, seq_len=seq_len, dtype=dtype, steps=steps, global_batch=global_batch,
                              micro_batch=micro_batch)
    return build_spec(args, gpu)


def arm_spec(name: str, world: int, base: dict) -> dict:
    """`base` laid out for arm `name` on `world` ranks."""
    spec = copy.deepcopy(base)
    if name == "zero3":
        spec["layout"] = {"dp": world, "zero": 3}
        spec["train"]["global_batch"] = base["train"]["global_batch"] * world
    elif name == "tp":
        spec["layout"] = {"dp": 1, "tp": world}
    elif name == "calibrate":
        spec["layout"] = {"dp": world}
    elif name == "ckpt":
        spec["layout"] = {"dp": 1, "activation_checkpointing": "full"}
        world = 1
    elif name == "llama":
        llama = "llama3.2-1b" if base["model"]["preset"] == "gpt-1.3b" else "llama-tiny"  # llama-tiny: CPU smoke
        spec["model"] = {"preset": llama, "seq_len": shape_of(base).seq_len}
        spec["layout"] = {"dp": 1}
        world = 1
    else:
        spec["layout"] = {"dp": 1}
        world = 1
    spec["name"] = f"gpu-{name}"
    spec["resources"] = {**spec["resources"], "gpus_per_node": world, "nodes": 1}
    return spec


def shape_of(spec: dict):
    from workbench.spec import load_spec

    return load_spec(spec).model.shape()


def arm_world(name: str, world: int) -> int:
    return 1 if name in ONE_DEVICE else world


def skip_reason(name: str, world: int, spec: dict) -> str | None:
    """Why arm `name` cannot run on `world` devices (None: it can): fewer than 2 devices for a
    sharded layout (ZeRO-3 on one rank is refused, tp=1 is the single arm), or the runtime's own
    rules (`check_runnable`: its ConfigError's first line)."""
    from workbench.errors import ConfigError
    from workbench.spec import load_spec
    from workbench.validate import check_runnable

    if name in ("zero3", "tp") and world < 2:
        return f"needs >= 2 GPUs (found {world}): ZeRO-3 on one rank has nothing to shard over, tp=1 is the single arm"
    try:
        check_runnable(load_spec(spec))
    except ConfigError as e:
        return str(e).splitlines()[0]
    return None


def predict(spec: dict, profile=None) -> dict:
    """The step-time model's step for exactly this spec, from the catalog's figures for its GPU, or
    from `profile` (a HardwareProfile of `workbench calibrate`) when given."""
    from workbench.catalog import get_device
    from workbench.memory import layout_from_spec
    from workbench.memory.params import rank_counts
    from workbench.spec import load_spec
    from workbench.steptime import Hardware, step_time

    js = load_spec(spec)
    shape, lay, dev = js.model.shape(), layout_from_spec(js), get_device(js.resources.gpu)
    params, shard, _ = rank_counts(shape, lay.tp, lay.pp, 0, lay.chunks, lay.dp)
    hw = Hardware(dev, js.resources.gpus_per_node, profile)
    st = step_time(shape, lay, dev, js.train.global_batch, js.resources.gpus_per_node, params, shard, hw=hw)
    return {"step_time_s": st.step_time_s, "tokens_per_s": st.tokens_per_s, "source": hw.source}


def predicted_steps(spec: dict, measured: float, profile=None) -> dict:
    """The step time predicted from the catalog and, given `profile`, from it; each against `measured`."""
    pred = predict(spec)["step_time_s"]
    out = {"predicted": pred, "measured_over_predicted": measured / pred}
    if profile is not None:
        cal = predict(spec, profile)["step_time_s"]
        out.update(predicted_calibrated=cal, measured_over_calibrated=measured / cal)
    return out


def predicted_memory(spec: dict) -> dict:
    """`estimate_memory`: each rank's allocated peak, and what the device holds beside it (reserve,
    CUDA context, NCCL buffers) for the largest rank."""
    from workbench.memory import estimate_memory

    est = estimate_memory(spec)
    return {"per_rank": [int(r["total"]) for r in est.to_dict()["per_rank"]], "device_used": est.device_used_bytes}


def single_job(job: dict, emit) -> None:
    """On the 1-rank pool: bench/gpu/train_1b.py's measurement (runtime against the plain loop)."""
    import torch

    from bench.gpu import train_1b

    result = train_1b.measure(argparse.Namespace(**job["args"]))
    if torch.cuda.is_available():
        gc.collect()  # the last run's model may live on in reference cycles
        torch.cuda.empty_cache()  # the next arm's ranks share this device
    emit({"event": "single", "result": result})


def calibrate_job(job: dict, emit) -> None:
    """On each rank: `workbench calibrate`'s rank part with the driver's options."""
    from workbench.calibrate import calibrate_rank

    calibrate_rank(job["spec"], emit, options=job["options"])


def calibrate(spec: dict, pool, quick: bool, timeout_s: float) -> tuple:
    """Calibrate the devices of `spec`'s resources on `pool`: (the profile, its summary table)."""
    from workbench.calibrate import profile_from_events, rank_plan, summary
    from workbench.spec import load_spec

    js = load_spec(spec, layout=False)
    job_spec, options = rank_plan(js, quick)
    events = pool.run({"spec": job_spec.to_dict(), "options": options}, fn=calibrate_job, timeout_s=timeout_s)
    profile = profile_from_events(events, options, "local")
    return profile, summary(profile, options["model_shapes"])


def rank_job(job: dict, emit) -> None:
    """On each rank: train `job["spec"]` with the runtime; emit this rank's record."""
    import torch
    import torch.distributed as dist

    from workbench.runtime.loop import train

    cuda = torch.cuda.is_available()
    if cuda:  # the pool's earlier jobs leave cached blocks: this job's reserve is its own
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    rec: dict[str, list] = {"times": [], "cpu": [], "losses": [], "step_time_s": [], "peaks": [], "nvml_used": []}

    def sink(event: dict) -> None:
        if event["event"] == "step":
            rec["times"].append(time.perf_counter())
            rec["cpu"].append(time.process_time())
            rec["losses"].append(event["loss"])
            rec["step_time_s"].append(event["step_time_s"])
        elif event["event"] == "memory":
            rec["peaks"].append(event["measured"]["peak"])
            used = event.get("gpu", {}).get("memory_used_bytes")
            if used:
                rec["nvml_used"].append(used)

    train(job["spec"], sink)
    # The caching allocator keeps what it reserved until empty_cache: the reserve at the end is
    # the run's (each step resets the peak statistics, so their peak would be the last step's).
    reserved = int(torch.cuda.memory_reserved()) if cuda else None
    emit({"event": "gpu_arm", "rank": dist.get_rank(), "reserved": reserved, **rec})


def summarize(events: list[dict], spec: dict, warmup: int, world: int) -> dict:
    """One arm's figures from its ranks' records, beside the predictions for the same spec."""
    from bench.common import stats, steady_tokens_per_s
    from bench.gpu.train_1b import flops_per_token
    from workbench.catalog import get_device
    from workbench.spec import load_spec

    recs = sorted((e for e in events if e["event"] == "gpu_arm"), key=lambda e: e["rank"])
    r0 = recs[0]
    shape = load_spec(spec).model.shape()
    tokens = spec["train"]["global_batch"] * shape.seq_len
    tps = steady_tokens_per_s(r0["times"], tokens, warmup)
    fpt = flops_per_token(shape)
    gpu, dtype = spec["resources"]["gpu"], spec["precision"]["dtype"]
    peak_flops = None if gpu == "cpu" else get_device(gpu).compute_flops[dtype]
    pred = predict(spec)
    steady = r0["cpu"][warmup:]
    step = tokens / tps
    return {
        "status": "ok", "world": world, "layout": spec["layout"], "global_batch": spec["train"]["global_batch"],
        "tokens_per_s": tps, "mfu": tps * fpt / (world * peak_flops) if peak_flops else None,
        "step_time_s": {"measured": step, "median_event": statistics.median(r0["step_time_s"][warmup:]),
                        **predicted_steps(spec, step)},
        "predicted": {**pred, "mfu": pred["tokens_per_s"] * fpt / (world * peak_flops) if peak_flops else None},
        "cpu_s_per_step_rank0": (steady[-1] - steady[0]) / (len(steady) - 1),
        "memory": memory_rows(recs, predicted_memory(spec)),
        "losses": r0["losses"], "step_time_spread": stats(r0["step_time_s"][warmup:]),
    }


def memory_rows(recs: list[dict], pred: dict) -> list[dict]:
    """Per rank: allocated peak (the largest of its memory events), reserve and NVML's device use,
    against `estimate_memory`'s allocated peak for that rank."""
    rows = []
    for e in recs:
        predicted = pred["per_rank"][e["rank"]]
        peak = max(e["peaks"])
        rows.append({"rank": e["rank"], "allocated_peak": peak, "reserved": e["reserved"],
                     "device_used": max(e["nvml_used"]) if e["nvml_used"] else None,
                     "predicted": predicted, "predicted_device_used": pred["device_used"],
                     "measured_over_predicted": peak / predicted if predicted else None})
    return rows
