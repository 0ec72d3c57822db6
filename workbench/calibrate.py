"""`workbench calibrate`: microbenchmarks on the spec's own resources (GEMM time by shape, memory
bandwidth, per-op overhead, collectives by message size), run through the backend `run` uses (one
Ray actor and process per rank, gloo or NCCL), written as a hardware profile (workbench/hwprofile.py).

Every rank runs each compute benchmark at the same time, as training uses the host; a figure is
the slowest rank's. The driver side imports no torch; `calibrate_rank` runs in each rank's process.
"""
from __future__ import annotations

import logging
import socket
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

from workbench.errors import ConfigError, WorkerError
from workbench.hwprofile import HardwareProfile, default_profile_path, profile_from_dict, save_profile
from workbench.memory.params import block_numel
from workbench.parallelism import Parallelism
from workbench.shapes import elementwise_shapes, forward_gemm_shapes
from workbench.spec import JobSpec, load_spec

KiB, MiB = 1 << 10, 1 << 20
# (message sizes, seconds per timed figure, elementwise tensor elements, grid of m = n = k, repeats)
_PLANS = {
    "quick": {"sizes": [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB], "budget_s": 0.03, "elements": 4 << 20,
              "cubes": [32, 128, 512], "repeats": 2, "gemm_budget_s": 8.0, "probe_steps": (2, 4)},
    "full": {"sizes": [4 * KiB << (2 * i) for i in range(8)], "budget_s": 0.15, "elements": 16 << 20,
             "cubes": [16, 32, 64, 128, 256, 512, 1024], "repeats": 3, "gemm_budget_s": 60.0,
             "probe_steps": (3, 8)},
}
# The near-empty model the strategy probes train (a gpt of no preset): 64 wide, 8 heads (tp up to 8
# divides it), 32 tokens, a 128-token vocabulary, 2 sequences per micro-batch, 2 micro-batches per
# step; at PROBE_LAYERS blocks each, so the per-block cost is the slope and the per-step cost the rest;
# and the deepest once more at 1 micro-batch, which tells a block's cost per micro-batch (hooks) from
# its cost once a step (gradient reduction after the last micro-batch).
PROBE_MODEL = {"family": "gpt", "hidden": 64, "heads": 8, "vocab": 128, "seq_len": 32, "tie_embeddings": False}
PROBE_LAYERS = (2, 6)
PROBE_MICRO_BATCH, PROBE_MICROS = 2, (2, 1)
# The largest model a probe trains at the spec's own width: on CPU seconds per step at most; on a
# GPU 2e9 parameters (6 blocks of a 13B model's width) fit one device with Adam in mixed precision.
PROBE_MAX_PARAMS = {"cpu": 50_000_000, "gpu": 2_000_000_000}
_GPU_ELEMENTS = 256 << 20  # 1 GiB fp32 per tensor: well past any GPU's caches
_TIMEOUT_S = {"quick": 300, "full": 1200}


# -- driver ---------------------------------------------------------------------------------
def _job_spec(spec: JobSpec) -> JobSpec:
    """The job the ranks run: every GPU (or CPU worker) of resources, one rank each (dp only)."""
    raw = spec.to_dict()
    world = spec.resources.num_gpus
    raw["layout"] = {"dp": world}
    raw["train"] = {**raw.get("train", {}), "global_batch": raw.get("train", {}).get("micro_batch", 1) * world}
    raw.pop("checkpoint", None)
    raw.pop("tracking", None)
    return load_spec(raw)


def _options(spec: JobSpec, quick: bool) -> dict:
    """What the ranks measure: the plan, dtypes, and the GEMM shapes of the spec's own model."""
    mode = "quick" if quick else "full"
    dtypes = ["fp32"] if spec.precision.dtype == "fp32" and quick else ["fp32", "bf16"]
    if spec.resources.gpu != "cpu" and not quick:
        dtypes.append("fp16")
    if spec.precision.dtype not in dtypes:
        dtypes.append(spec.precision.dtype)
    return {"mode": mode, **_PLANS[mode], "dtypes": dtypes, "model_shapes": model_gemm_shapes(spec),
            "device": spec.resources.gpu, "probes": probe_specs(spec), "forward_shapes": model_forward_shapes(spec),
            "attention_shapes": model_attention_shapes(spec), "elementwise_shapes": model_elementwise_shapes(spec)}


