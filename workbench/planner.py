"""`workbench plan`: every valid layout for the spec's GPUs, the ones that fit, fastest first, priced.

Searches dp x tp x pp (tp inside a node and dividing the heads, pp <= layers), ZeRO 0-3,
CPU offload, activation checkpointing, micro-batch sizes, pipeline schedules and their virtual
stages, and (when nothing else fits) ZeRO-Infinity's nvme layouts, with the
memory model (workbench.memory) and the step-time model (workbench.steptime).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from workbench.memory import Layout
from workbench.memory.estimate import _stage_params, device_used, stage_fixed, stage_mode
from workbench.prices import PRICES_DATE, load_prices
from workbench.steptime import Hardware, step_time
from workbench.validate import check_layout_rules, zero_bubble_refused

# With offload=cpu, the offloaded states of the node's ranks share its RAM with the processes
# and pinned staging buffers.
HOST_USABLE_FRACTION = 0.8
# The most layouts one plan prices (~0.5 ms each): 64 H100s for a 70B model take 5,323. A spec at
# the bounds (131,072 GPUs, a highly composite global batch) has millions; the search stops here
# and says so, so `plan` answers in seconds whatever the spec.
MAX_SEARCHED = 8192


@dataclass
class Candidate:
    layout: dict
    micro_batch: int
    fits: bool
    peak_bytes: int
    step_time_s: float
    tokens_per_s: float
    mfu: float | None  # None on CPU: no tensor-core peak to be a share of
    usd_per_hour: float = 0.0
    usd_per_hour_spot: float = 0.0
    cloud: str | None = None
    prices: dict = field(default_factory=dict)
    usd_per_billion_tokens: float = 0.0
    usd_per_billion_tokens_spot: float = 0.0
    runnable: bool | None = None  # can this release's runtime run it (checked for the top ones)
    not_runnable: str | None = None


@dataclass
class PlanResult:
    """Ranked candidates; `to_dict(top=)` is the `workbench plan --json` contract."""

    candidates: list[Candidate]
    world_size: int
    device: str
    searched: int
    elapsed_s: float
    notes: list[str] = field(default_factory=list)
    given: Candidate | None = None  # the spec's own layout, scored like a candidate
    given_error: str | None = None  # why the spec's layout could not be scored (it breaks a rule)
    source: str = "catalog defaults"  # where the step-time figures come from (a calibrated profile or the catalog)

    def to_dict(self, top: int | None = None) -> dict:
        cands = self.candidates[:top] if top else self.candidates
        given = asdict(self.given) if self.given else None
        return {"given": given, **({"given_error": self.given_error} if self.given_error else {}),
                "candidates": [asdict(c) for c in cands], "world_size": self.world_size, "device": self.device,
                "searched": self.searched, "fitting": sum(c.fits for c in self.candidates),
                "prices_date": PRICES_DATE, "elapsed_s": round(self.elapsed_s, 4), "notes": self.notes,
                "source": self.source}

    def table(self, top: int = 10) -> str:
        head = (f"{'#':>3} {'dp':>4} {'tp':>5} {'pp':>3} {'zero':>4} {'offload':>7} {'ckpt':>9} "
                f"{'schedule':>19} {'mb':>3} {'peak GiB':>9} {'step s':>8} {'tok/s':>10} {'MFU':>5} {'$/h':>8} {'$/h spot':>9} {'$/B tok':>8}")
        lines = [head, "-" * len(head)]
        if self.given:
            lines += [_row("you", self.given), "-" * len(head)]
        elif self.given_error:
            lines += [f"you: the spec's layout is not valid here: {self.given_error.splitlines()[0]}", "-" * len(head)]
        lines += [_row(str(i), c) for i, c in enumerate(self.candidates[:top], 1)]
        fitting = sum(c.fits for c in self.candidates)
        lines.append(f"{fitting} layouts fit on {self.world_size} x {self.device} ({self.searched} searched in "
                     f"{self.elapsed_s:.2f} s); prices {PRICES_DATE}, cheapest cloud; $/B tok = USD per billion "
                     "tokens on spot; +sp = sequence parallel, vN = virtual stages per rank.")
        lines.append(f"step times: {self.source}")
        if self.device == "cpu":
            lines.append("MFU: not given on CPU (a share of an accelerator's tensor-core peak)")
        if any(c.runnable is False for c in self.candidates[:top]):
            lines.append("* not runnable by this release's runtime yet (planned for the hardware; "
                         "`workbench validate` + run says why)")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return "<pre>" + self.table().replace("&", "&amp;").replace("<", "&lt;") + "</pre>"


def _row(label: str, c: Candidate) -> str:
    """One line of the plan table."""
    lay = c.layout
    sched = lay["pp_schedule"] if lay["pp"] > 1 else "-"
    if lay.get("virtual_stages", 1) > 1:
        sched += f" v{lay['virtual_stages']}"
    tp = f"{lay['tp']}{'+sp' if lay.get('sequence_parallel') else ''}"
    mfu = "-" if c.mfu is None else f"{c.mfu:.0%}"
    return (f"{label:>3} {lay['dp']:>4} {tp:>5} {lay['pp']:>3} {lay['zero']:>4} {lay['offload']:>7} "
            f"{lay['activation_checkpointing']:>9} {sched:>19} {c.micro_batch:>3} {c.peak_bytes / 2**30:>9.1f} "
            f"{c.step_time_s:>8.2f} {c.tokens_per_s:>10,.0f} {mfu:>5} {c.usd_per_hour:>8.2f} "
            f"{c.usd_per_hour_spot:>9.2f} {c.usd_per_billion_tokens_spot:>8.0f}" + ("" if c.fits else "  DOES NOT FIT")
            + ("  *" if c.runnable is False else ""))


def _divisors(n: int) -> list[int]:
    from workbench.shapes import divisors

    return divisors(n)


# Virtual stages per pipeline rank searched for interleaved 1F1B: more shrink the bubble and add
# stage boundaries (sends); each stage keeps at least one block. Zero-bubble's bubble does not
# shrink with more (steptime._bubble), so it is searched at 2, its smallest.
VIRTUAL_STAGES = (2, 4, 8)


def _schedules(pp: int, layers: int, num_micro: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs a pipeline of `pp` ranks over `layers` blocks can run
    with `num_micro` micro-batches. GPipe has 1F1B's bubble and holds more micro-batches, so it
    is only offered where 1F1B cannot run (fewer micro-batches than stages)."""
    if num_micro < pp:
        return [("gpipe", 1)]
    from workbench.spec import MAX_PP

    stages = min(layers, MAX_PP)  # each stage holds a block; validate refuses more than MAX_PP stages
    multi = [("interleaved-1f1b", v) for v in VIRTUAL_STAGES if pp * v <= stages]
    return [("1f1b", 1), *multi, *([("zero-bubble", 2)] if 2 * pp <= stages else [])]