def probe_specs(spec: JobSpec) -> list[list]:
    """[family, spec dict] of each strategy probe: the runtime's step for that family's layout over
    every rank of the spec's resources (one rank: `single`), at each PROBE_LAYERS, on PROBE_MODEL and
    on the spec's own model (`probe_model`): the near-empty model gives the costs per step and per
    block, the spec's the part of the per-block cost that grows with the block's parameters."""
    world = spec.resources.num_gpus
    tp = _probe_tp(spec)
    layouts: list[tuple[str, dict]] = [("single", {"dp": 1})]
    if world > 1:
        layouts += [("ddp", {"dp": world}), ("zero1", {"dp": world, "zero": 1}),
                    ("zero2", {"dp": world, "zero": 2}), ("zero3", {"dp": world, "zero": 3})]
        if tp > 1:
            layouts.append(("tp", {"dp": world // tp, "tp": tp}))
        if world % 2 == 0:
            layouts.append(("pp", {"dp": world // 2, "pp": 2, "pp_schedule": "1f1b"}))
    models = [(PROBE_MODEL, False)]
    own = probe_model(spec)
    if own is not None and all(own["heads"] % lay.get("tp", 1) == 0 for _, lay in layouts):
        models.append((own, True))
    out = []
    for family, layout in layouts:
        ranks = layout["dp"] * layout.get("tp", 1) * layout.get("pp", 1)
        for model, is_own in models:
            depths = [(n, PROBE_MICROS[0]) for n in PROBE_LAYERS]
            if family != "pp":  # a pipeline needs a micro-batch per stage
                depths.append((max(PROBE_LAYERS), PROBE_MICROS[1]))
            for layers, micros in depths:
                out.append([family, probe_spec(spec, {**model, "layers": layers}, layout, ranks, is_own, micros)])
    return out


def _probe_tp(spec: JobSpec) -> int:
    """The tp of the `tp` probe: the largest of 8, 4, 2 that divides the ranks and fits a node (1: none)."""
    world, per_node = spec.resources.num_gpus, spec.resources.gpus_per_node
    return max((d for d in (8, 4, 2) if world % d == 0 and d <= per_node), default=1)


def _probe_shape():
    """PROBE_MODEL's shape (one block)."""
    return load_spec({"model": {**PROBE_MODEL, "layers": 1}}, layout=False).model.shape()


def probe_model(spec: JobSpec) -> dict | None:
    """The spec's own model shape (width, heads, vocabulary, sequence; random weights) for the
    probes, or None when it has no shape (`params`, a factory), its blocks are within 4x of
    PROBE_MODEL's, or it would hold more than PROBE_MAX_PARAMS at PROBE_LAYERS' deepest."""
    if spec.model.params is not None or spec.model.factory is not None:
        return None
    shape = spec.model.shape()
    fields = ("family", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len", "tie_embeddings",
              "qkv_bias", "out_bias", "mlp_bias")
    model = {k: getattr(shape, k) for k in fields}
    params = max(PROBE_LAYERS) * block_numel(shape, 1) + 2 * shape.vocab * shape.hidden
    near_empty = block_numel(_probe_shape(), 1)
    # A per-parameter cost read off two sizes closer than 4x would be mostly the probes' noise.
    if params > PROBE_MAX_PARAMS["cpu" if spec.resources.gpu == "cpu" else "gpu"] or block_numel(shape, 1) < 4 * near_empty:
        return None
    return model


def probe_spec(spec: JobSpec, model: dict, layout: dict, ranks: int, own: bool, micros: int) -> dict:
    """The spec of one probe of `model` at `micros` micro-batches a step (its own resources: `ranks` of
    the spec's device on one node): PROBE_MODEL at PROBE_MICRO_BATCH in fp32, the spec's own model
    (`own`) at its micro-batch and dtype."""
    micro = spec.train.micro_batch if own else PROBE_MICRO_BATCH
    return {"name": f"probe-{model['layers']}", "model": model,
            "data": {"source": "synthetic", "seed": 0},
            "train": {"steps": 100, "global_batch": micro * micros * layout["dp"], "micro_batch": micro,
                      "optimizer": spec.train.optimizer, "lr": 1e-4, "seed": 0},
            "layout": layout, "precision": {"dtype": spec.precision.dtype if own else "fp32"},
            "resources": {"gpu": spec.resources.gpu, "gpus_per_node": ranks, "nodes": 1},
            "backend": {"name": "local"}}


def derive_overheads(profile: HardwareProfile, measured: list) -> HardwareProfile:
    """The profile with `overheads` and `probes`: each probe's measured step against what the step-time
    model predicts for it from this profile's other figures. Per family and probe model, the straight
    line through the (blocks, extra seconds) of its two depths at 2 micro-batches gives the cost per
    step (its intercept, the loop's own collectives, events, the optimizer's bookkeeping) and a slope
    per block; the deepest probe at 1 micro-batch splits that slope into a cost per block and
    micro-batch (per-module hooks, wrapper dispatch) and one per block once a step (ZeRO's gradient
    reduction and copies after the last micro-batch). Where a family was probed on two models, the
    difference of each over their blocks' parameters is its cost per parameter (FSDP2's and the fp32
    master's per-parameter work), and the near-empty model's figure the rest. A negative figure
    (noise) is taken as 0."""
    import dataclasses

    from workbench.planner import plan

    base = dataclasses.replace(profile, overheads=(), probes=())
    probes: list = []
    points: dict[str, dict[int, list]] = {}
    for family, raw, seconds in measured:
        spec = load_spec(raw)
        got = plan(spec, profile=base).given
        if got is None:
            continue
        lay = spec.layout
        micros = Parallelism.from_spec(spec).num_micro
        layers = spec.model.layers or 1
        probes.append((family, lay.dp, lay.tp, lay.pp, layers, micros, seconds, got.step_time_s))
        block_params = block_numel(spec.model.shape(), lay.tp)  # of a block on the busiest rank
        points.setdefault(family, {}).setdefault(block_params, []).append(
            (micros, layers / lay.pp, seconds - got.step_time_s))
    overheads = []
    for family, by_size in points.items():
        fits = sorted((size, _split(pts)) for size, pts in by_size.items())
        (small, (per_step, *small_costs)), (large, (_, *large_costs)) = fits[0], fits[-1]
        costs = []
        for at_small, at_large in zip(small_costs, large_costs):
            per_param = max(0.0, (at_large - at_small) / (large - small)) if large > small else 0.0
            costs += [max(0.0, at_small - per_param * small), per_param]
        overheads.append((family, per_step, *costs))
    return dataclasses.replace(profile, overheads=tuple(overheads), probes=tuple(probes))


def _split(pts: list) -> tuple[float, float, float]:
    """(per step, per block and micro-batch, per block once a step) from (micro-batches, blocks, extra
    seconds) points: the line through the depths at the most micro-batches, its slope split by the
    deepest point at the fewest (without one, the slope is all per micro-batch); all >= 0."""
    most, fewest = max(p[0] for p in pts), min(p[0] for p in pts)
    per_step, slope = _line([(b, y) for m, b, y in pts if m == most])
    per_block, per_block_step = slope / most, 0.0
    if fewest < most:
        blocks, y = max((b, y) for m, b, y in pts if m == fewest)
        slope_fewest = max(0.0, (y - per_step) / blocks)
        per_block = min(slope / most, max(0.0, (slope - slope_fewest) / (most - fewest)))
        per_block_step = slope - per_block * most
    return per_step, per_block, per_block_step


def _line(pts: list) -> tuple[float, float]:
    """(intercept, slope) through the first and last of (x, y) points, both >= 0."""
    pts = sorted(pts)
    (x0, y0), (x1, y1) = pts[0], pts[-1]
    slope = max(0.0, (y1 - y0) / (x1 - x0)) if x1 > x0 else 0.0
    return max(0.0, min(y0 - slope * x0, y1 - slope * x1) if slope else (y0 + y1) / 2), slope


def model_gemm_shapes(spec: JobSpec) -> list[list[int]]:
    """(m, n, k) of every matmul of one micro-batch's forward and backward: the q/k/v, output,
    MLP and head projections at tp = 1 and at the spec's tp (columns split), as
    (tokens x in) @ (in x out), and their backward's (m, k, n) and (k, n, m). Empty for a
    size-only or factory model."""
    out = set()
    for m, n, k in model_forward_shapes(spec):
        out |= {(m, n, k), (m, k, n), (k, n, m)}
    return [list(x) for x in sorted(out)]


def model_forward_shapes(spec: JobSpec) -> list[list[int]]:
    """(m, n, k) of the forward matmuls of one micro-batch (see model_gemm_shapes), and of the strategy
    probes' near-empty model at tp = 1 and the `tp` probe's (their modelled time prices them too: a
    fit through another model's shapes missed its small GEMMs by up to 30%); only the probes' without
    a model shape."""
    probe = _probe_shape()
    out = {tuple(x) for x in forward_gemm_shapes(probe, PROBE_MICRO_BATCH * probe.seq_len, _probe_tp(spec))}
    try:
        s = spec.model.shape()
    except ConfigError:
        return [list(x) for x in sorted(out)]
    out |= {tuple(x) for x in forward_gemm_shapes(s, spec.train.micro_batch * s.seq_len, spec.layout.tp or 1)}
    return [list(x) for x in sorted(out)]


def model_attention_shapes(spec: JobSpec) -> list[list[int]]:
    """(batch, heads, seq, head_dim) of the attention core of one micro-batch, at tp = 1 and at the
    spec's tp (heads split), and of the strategy probes' near-empty model (their modelled time
    prices it too); only the probes' without a model shape."""
    probe = _probe_shape()
    out = {(PROBE_MICRO_BATCH, probe.heads, probe.seq_len, probe.head_dim)}
    try:
        s = spec.model.shape()
    except ConfigError:
        return [list(x) for x in sorted(out)]
    for tp in sorted({1, spec.layout.tp or 1}):
        out.add((spec.train.micro_batch, max(1, s.heads // tp), s.seq_len, s.head_dim))
    return [list(x) for x in sorted(out)]


def model_elementwise_shapes(spec: JobSpec) -> list[list]:
    """(op, rows, columns) of a block's norm and activation (workbench/shapes.py ELEMENTWISE) at the
    spec's micro-batch, at tp = 1 and at the spec's tp (with its sequence parallelism), and at the
    strategy probes' near-empty model (their modelled time prices it too); only the probes' without
    a model shape."""
    probe = _probe_shape()
    out = {tuple(x) for x in elementwise_shapes(probe, PROBE_MICRO_BATCH * probe.seq_len, 1)}
    try:
        s = spec.model.shape()
    except ConfigError:
        return [list(x) for x in sorted(out)]
    for tp in sorted({1, spec.layout.tp or 1}):
        sp = tp > 1 and spec.layout.sequence_parallel
        out |= {tuple(x) for x in elementwise_shapes(s, spec.train.micro_batch * s.seq_len, tp, sp)}
    return [list(x) for x in sorted(out)]


def calibrate(spec: JobSpec | dict | str, out: str | Path | None = None, quick: bool = False,
              note: Callable[[str], None] | None = None) -> tuple[HardwareProfile, Path]:
    """Measure the spec's resources and write the hardware profile.

    Args:
        spec: a JobSpec, dict or YAML path; its resources (device, ranks per node, nodes), backend
            (local or ray), model (its GEMM shapes are measured) and precision are used.
        out: where to write the profile (default: $WORKBENCH_HOME/profiles/<device>.yaml).
        quick: fewer sizes and shorter timings (well under a minute on a small CPU host).
        note: called with a line of progress now and then (default: stderr).
    Returns:
        (the profile, the path it was written to).
    Raises:
        ConfigError: a backend calibrate cannot run through, a GPU device without CUDA here,
            an unwritable output.
        WorkerError: a rank failed (RayStartError, exit 69, when the local Ray cluster did not start).
    """
    spec = load_spec(spec, layout=False)
    say = note or (lambda line: print(line, file=sys.stderr, flush=True))
    if spec.backend.name not in ("local", "ray"):
        raise ConfigError(f"backend.name {spec.backend.name!r}: calibrate runs on this machine (local) or on the Ray "
                          "cluster this machine belongs to (ray). To profile cloud machines, run `workbench "
                          "calibrate` on one of them with backend.name: local (or ray), then pass the profile "
                          "file to plan.")
    path = Path(out) if out is not None else default_profile_path(spec.resources.gpu)
    _check_writable(path)
    if spec.backend.name == "local" and spec.resources.gpu != "cpu":
        import torch

        if torch.cuda.device_count() < spec.resources.gpus_per_node:
            raise ConfigError(f"resources.gpu is {spec.resources.gpu} with {spec.resources.gpus_per_node} per node, "
                              f"but this machine has {torch.cuda.device_count()} CUDA devices. Calibrate on the "
                              "machines the profile is for, or set resources.gpu: cpu to profile this CPU.")
    job_spec, options = rank_plan(spec, quick)
    events = _run(job_spec, options, spec.backend.name, say)
    profile = profile_from_events(events, options, spec.backend.name)
    save_profile(profile, path)
    return profile, path


def rank_plan(spec: JobSpec, quick: bool) -> tuple[JobSpec, dict]:
    """(the job the ranks run, the `options` of `calibrate_rank`) for calibrating `spec`'s resources."""
    return _job_spec(spec), _options(spec, quick)


def profile_from_events(events: list[dict], options: dict, backend: str) -> HardwareProfile:
    """The profile from the ranks' events (rank 0's "calibration" event), its per-step and
    per-block overheads derived from the strategy probes. Raises WorkerError when there is none."""
    found = [e for e in events if e.get("event") == "calibration"]
    if not found:
        raise WorkerError("calibration ended without a result from rank 0 (see the Ray logs)")
    raw = {**found[-1]["profile"], "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "backend": backend}
    probes = raw.pop("probe_seconds", [])
    profile = profile_from_dict(raw, "(measured)")
    if probes:
        profile = derive_overheads(profile, [(f, r, t) for (f, r), t in zip(options["probes"], probes) if t])
    return profile


def _check_writable(path: Path) -> None:
    parent = next((p for p in [path.parent, *path.parent.parents] if p.exists()), None)
    if path.is_dir() or parent is None or not parent.is_dir():
        raise ConfigError(f"cannot write the hardware profile to {str(path)!r}: "
                          f"{'it is a folder' if path.is_dir() else 'no folder above it can hold it'}. "
                          "Pass a file path with -o.")


def _run(job_spec: JobSpec, options: dict, backend: str, say: Callable[[str], None]) -> list[dict]:
    """Run the ranks through the local-Ray launcher (backends/local_ray.py), as `run` does."""
    from backends.base import JobState
    from backends.local_ray import LocalRayJob, ensure_ray

    if backend == "ray":
        import ray

        if not ray.is_initialized():  # join the cluster this machine belongs to (RAY_ADDRESS or `ray start`)
            ray.init(address="auto", logging_level=logging.ERROR, log_to_driver=False)
    else:
        ensure_ray(note=lambda kind, line: say(f"{kind}: {line}"))

    def on_event(event: dict) -> None:
        if event.get("event") in ("note", "warning"):
            say(f"{event['event']}: {event['message']}")

    timeout = _TIMEOUT_S[options["mode"]]
    job = LocalRayJob(job_spec, on_event=on_event, entry={"entry": partial(calibrate_rank, options=options)})
    status = job.wait(timeout_s=timeout)
    if status.state in (JobState.PENDING, JobState.RUNNING):
        job.cancel()
        raise WorkerError(f"calibration did not finish within {timeout} s (a busy machine?); try --quick")
    if status.state.value == "failed":
        raise WorkerError(status.message or "a rank failed without a message (see the Ray logs)")
    return job.events


def summary(profile: HardwareProfile, model_shapes: list | None = None) -> str:
    """The table `workbench calibrate` prints."""
    lines = [f"{profile.label()}; host {profile.host}, {profile.threads_per_rank} threads per rank", "",
             "GEMM (all ranks at once)  rate            fill widths m/n/k  per call  worst fit error  points"]
    for dtype in profile.gemm_dtypes:
        fit = profile.gemm_fit(dtype)
        count = sum(1 for p in profile.gemm if p[0] == dtype)
        widths = "/".join(f"{x:.0f}" for x in fit.a)
        lines.append(f"  {dtype:<23} {fit.rate / 1e9:7.1f} GFLOP/s  {widths:>17}  {fit.t0 * 1e6:5.1f} us  "
                     f"{fit.worst:15.0%}  {count:6d}")
    lines += ["", f"memory bandwidth per rank  {profile.memory_bw / 1e9:.2f} GB/s"
              + "".join(f", {d} {bw / 1e9:.2f} GB/s" for d, bw in profile.memory_bw_dtype),
              f"per-op overhead            {profile.op_overhead_s * 1e6:.1f} us", ""]
    if profile.attention:
        lines.append("attention core (causal)   batch x heads x seq x head_dim   forward     backward")
        timed = {(r[1], *r[2:6]): {} for r in profile.attention}
        for kind, dtype, *dims, t in profile.attention:
            timed[(dtype, *dims)][kind] = t
        for (dtype, *dims), t in timed.items():
            lines.append(f"  {dtype:<23} {' x '.join(map(str, dims)):>32}  {t.get('fwd', 0) * 1e3:7.3f} ms  "
                         f"{t.get('bwd', 0) * 1e3:8.3f} ms")
        lines.append("")
    if profile.elementwise:
        lines.append("norms and activations      rows x columns    forward     backward")
        timed = {(r[0], r[2], r[3], r[4]): {} for r in profile.elementwise}
        for op, kind, dtype, rows, cols, t in profile.elementwise:
            timed[(op, dtype, rows, cols)][kind] = t
        for (op, dtype, rows, cols), t in timed.items():
            lines.append(f"  {op + ' ' + dtype:<23} {f'{rows} x {cols}':>15}  {t.get('fwd', 0) * 1e3:7.3f} ms  "
                         f"{t.get('bwd', 0) * 1e3:8.3f} ms")
        lines.append("")
    if profile.overheads:
        lines += ["runtime step beyond the modelled work (a near-empty model and the spec's through the runtime's "
                  "own step)",
                  "  family    per step   per block: and micro-batch (+ per M params)   once a step (+ per M params)"
                  "   probes: blocks x micro-batches -> measured / modelled s"]
        for fam, per_step, per_block, per_param, per_block_step, step_param in profile.overheads:
            shown = ", ".join(f"{p[4] // p[3]}x{p[5]} -> {p[6]:.4f}/{p[7]:.4f}" for p in profile.probes if p[0] == fam)
            lines.append(f"  {fam:<8} {per_step * 1e3:7.1f} ms  {per_block * 1e3:21.2f} ms ({per_param * 1e9:+8.2f} ms)"
                         f"   {per_block_step * 1e3:15.2f} ms ({step_param * 1e9:+8.2f} ms)   {shown}")
        if profile.cpu_cores:
            lines.append(f"  ({profile.nodes * profile.ranks_per_node} ranks on {profile.cpu_cores} logical CPUs)")
        lines.append("")
    kinds = sorted({(p[0], p[1], p[2]) for p in profile.collectives})
    sizes = sorted({p[3] for p in profile.collectives})
    if kinds:
        lines.append("bus bandwidth (GB/s)".ljust(26) + "".join(f"{_size(s):>9}" for s in sizes))
        for kind, link, ranks in kinds:
            cells = []
            for s in sizes:
                t = next((p[4] for p in profile.collectives if p[:4] == (kind, link, ranks, s)), None)
                share = 1.0 if kind == "p2p" else (2 if kind == "all_reduce" else 1) * (ranks - 1) / ranks
                cells.append(f"{s * share / t / 1e9:9.3f}" if t else f"{'-':>9}")
            lines.append(f"  {kind} {link} x{ranks}".ljust(26) + "".join(cells))
    else:
        lines.append("collectives: none (one rank)")
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


# -- ranks ----------------------------------------------------------------------------------
def calibrate_rank(spec: dict, sink, *, options: dict, should_stop=lambda: False, resume=False, attempt=0) -> None:
    """One rank's part (started by backends/ray_relay.py's `_rank_main`): every benchmark with all
    ranks at once, the slowest rank's time; rank 0 sends {"event": "calibration", "profile": ...}."""
    import os

    import torch

    from workbench.runtime.loop import init_distributed

    ctx = init_distributed()
    if options["device"] != "cpu" and ctx.device.type != "cuda":
        raise WorkerError(f"resources.gpu is {options['device']}, but this rank sees no CUDA device")
    world = ctx.world_size
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = max(1, world // per_node)
    bench = _Bench(ctx, options, nodes, per_node, sink if ctx.rank == 0 else None)
    gemm = bench.gemms(options["dtypes"], options["model_shapes"], options["cubes"])
    gemm_grad = bench.grad_gemms(options["dtypes"], options.get("forward_shapes", []), options["cubes"])
    attention = bench.attention(options["dtypes"], options.get("attention_shapes", []))
    elementwise = bench.elementwise(options["dtypes"], options.get("elementwise_shapes", []))
    memory_bw = bench.memory_bw(options["elements"] if ctx.device.type == "cpu" else _GPU_ELEMENTS)
    overhead = bench.op_overhead()
    bw_dtype = {d: bench.memory_bw(options["elements"] if ctx.device.type == "cpu" else _GPU_ELEMENTS, d)
                for d in options["dtypes"] if d != "fp32"}
    collectives = bench.collectives(options["sizes"])
    probe_seconds = bench.strategy_probes(options.get("probes", []), options["probe_steps"])
    if ctx.rank == 0:
        sink({"event": "calibration", "profile": {
            "device": options["device"], "created": "1970-01-01T00:00:00+00:00", "host": socket.gethostname()[:255],
            "backend": "local", "nodes": nodes, "ranks_per_node": per_node,
            "threads_per_rank": torch.get_num_threads(), "gemm": gemm, "memory_bw": memory_bw,
            "op_overhead_s": overhead, "collectives": collectives, "memory_bw_dtype": bw_dtype,
            "cpu_cores": os.cpu_count() or 0, "probe_seconds": probe_seconds,
            "gemm_grad": gemm_grad, "attention": attention, "elementwise": elementwise}})
        sink({"event": "end", "status": "completed", "step": 0})


class _Bench:
    """The microbenchmarks of one rank. Every decision that shapes a collective sequence (repeat
    counts, the time budget) is taken from figures all ranks agreed on (an all-reduce MAX), so the
    ranks run the same collectives in the same order."""

    def __init__(self, ctx, options: dict, nodes: int, per_node: int, sink):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.ctx, self.dev = torch, dist, ctx, ctx.device
        self.nodes, self.per_node = nodes, per_node
        self.budget_s, self.repeats = options["budget_s"], options["repeats"]
        self.gemm_budget_s = options["gemm_budget_s"]
        self.sink = sink
        self.distributed = dist.is_initialized() and ctx.world_size > 1
        self.spent_s = 0.0  # agreed estimate of the time the GEMMs took so far

    def note(self, message: str) -> None:
        if self.sink is not None:
            self.sink({"event": "note", "message": f"calibrate: {message}"})

    def _sync(self) -> None:
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize()

    def _max(self, x: float) -> float:
        if not self.distributed:
            return x
        t = self.torch.tensor([x], dtype=self.torch.float64, device=self.dev)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def _barrier(self) -> None:
        if self.distributed:
            self._max(0.0)

    def time(self, fn) -> float:
        """Seconds per call of `fn`, every rank calling it at once: the slowest rank's mean over a
        run of about `budget_s`, the fastest of `repeats` runs."""
        fn()
        self._sync()
        self._barrier()
        start = time.perf_counter()
        fn()
        self._sync()
        one = self._max(time.perf_counter() - start)
        reps = max(1, min(10_000, int(self.budget_s / max(one, 1e-9))))
        runs = self.repeats if one < self.budget_s else 1
        times = []
        for _ in range(runs):
            self._barrier()
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            self._sync()
            times.append(self._max((time.perf_counter() - start) / reps))
        self.spent_s += 2 * one + sum(times) * reps
        return min(times)  # the least disturbed run: others share the host

    def gemms(self, dtypes: list, model_shapes: list, cubes: list) -> list:
        """(dtype, m, n, k, seconds): the model's shapes first, then a grid, until the budget is spent."""
        from workbench.parallel.precision import DTYPES

        torch = self.torch
        F = torch.nn.functional
        grid = [(c, c, c) for c in cubes] + [(4 * c, c, c) for c in cubes[1:-1]] + [(c, 4 * c, c) for c in cubes[1:-1]]
        limit = 2e11 if self.dev.type == "cpu" else 1e15  # FLOPs of one call: seconds at most on either
        out: list = []
        for group, shapes in (("model shapes", [tuple(s) for s in model_shapes]), ("grid", grid)):
            shapes = [s for s in shapes if 2 * s[0] * s[1] * s[2] <= limit]
            self.note(f"GEMMs, {group}: {len(shapes)} shapes x {', '.join(dtypes)}")
            for dtype in dtypes:
                dt = DTYPES[dtype]
                for m, n, k in shapes:
                    if self.spent_s > self.gemm_budget_s:
                        self.note(f"GEMM time budget ({self.gemm_budget_s:g} s) spent; {len(out)} points measured")
                        return out
                    a = torch.randn(m, k, device=self.dev).to(dt)
                    w = torch.randn(n, k, device=self.dev).to(dt)
                    # as the model runs it: nn.Linear's kernel, a fresh output each call (on CPU, bf16
                    # F.linear is ~4x torch.mm, and writing into a reused output ~2x an allocated one)
                    out.append([dtype, m, n, k, self.time(lambda a=a, w=w: F.linear(a, w))])
        return out

    def grad_gemms(self, dtypes: list, forward_shapes: list, cubes: list) -> list:
        """(kind, dtype, m, n, k, seconds) of the backward GEMMs of each forward (m, n, k) of the model
        as autograd runs them (dgrad: dY (m x n) @ W (n x k); wgrad: dY^T (n x m) @ X (m x k)), then
        of a few cubes, until the GEMM budget (spent again from zero) is spent."""
        from workbench.parallel.precision import DTYPES

        torch = self.torch
        shapes = sorted(tuple(s) for s in forward_shapes) + [(c, c, c) for c in cubes[1:-1]]
        limit = 2e11 if self.dev.type == "cpu" else 1e15
        shapes = [s for s in shapes if 2 * s[0] * s[1] * s[2] <= limit]
        self.note(f"backward GEMMs: {len(shapes)} shapes x {', '.join(dtypes)}")
        self.spent_s = 0.0
        out: list = []
        for dtype in dtypes:
            dt = DTYPES[dtype]
            for m, n, k in shapes:
                if self.spent_s > self.gemm_budget_s:
                    self.note(f"backward GEMM budget spent; {len(out)} points measured")
                    return out
                dy = torch.randn(m, n, device=self.dev).to(dt)
                w = torch.randn(n, k, device=self.dev).to(dt)
                x = torch.randn(m, k, device=self.dev).to(dt)
                out.append(["dgrad", dtype, m, k, n, self.time(lambda dy=dy, w=w: torch.mm(dy, w))])
                out.append(["wgrad", dtype, n, k, m, self.time(lambda dy=dy, x=x: torch.mm(dy.t(), x))])
        return out

    def attention(self, dtypes: list, shapes: list) -> list:
        """(pass, dtype, batch, heads, seq, head_dim, seconds) of the causal attention core as the
        models call it (scaled_dot_product_attention on (batch, heads, seq, head_dim)): its forward,
        and its backward alone (forward + backward less the forward)."""
        from workbench.parallel.precision import DTYPES

        torch = self.torch
        sdpa = torch.nn.functional.scaled_dot_product_attention
        self.note(f"attention core: {len(shapes)} shapes x {', '.join(dtypes)}")
        out: list = []
        for dtype in dtypes:
            for b, h, s, d in shapes:
                q, k, v = (torch.randn(b, h, s, d, device=self.dev).to(DTYPES[dtype]).requires_grad_()
                           for _ in range(3))
                dy = torch.randn(b, h, s, d, device=self.dev).to(DTYPES[dtype])
                fwd, bwd = self.passes(lambda q, k, v: sdpa(q, k, v, is_causal=True), [q, k, v], dy)
                out += [["fwd", dtype, b, h, s, d, fwd], ["bwd", dtype, b, h, s, d, bwd]]
        return out

    def passes(self, fn, args: list, dy) -> tuple[float, float]:
        """(forward, backward alone) seconds of `fn(*args)`: the forward recorded for backward, as
        training runs it, and forward + backward less the forward (at least 5% of the two)."""
        fwd = self.time(lambda: fn(*args))
        both = self.time(lambda: self.torch.autograd.grad(fn(*args), args, dy))
        return fwd, max(both - fwd, 0.05 * both)

    def elementwise(self, dtypes: list, shapes: list) -> list:
        """(op, pass, dtype, rows, columns, seconds) of a block's norm and activation as
        workbench/models.py calls them (with the weights the norms train): the forward, recorded as
        training does, and the backward alone (forward + backward less the forward)."""
        from workbench.parallel.precision import DTYPES

        torch = self.torch
        F = torch.nn.functional
        ops = {"layer_norm": (3, lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b)),
               "rms_norm": (2, lambda x, w: F.rms_norm(x, x.shape[-1:], w)),
               "gelu_tanh": (1, lambda x: F.gelu(x, approximate="tanh")),
               "swiglu": (2, lambda a, b: F.silu(a) * b)}
        # at most 64 Mi elements per tensor on CPU (256 MiB in fp32, a few of them at once), 1 Gi on a GPU:
        # a larger shape is priced from the nearest one measured, scaled by its elements
        limit = 1 << 26 if self.dev.type == "cpu" else 1 << 30
        shapes = [s for s in shapes if s[1] * s[2] <= limit]
        self.note(f"norms and activations: {len(shapes)} shapes x {', '.join(dtypes)}")
        out: list = []
        for dtype in dtypes:
            for op, rows, cols in shapes:
                n, fn = ops[op]
                dt = DTYPES[dtype]
                args = [torch.randn(rows, cols, device=self.dev).to(dt).requires_grad_()]
                args += [(torch.randn(rows, cols, device=self.dev) if op == "swiglu" else
                          torch.ones(cols, device=self.dev)).to(dt).requires_grad_() for _ in range(n - 1)]
                dy = torch.randn(rows, cols, device=self.dev).to(dt)
                fwd, bwd = self.passes(fn, args, dy)
                out += [[op, "fwd", dtype, rows, cols, fwd], [op, "bwd", dtype, rows, cols, bwd]]
        return out

    def memory_bw(self, elements: int, dtype: str = "fp32") -> float:
        """Bytes/s of c = a + b on tensors far larger than the caches (two reads and a write)."""
        self.note(f"memory bandwidth ({dtype})")
        from workbench.parallel.precision import DTYPES

        torch = self.torch
        dt = DTYPES[dtype]
        a, b, c = (torch.rand(elements, device=self.dev).to(dt) for _ in range(3))
        return 3 * a.element_size() * elements / self.time(lambda: torch.add(a, b, out=c))

    def op_overhead(self) -> float:
        """Seconds of one tiny op recorded by autograd (a forward op on a 16-element tensor)."""
        self.note("per-op overhead")
        x = self.torch.zeros(16, device=self.dev, requires_grad=True)
        return self.time(lambda: self.torch.mul(x, 2.0))

    def strategy_probes(self, probes: list, steps: tuple) -> list:
        """Seconds per step (rank 0's, the fastest after `steps[0]` warm-up steps of `steps[1]`, the
        least disturbed as every figure of the profile) of the runtime's own training step
        (workbench/runtime/loop.py: the same setup, step, events and meter as `run`) for each [family, spec] of `probes`; a probe on fewer ranks than the world
        runs on the first ranks while the others wait. None for a probe that failed on some rank."""
        from workbench.runtime import loop

        warm, total = steps
        out: list = []
        for family, raw in probes:
            spec = load_spec(raw)
            ranks = spec.resources.num_gpus
            self.note(f"runtime step, {family} at {spec.model.layers} blocks over {ranks} ranks")
            times: list = []
            ok = 1.0
            if self.ctx.rank < ranks:
                try:
                    times = self._probe(loop, spec, ranks, total)
                except Exception as e:  # noqa: BLE001 - a strategy this host cannot run: no figure for it
                    self.note(f"runtime step {family} failed: {type(e).__name__}: {str(e)[:200]}")
                    ok = 0.0
            agreed = self._max(0.0 if ok else 1.0) == 0.0
            out.append(min(times[warm:]) if agreed and self.ctx.rank == 0 and times else None)
        return out

    def _probe(self, loop, spec, ranks: int, steps: int) -> list:
        events: list = []

        def sink(event: dict) -> None:
            if event.get("event") == "step":
                events.append(event["step_time_s"])

        if ranks == self.ctx.world_size:
            run = loop._setup(spec, sink, loop._Started(None, 0.0))  # no start-up report
        else:  # the world is larger than the probe: its ranks build the run without a mesh (one rank)
            from workbench.data import build_token_source
            from workbench.models import build_model_meta
            from workbench.parallel.apply import parallelize
            from workbench.runtime.meter import MemoryMeter

            parallelism = Parallelism.from_spec(spec)
            parallelized = parallelize(build_model_meta(spec), None, parallelism, device=self.dev, seed=spec.train.seed)
            meter = MemoryMeter(self.dev)
            meter.watch_params(parallelized.modules)
            ctx = loop.RankContext(0, 1, self.dev)
            step_fn = loop.build_train_step(parallelized, spec, parallelism, self.dev, None)
            run = loop._Run(spec, parallelism, ctx, None, loop.coords(None), parallelized, step_fn, build_token_source(spec),
                            meter, None, None)
        for step in range(1, steps + 1):
            loop._step(run, step, 1, sink)
        return events

    def _groups(self) -> list:
        """(link, this rank's group or None for the world, ranks in it, its members): the node's ranks
        (intra) and, with several nodes, one rank per node at the same local index (inter). Every
        rank creates every group, in the same order (torch.distributed requires it)."""
        world, per = self.ctx.world_size, self.per_node
        if self.nodes == 1:
            return [("intra", None, world, list(range(world)))] if world > 1 else []
        out = []
        intra = [list(range(n * per, (n + 1) * per)) for n in range(self.nodes)]
        inter = [[n * per + i for n in range(self.nodes)] for i in range(per)]
        for link, members in (("intra", intra), ("inter", inter)):
            mine = None
            for ranks in members:
                group = self.dist.new_group(ranks)
                if self.ctx.rank in ranks:
                    mine = (link, group, len(ranks), ranks)
            if mine is not None and mine[2] > 1:
                out.append(mine)
        return out

    def collectives(self, sizes: list) -> list:
        """(kind, link, ranks, nbytes, seconds) for each message size, every group at once."""
        torch, dist, dev = self.torch, self.dist, self.dev
        out: list = []
        for link, group, n, members in self._groups():
            self.note(f"collectives {link}-node over {n} ranks: {len(sizes)} sizes")
            me = members.index(self.ctx.rank)
            peer = members[me ^ 1] if (me ^ 1) < n else None  # p2p pairs: 0-1, 2-3, ...
            for nbytes in sizes:
                numel = max(n, nbytes // 4 // n * n)
                full = torch.ones(numel, device=dev)
                part = torch.ones(numel // n, device=dev)
                fns = {"all_reduce": partial(dist.all_reduce, full, group=group),
                       "all_gather": partial(dist.all_gather_into_tensor, full, part, group=group),
                       "reduce_scatter": partial(dist.reduce_scatter_tensor, part, full, group=group)}
                for kind, fn in fns.items():
                    out.append([kind, link, n, numel * 4, self.time(fn)])
                out.append(["p2p", link, 2, numel * 4, self.time(self._ping_pong(full, peer, me % 2 == 0)) / 2])
        return out

    def _ping_pong(self, t, peer: int | None, first: bool):
        dist = self.dist

        def fn():
            if peer is None:
                return
            if first:
                dist.send(t, peer)
                dist.recv(t, peer)
            else:
                dist.recv(t, peer)
                dist.send(t, peer)
        return fn