def _layouts(spec, shape, world: int, gpn: int, nvme: bool = False):
    """Every (dp, tp, pp, zero, offload, schedule, micro_batch), each with its checkpointing options.

    nvme: instead, the ZeRO-Infinity layouts (zero 2/3 with offload=nvme, which the runtime runs
    with tp = pp = 1), searched when nothing else fits."""
    from workbench.spec import MAX_PP

    gb = spec.train.global_batch
    device = "cpu" if spec.resources.gpu == "cpu" else "cuda"
    for tp in _divisors(min(world, gpn)):
        if gpn % tp or any(v % tp for v in (shape.heads, shape.kv_heads, shape.hidden, shape.ffn_hidden)):
            continue
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            if pp > shape.layers or pp > MAX_PP or gb % dp:
                continue
            for mb in _divisors(gb // dp):
                m = gb // (dp * mb)
                for sched, v in ([("1f1b", 1)] if pp == 1 else _schedules(pp, shape.layers, m)):
                    for zero in ((0, 1, 2, 3) if dp > 1 else (0,)):
                        if zero_bubble_refused(pp, zero, sched):  # the runtime refuses it: not a candidate
                            continue
                        # CPU offload is FSDP2's CPUOffloadPolicy: zero 2/3 only (docs/strategies.md);
                        # a CPU device has nothing to offload to.
                        offloads: tuple[str, ...] = ("none", "cpu") if zero >= 2 and device == "cuda" else ("none",)
                        if nvme:
                            offloads = ("nvme",) if zero >= 2 and tp == 1 and pp == 1 else ()
                        for off in offloads:
                            # Checkpointing modes from fastest to leanest: the planner keeps
                            # the first that fits (the others are slower and add nothing).
                            yield [Layout(dp=dp, tp=tp, pp=pp, zero=zero, offload=off, activation_checkpointing=ckpt,
                                          checkpoint_every=spec.layout.checkpoint_every, pp_schedule=sched,
                                          virtual_stages=v,
                                          sequence_parallel=tp > 1 and shape.seq_len % tp == 0,
                                          micro_batch=mb, num_micro=m,
                                          dtype=spec.precision.dtype, optimizer=spec.train.optimizer,
                                          bucket_mb=spec.layout.bucket_mb, device=device)
                                   for ckpt in ("none", "selective", "full")]


def _peak(shape, lay: Layout) -> tuple[int, int]:
    """(allocated peak, host/disk bytes) over the stages that can be largest (`_peaks`)."""
    return next(_peaks(shape, [lay], {}))


def _peaks(shape, modes: list[Layout], priced_modes: dict) -> Iterator[tuple[int, int]]:
    """`_peak` of each layout of one option group in turn (they differ only in activation
    checkpointing; the search stops at the first that fits).

    Stage 0 holds the most micro-batches in flight (and the extra blocks of an uneven split);
    the last stage holds the head and the logits. Middle stages are never above both.
    A mode's activations and recomputed bytes read neither zero, offload nor dp: `priced_modes`
    keeps them for the option groups that differ only in those (memory.estimate.stage_mode).
    """
    first = modes[0]
    stages = sorted({0, first.pp - 1})
    fixed = [stage_fixed(shape, first, k) for k in stages]
    host = max(int(f.host) for f in fixed)  # offloaded states: no mode changes them
    for mode in modes:
        key = (mode.tp, mode.pp, mode.chunks, mode.pp_schedule, mode.sequence_parallel, mode.micro_batch,
               mode.num_micro, mode.activation_checkpointing)
        parts = priced_modes.get(key)
        if parts is None:
            parts = priced_modes[key] = [stage_mode(shape, mode, k)[:2] for k in stages]
        yield max(f.peak(a, rec) for f, (a, rec) in zip(fixed, parts)), host


def plan(spec, prices=None, top: int | None = None, profile=None) -> PlanResult:
    """Rank the layouts that fit the spec's resources by predicted tokens/s.

    Args:
        spec: a JobSpec, or anything `workbench.load_spec` accepts.
        prices: price override (YAML path or dict, see workbench.prices.load_prices).
        top: keep only the best `top` candidates.
        profile: a HardwareProfile (workbench.hwprofile), a path to one, or None: the profile
            `workbench calibrate` saved for the spec's GPU type if there is one, else the catalog.
    Returns:
        PlanResult, best first.
    Raises:
        ConfigError: a model without a shape ({params: N} or a factory).
    """
    from workbench.catalog import get_device
    from workbench.errors import ConfigError
    from workbench.spec import load_spec

    t0 = time.perf_counter()
    spec = load_spec(spec, layout=False)
    if spec.model.params is not None or spec.model.factory is not None:
        raise ConfigError("plan needs the model's shape to price compute and activations: give a preset or "
                          "{family, layers, hidden, heads, vocab, seq_len}. For a bare size, `workbench memory` "
                          "gives the model states per rank.")
    shape = spec.model.shape()
    dev = get_device(spec.resources.gpu)
    hw = hardware(dev, spec.resources.gpus_per_node, profile)
    dev_prices = load_prices(prices).get(dev.name, {})
    fitting, misses, searched, truncated = _search(spec, shape, dev, hw, dev_prices)
    fitting.sort(key=lambda c: (-c.tokens_per_s, c.peak_bytes))
    notes = _notes(dev, fitting, truncated)
    if not fitting:
        misses.sort(key=lambda x: x[0])
        fitting = [_candidate(shape, lay, hw, spec, peak, False, dev_prices) for peak, lay in misses[:10]]
        notes.append("nothing fits: these are the smallest peaks; add GPUs, lower micro_batch or seq_len")
    if not dev_prices:
        notes.append(f"no price known for {dev.name}: pass prices= or set WORKBENCH_PRICES")
    missing = _unmeasured_shapes(spec, hw.profile) if hw.profile is not None else []
    untimed = _untimed_ops(spec, hw.profile) if hw.profile is not None else []
    if missing or untimed:
        what = [f"{len(missing)} of this model's forward matmul shapes (e.g. {' x '.join(map(str, missing[0]))})"] \
            if missing else []
        what += [f"its {' and '.join(untimed)} in {spec.precision.dtype}"] if untimed else []
        notes.append(f"the hardware profile did not time {' nor '.join(what)} (calibrated on another model, "
                     "micro-batch, tp or dtype, or by an older workbench): its step times extrapolate what it "
                     "measured. `workbench calibrate SPEC` with this spec times the model's own GEMMs, attention, "
                     "norms, activation and runtime step")
    result = fitting[:top] if top else fitting
    for c in result[:max(top or 0, 20)]:
        _check_runnable(spec, c)
    given, given_error = _given(spec, shape, hw, dev_prices)
    return PlanResult(result, spec.resources.num_gpus, dev.name, searched, time.perf_counter() - t0, notes, given, given_error,
                      source=hw.source)


def _fits(dev, lay: Layout, peak: int, host: int) -> bool:
    """The allocated peak plus what CUDA adds fits the device, and offloaded states fit the host."""
    host_ok = lay.offload == "none" or not dev.host_memory_bytes or host <= dev.host_memory_bytes * HOST_USABLE_FRACTION
    return device_used(peak, lay) <= dev.memory_bytes and host_ok


def _search(spec, shape, dev, hw: Hardware, dev_prices: dict):
    """(fitting candidates, (peak, layout) of the misses, layouts searched, search truncated)."""
    fitting: list[Candidate] = []
    misses: list[tuple[int, Layout]] = []
    searched, truncated = 0, False
    priced_modes: dict = {}
    world, gpn = spec.resources.num_gpus, spec.resources.gpus_per_node
    for nvme in (False, True):  # ZeRO-Infinity (files) only when nothing fits in device + host memory
        if fitting or truncated:
            break
        for options in _layouts(spec, shape, world, gpn, nvme=nvme):
            if searched >= MAX_SEARCHED:
                truncated = True
                break
            if not _runtime_accepts(shape, options[0], spec.train.global_batch):
                continue
            for lay, (peak, host) in zip(options, _peaks(shape, options, priced_modes)):
                searched += 1
                if _fits(dev, lay, peak, host):
                    fitting.append(_candidate(shape, lay, hw, spec, peak, True, dev_prices))
                    break
                misses.append((peak, lay))
    return fitting, misses, searched, truncated


def _runtime_accepts(shape, lay: Layout, global_batch: int) -> bool:
    """The layout passes every rule `validate` and `run` apply to it (validate.check_layout_rules, the
    ones `step_time` enforces): the planner ranks no layout the runtime refuses. The checkpointing modes
    of one option group differ in nothing these rules read."""
    from workbench.errors import ConfigError

    try:
        check_layout_rules(shape, lay, global_batch)
    except ConfigError:
        return False
    return True


def _notes(dev, fitting: list[Candidate], truncated: bool) -> list[str]:
    notes = [f"fits = the allocated peak + the allocator's reserve, CUDA context and NCCL buffers <= "
             f"{dev.memory_bytes / 2**30:.1f} GiB (workbench/memory/estimate.py: device_used)"]
    if dev.host_memory_bytes:
        notes.append(f"offload=cpu fits when the offloaded states <= {HOST_USABLE_FRACTION:.0%} of "
                     f"{dev.host_memory_bytes / 2**30:.0f} GiB host memory per GPU")
    if fitting and fitting[0].layout["offload"] == "nvme":
        notes.append("nothing fits in device and host memory: these layouts keep the fp32 shards and optimizer "
                     "state in files (offload=nvme, ZeRO-Infinity)")
    if truncated:
        notes.append(f"search stopped after {MAX_SEARCHED:,} layouts (the bound on one plan's work; tp, pp and "
                     "micro-batch sizes are searched in ascending order): fewer GPUs or a global_batch with fewer "
                     "divisors search everything")
    return notes


def _unmeasured_shapes(spec, profile) -> list:
    """The (m, n, k) forward GEMMs of `spec`'s model at its micro-batch and tp that `profile` did not time."""
    from workbench.shapes import forward_gemm_shapes

    shape = spec.model.shape()
    measured = {tuple(int(x) for x in p[1:4]) for p in profile.gemm}
    return [s for s in forward_gemm_shapes(shape, spec.train.micro_batch * shape.seq_len, spec.layout.tp or 1)
            if tuple(s) not in measured]


def _untimed_ops(spec, profile) -> list:
    """The norm and activation of `spec`'s model (workbench/shapes.py ELEMENTWISE) that `profile` did
    not time in the spec's dtype (the step-time model then prices them by their bytes)."""
    from workbench.shapes import ELEMENTWISE

    timed = {(p[0], p[2]) for p in profile.elementwise}
    return [op for op in ELEMENTWISE[spec.model.shape().family] if (op, spec.precision.dtype) not in timed]


def hardware(dev, gpus_per_node: int, profile=None) -> Hardware:
    """The Hardware the step-time model asks: `profile` (a HardwareProfile or its path), else the
    profile `workbench calibrate` saved for this device type, else the catalog's figures."""
    from workbench.errors import ConfigError
    from workbench.hwprofile import find_profile

    if profile is None or isinstance(profile, str) or hasattr(profile, "__fspath__"):
        profile = find_profile(dev.name, None if profile is None else str(profile))
    elif profile.device != dev.name:
        raise ConfigError(f"the hardware profile was measured on {profile.device!r} but the spec asks for "
                          f"{dev.name!r} (resources.gpu): calibrate on {dev.name} (`workbench calibrate SPEC`) or "
                          "plan without that profile")
    return Hardware(dev, gpus_per_node, profile)


def _given(spec, shape, hw, dev_prices: dict):
    """(the spec's own layout scored like a candidate, None) or (None, why it breaks a rule)."""
    from workbench.errors import ConfigError
    from workbench.memory import layout_from_spec
    from workbench.validate import validate_spec

    try:
        validate_spec(spec)
        lay = layout_from_spec(spec)
        peak, host = _peak(shape, lay)
        c = _candidate(shape, lay, hw, spec, peak, _fits(hw.dev, lay, peak, host), dev_prices)
    except ConfigError as e:  # a rule of validate's, or one of run's that step_time enforces too
        return None, str(e)
    _check_runnable(spec, c)
    return c, None


def _check_runnable(spec, c: Candidate) -> None:
    """Ask the runtime's own rules whether this layout runs today (validate.check_runnable)."""
    from workbench.errors import ConfigError
    from workbench.spec import load_spec
    from workbench.validate import check_runnable

    raw = spec.to_dict()
    raw["layout"] = {**raw.get("layout", {}), **c.layout}
    raw["train"] = {**raw.get("train", {}), "micro_batch": c.micro_batch}
    try:
        check_runnable(load_spec(raw))
        c.runnable = True
    except ConfigError as e:
        c.runnable, c.not_runnable = False, str(e).splitlines()[0]


def _candidate(shape, lay: Layout, hw: Hardware, spec, peak: int, fits: bool, dev_prices: dict) -> Candidate:
    p, shard = _stage_params(shape, lay.tp, lay.pp, 0, lay.chunks, lay.dp)
    st = step_time(shape, lay, hw.dev, spec.train.global_batch, hw.gpus_per_node, p, shard, hw=hw)
    layout = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "zero": lay.zero, "offload": lay.offload,
              "activation_checkpointing": lay.activation_checkpointing, "pp_schedule": lay.pp_schedule,
              "sequence_parallel": lay.sequence_parallel}
    if lay.multi_stage:
        layout["virtual_stages"] = lay.virtual_stages
    c = Candidate(layout, lay.micro_batch, fits, int(peak), st.step_time_s, st.tokens_per_s, st.mfu)
    n = lay.world_size
    per_b = 1e9 / (st.tokens_per_s * 3600)
    for cloud, price in dev_prices.items():
        c.prices[cloud] = {"instance": price.instance, "usd_per_hour": round(price.on_demand * n, 2),
                           "usd_per_hour_spot": round(price.spot * n, 2),
                           "usd_per_billion_tokens": round(price.on_demand * n * per_b, 2),
                           "usd_per_billion_tokens_spot": round(price.spot * n * per_b, 2)}
    if c.prices:
        c.cloud = min(c.prices, key=lambda k: c.prices[k]["usd_per_hour_spot"])
        best = c.prices[c.cloud]
        c.usd_per_hour, c.usd_per_hour_spot = best["usd_per_hour"], best["usd_per_hour_spot"]
        c.usd_per_billion_tokens = best["usd_per_billion_tokens"]
        c.usd_per_billion_tokens_spot = best["usd_per_billion_tokens_spot"]
    return c
