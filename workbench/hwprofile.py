"""A hardware profile: what `workbench calibrate` measured on the user's own cluster (GEMM time by
shape, memory bandwidth, per-op overhead, collectives by message size), read by the step-time model.

Torch-free: planning never imports torch. The file is YAML (`save_profile` / `load_profile`), found
by `find_profile`: an explicit path, then $WORKBENCH_PROFILE, then $WORKBENCH_HOME/profiles/<device>.yaml.
"""
from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path

from workbench.errors import ConfigError, did_you_mean
from workbench.spec_input import clip, parse_yaml, read_bounded

FORMAT = "workbench-hwprofile/1"
MAX_PROFILE_BYTES = 1 << 20  # a profile is ~20 KiB; a file past 1 MiB is not one
MAX_POINTS = 1_500  # measured points per table (calibrate writes ~200; the YAML loader stops at 20,000 values)
MAX_RANKS = 1 << 17  # as a spec's bound (workbench/spec_input.py)
MAX_DIM = 1 << 31  # a GEMM dimension
# Memory bandwidth (bytes/s): 1 MB/s is below any memory; 1e14 is 20x an H200's HBM.
MIN_MEMORY_BW, MAX_MEMORY_BW = 1e6, 1e14
DTYPES = ("fp32", "bf16", "fp16")
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
LINKS = ("intra", "inter")
# A linear layer's backward GEMMs as autograd runs them: the input gradient dY @ W (both operands as
# stored) and the weight gradient dY^T @ X (the first operand transposed). On a CPU without bf16 units
# the first runs ~5x slower than the forward's F.linear in bf16, so they are measured apart.
GRAD_KINDS = ("dgrad", "wgrad")
ATTENTION_PASSES = ("fwd", "bwd")  # the attention core's forward, and its backward alone
ELEMENTWISE_OPS = ("layer_norm", "rms_norm", "gelu_tanh", "swiglu")  # workbench/shapes.py ELEMENTWISE
BACKENDS = ("local", "ray")
# Strategy families whose fixed per-step and per-block costs `workbench calibrate` measures by running
# the runtime's own step on a near-empty model (workbench/calibrate.py, strategy_probes), in the order
# a layout is matched to one (workbench/steptime.py, overhead_family).
FAMILIES = ("pp", "tp", "zero3", "zero2", "zero1", "ddp", "single")
# What each family's step costs beyond the modelled work: per step; per block and micro-batch (hooks,
# wrapper dispatch) and per parameter of that block; per block once a step (gradient reduction and
# copies after the last micro-batch) and per parameter of that block. The first two are required.
OVERHEAD_KEYS = ("per_step_s", "per_block_s", "per_block_param_s", "per_block_step_s", "per_block_step_param_s")
# A dtype that was not measured is priced as the nearest one that was (fp16 and bf16 run on the
# same units on every device we know; fp32 is the slow path).
_DTYPE_FALLBACK = {"fp16": ("bf16", "fp32"), "bf16": ("fp16", "fp32"), "fp32": ("bf16", "fp16")}


def _ring(kind: str, size: int) -> tuple[float, float]:
    """(latency steps, share of the full tensor's bytes each rank sends) of a ring collective over
    `size` ranks, as in workbench/steptime.py collective_s."""
    if kind == "p2p":
        return 1.0, 1.0
    steps = 2 * (size - 1) if kind == "all_reduce" else size - 1
    return float(steps), steps / size


@dataclass(frozen=True)
class GemmFit:
    """t(m, n, k) = t0 + 2 (m + am)(n + an)(k + ak) / rate: smooth, increasing in every dimension,
    `rate` the large-GEMM FLOP/s, (am, an, ak) the width below which each dimension fills the
    units poorly (a short reduction dimension k costs differently from few rows m), `t0` the fixed
    cost of a call; extrapolates linearly in each dimension."""

    rate: float
    a: tuple  # (am, an, ak)
    t0: float
    worst: float  # largest |relative error| over the measured points

    def seconds(self, m: float, n: float, k: float) -> float:
        am, an, ak = self.a
        return self.t0 + 2.0 * (m + am) * (n + an) * (k + ak) / self.rate


def _solve(pts: list, a: tuple, min_c: float = 0.0) -> tuple[float, float, float] | None:
    """(sum of squared relative errors, t0, 1/rate) minimising sum((t0 + c x_i) / t_i - 1)^2 over
    t0 >= 0, c > 0 for fixed widths `a` (a 2x2 linear solve); None without a positive slope. A
    slope under `min_c` (a rate over the device's peak) is held at `min_c`, and t0 solved for it."""
    am, an, ak = a
    u = [1 / t for *_, t in pts]
    v = [2 * (m + am) * (n + an) * (k + ak) / t for m, n, k, t in pts]
    suu, svv, suv = sum(x * x for x in u), sum(x * x for x in v), sum(p * q for p, q in zip(u, v))
    su, sv = sum(u), sum(v)
    det = suu * svv - suv * suv
    t0, c = 0.0, sv / svv
    if len(pts) > 1 and det > 1e-12 * suu * svv:
        t0_, c_ = (su * svv - sv * suv) / det, (sv * suu - su * suv) / det
        if t0_ >= 0 and c_ > 0:
            t0, c = t0_, c_
    if c <= 0 and not min_c:
        return None
    if c < min_c:
        c = min_c
        t0 = max(0.0, sum(p * (1 - c * q) for p, q in zip(u, v)) / suu)
    return sum((t0 * p + c * q - 1) ** 2 for p, q in zip(u, v)), t0, c


def fit_gemm(points, max_rate: float | None = None) -> GemmFit:
    """Least relative squared error fit of GemmFit through (m, n, k, seconds) points: the widths on
    a coarse log grid, then refined one dimension at a time; t0 and 1/rate solved exactly for each.

    Points whose times barely grow with size (a GPU's small GEMMs are launch-bound: ~12 us each)
    cannot tell the rate or the widths: each width stays within 4x the largest size measured in its
    dimension, and the rate at most `max_rate` (the device's data-sheet peak).
    """
    pts = [(float(m), float(n), float(k), float(t)) for m, n, k, t in points]
    caps = [4 * max(p[d] for p in pts) for d in range(3)]
    min_c = 1 / max_rate if max_rate else 0.0
    grid = [0.0, 2.0, 8.0, 32.0, 128.0, 512.0, 2048.0]
    best = None
    for a in ((x, y, z) for x in grid for y in grid for z in grid if x <= caps[0] and y <= caps[1] and z <= caps[2]):
        got = _solve(pts, a, min_c)
        if got is not None and (best is None or got[0] < best[0][0] - 1e-15):
            best = (got, a)
    if best is None:  # no positive slope at any width: times do not grow with size (noise only)
        t = sorted(p[3] for p in pts)[len(pts) // 2]
        big = max(2 * m * n * k for m, n, k, _ in pts)
        return GemmFit(rate=big / t, a=(0.0, 0.0, 0.0), t0=0.0, worst=max(abs(p[3] / t - 1) for p in pts))
    for factor in (2.0, 2 ** 0.5, 2 ** 0.25, 2 ** 0.125):
        improved = True
        while improved:
            improved = False
            for dim in range(3):
                for cand in (min(best[1][dim] * factor, caps[dim]), best[1][dim] / factor,
                             min(max(best[1][dim], 1.0) * factor, caps[dim])):
                    a = (cand, best[1][1], best[1][2]) if dim == 0 else (
                        (best[1][0], cand, best[1][2]) if dim == 1 else (best[1][0], best[1][1], cand))
                    got = _solve(pts, a, min_c)
                    if got is not None and got[0] < best[0][0] * (1 - 1e-9):
                        best, improved = (got, a), True
    (_, t0, c), a = best
    worst = max(abs((t0 + 2 * c * (m + a[0]) * (n + a[1]) * (k + a[2])) / t - 1) for m, n, k, t in pts)
    return GemmFit(rate=1 / c, a=tuple(a), t0=t0, worst=worst)


@dataclass(frozen=True)
class HardwareProfile:
    """What `workbench calibrate` measured; every figure with all ranks of a node busy at once,
    as training uses the host.

    gemm: (dtype, m, n, k, seconds) of one (m x k) @ (k x n).
    collectives: (kind, link, ranks, nbytes, seconds), nbytes the full tensor (the all-reduced
    tensor, the gathered output, the reduce-scatter input, the message of a p2p send).
    """

    device: str  # catalog device name it refines (workbench/catalog.py), e.g. "cpu", "h100-80gb"
    created: str  # ISO 8601 UTC
    host: str  # rank 0's hostname only (no environment, no secrets)
    backend: str  # backend it ran through ("local", "ray")
    nodes: int
    ranks_per_node: int
    threads_per_rank: int  # torch intra-op threads each rank used (CPU)
    gemm: tuple  # (dtype, m, n, k, seconds)
    memory_bw: float  # bytes/s per rank, elementwise work on large tensors, all ranks busy
    op_overhead_s: float  # seconds per small op (dispatch / launch)
    collectives: tuple  # (kind, link, ranks, nbytes, seconds)
    # Optional (profiles of calibrate before #28 item 3 lack them; the model then leaves them out):
    # bytes/s of elementwise work per dtype other than fp32 (a CPU without bf16 units moves half the bytes)
    memory_bw_dtype: tuple = ()  # ((dtype, bytes/s), ...)
    # per strategy family, what the runtime's step costs beyond the modelled work, from `probes`:
    # (family, *the OVERHEAD_KEYS figures: seconds per step; per block and micro-batch, and per
    # parameter of that block; per block once a step, and per parameter of that block)
    overheads: tuple = ()
    # the runtime steps it was read off: (family, dp, tp, pp, layers, micro-batches, measured s, modelled s)
    probes: tuple = ()
    cpu_cores: int = 0  # logical CPUs the host offered its ranks (0: not recorded)
    # (kind, dtype, m, n, k, seconds) of backward GEMMs in autograd's layout (GRAD_KINDS): dgrad is
    # mm(A (m x k), B (k x n)), wgrad mm(A^T, B) with A stored (k x m)
    gemm_grad: tuple = ()
    # (pass, dtype, batch, heads, seq, head_dim, seconds) of the fused causal attention core
    # (scaled_dot_product_attention) at the model's shapes: its kernels are not GEMMs (on a CPU,
    # bf16's backward ran 3x fp32's, where bf16 GEMMs ran 2x faster than fp32's)
    attention: tuple = ()
    # (op, pass, dtype, rows, columns, seconds) of a block's norm and activation (ELEMENTWISE_OPS) at
    # the model's shapes, forward and backward alone: on a CPU their transcendental math, not their
    # bytes, sets the time (tanh GELU at 256 x 256 fp32 ran 4x its bytes at the measured bandwidth)
    elementwise: tuple = ()
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        # every overheads row as (family, *OVERHEAD_KEYS' figures): the optional ones 0 when left out
        rows = tuple((fam, *costs, *(0.0,) * (len(OVERHEAD_KEYS) - len(costs))) for fam, *costs in self.overheads)
        object.__setattr__(self, "overheads", rows)

    # -- GEMMs --------------------------------------------------------------------------------
    def gemm_fit(self, dtype: str) -> GemmFit:
        """The fit for `dtype`, or for the nearest measured dtype when it was not measured."""
        d = self._measured_dtype(dtype)
        key = ("gemm", d)
        if key not in self._cache:
            self._cache[key] = fit_gemm([p[1:] for p in self.gemm if p[0] == d], self._peak(d))
        return self._cache[key]

    def _peak(self, dtype: str) -> float | None:
        """The catalog's data-sheet FLOP/s of a GPU in `dtype`, the most a fit may claim (None on
        CPU, whose catalog figures are nominal)."""
        from workbench.catalog import get_device

        return None if self.device == "cpu" else get_device(self.device).compute_flops.get(dtype)

    def _measured_dtype(self, dtype: str) -> str:
        """`dtype`, or the nearest dtype whose GEMMs were measured when it was not."""
        for d in (dtype, *_DTYPE_FALLBACK.get(dtype, DTYPES)):
            if d in self.gemm_dtypes:
                return d
        raise ConfigError(f"hardware profile for {self.device}: no GEMM was measured. Run `workbench calibrate` again.")

    @cached_property
    def gemm_dtypes(self) -> tuple:
        return tuple(sorted({p[0] for p in self.gemm}))

    def gemm_s(self, m: int, n: int, k: int, dtype: str) -> float:
        """Seconds of one (m x k) @ (k x n) in `dtype` on one rank while the others run theirs: the
        measured time where this very shape was measured (calibrate measures the spec's own GEMMs),
        else the GemmFit through the measured points (increasing in m, n and k; linear past them)."""
        d = self._measured_dtype(dtype)
        exact = self._exact(("gemm", d), lambda: [p[1:] for p in self.gemm if p[0] == d]).get((m, n, k))
        return exact if exact is not None else self.gemm_fit(dtype).seconds(m, n, k)

    def _exact(self, key: tuple, points: Callable[[], list]) -> dict:
        """{(m, n, k): median seconds} of `points()` (m, n, k, seconds), cached under `key`. One smooth
        surface cannot follow every kernel choice: on a CPU, bf16's input-gradient GEMMs run 5-20x
        slower than its forward ones of the same size, and the fit misses them by up to 2x."""
        key = ("exact", *key)
        if key not in self._cache:
            by_shape: dict = {}
            for m, n, k, t in points():
                by_shape.setdefault((int(m), int(n), int(k)), []).append(float(t))
            self._cache[key] = {shape: sorted(ts)[len(ts) // 2] for shape, ts in by_shape.items()}
        return self._cache[key]

    def grad_gemm_s(self, kind: str, m: int, n: int, k: int, dtype: str) -> float | None:
        """Seconds of a backward GEMM of `kind` (GRAD_KINDS) giving an (m x n) result over k: measured
        (see gemm_s), else from the fit through the measured backward GEMMs of `dtype`; None when none
        of that dtype was measured."""
        key = ("grad", kind, dtype)

        def points() -> list:
            return [p[2:] for p in self.gemm_grad if p[0] == kind and p[1] == dtype]

        if key not in self._cache:
            pts = points()
            self._cache[key] = fit_gemm(pts, self._peak(dtype)) if pts else None
        fit = self._cache[key]
        exact = self._exact(key, points).get((m, n, k))
        return exact if exact is not None else (None if fit is None else fit.seconds(m, n, k))

    def attention_s(self, kind: str, dtype: str, batch_heads: float, seq: int, head_dim: int) -> float | None:
        """Seconds of the causal attention core's `kind` pass (ATTENTION_PASSES) over `batch_heads`
        sequence-heads of `seq` x `head_dim`: the measured row of `dtype` nearest in sequence and head
        size, scaled by the work (batch x heads x seq^2 x head_dim); None when none of `dtype` was measured."""
        rows = [r for r in self.attention if r[0] == kind and r[1] == dtype]
        if not rows:
            return None
        _, _, b, h, s, d, t = min(rows, key=lambda r: (abs(math.log(r[4] / seq)) + abs(math.log(r[5] / head_dim)),
                                                        -r[2] * r[3]))
        return t * (batch_heads * seq * seq * head_dim) / (b * h * s * s * d)

    def elementwise_s(self, op: str, kind: str, dtype: str, rows: float, cols: int) -> float | None:
        """Seconds of `op`'s `kind` pass (ATTENTION_PASSES) over `rows` x `cols` elements: the measured
        row of `dtype` nearest in element count (the same width first), scaled by the elements;
        None when `op` was not measured in `dtype`."""
        found = [r for r in self.elementwise if r[:3] == (op, kind, dtype)]
        if not found:
            return None
        n = rows * cols
        *_, r, c, t = min(found, key=lambda r: (r[4] != cols, abs(math.log(r[3] * r[4] / n))))
        return t * n / (r * c)

    def gemm_flops(self, dtype: str) -> float:
        """FLOP/s a large GEMM reaches (the fit's rate)."""
        return self.gemm_fit(dtype).rate

    def elementwise_bw(self, dtype: str) -> float:
        """Bytes/s of elementwise work in `dtype` (memory_bw for fp32 and unmeasured dtypes)."""
        return dict(self.memory_bw_dtype).get(dtype, self.memory_bw)

    def overhead(self, family: str, block_params: float = 0.0) -> tuple[float, float, float] | None:
        """(seconds per step, per block and micro-batch, per block once a step) the runtime's `family`
        step costs beyond the modelled work for blocks of `block_params` parameters on the rank, or
        None when this profile did not measure it."""
        for fam, per_step, per_block, per_param, per_block_step, per_step_param in self.overheads:
            if fam == family:
                return per_step, per_block + per_param * block_params, per_block_step + per_step_param * block_params
        return None

    # -- collectives --------------------------------------------------------------------------
    def _series(self, kind: str, link: str, size: int):
        """(ranks, [(nbytes, seconds)] increasing in both) measured for kind/link at the rank count
        nearest `size`; None when none was measured."""
        key = ("coll", kind, link, size)
        if key not in self._cache:
            counts = sorted({p[2] for p in self.collectives if p[0] == kind and p[1] == link})
            if not counts:
                self._cache[key] = None
            else:
                ranks = min(counts, key=lambda r: (abs(math.log(r / max(size, 1))), -r))
                pts = sorted((p[3], p[4]) for p in self.collectives if p[0] == kind and p[1] == link and p[2] == ranks)
                series: list[tuple[float, float]] = []
                top = 0.0
                for nbytes, t in pts:  # a monotone envelope: more bytes never take less time
                    top = max(top, t)
                    if series and series[-1][0] == nbytes:
                        series[-1] = (nbytes, top)
                    else:
                        series.append((nbytes, top))
                self._cache[key] = (ranks, series)
        return self._cache[key]

    @staticmethod
    def _latency(series) -> float:
        """The part of a collective's time that does not grow with bytes: the smallest message's time
        less its bytes at the bandwidth between the smallest and the largest message."""
        (b0, t0), (b1, t1) = series[0], series[-1]
        per_byte = (t1 - t0) / (b1 - b0) if b1 > b0 else 0.0
        return min(max(t0 - b0 * per_byte, 0.0), t0)

    def collective_s(self, kind: str, size: int, nbytes: float, link: str) -> float | None:
        """Seconds of one collective over `size` ranks of a full tensor of `nbytes` on `link`, or None
        when that link was not measured.

        Log-log interpolation between the measured message sizes (linear in bytes past the largest,
        the smallest's time below it), at the measured rank count nearest `size`; another rank count
        is scaled by the ring factors of workbench/steptime.py: the latency part by the steps, the
        bandwidth part by the share of the tensor each rank sends.
        """
        if kind not in KINDS:
            raise ConfigError(f"collective kind {kind!r}: one of {', '.join(KINDS)}.{did_you_mean(str(kind), KINDS)}")
        if link not in LINKS:
            raise ConfigError(f"link {link!r}: one of {', '.join(LINKS)}.")
        if size <= 1 and kind != "p2p":
            return 0.0
        found = self._series(kind, link, size)
        if found is None:
            return None
        ranks, series = found
        t = _interp(series, max(float(nbytes), 0.0))
        if ranks == size or kind == "p2p":
            return t
        lat = min(self._latency(series), t)
        steps0, share0 = _ring(kind, ranks)
        steps, share = _ring(kind, size)
        return lat * steps / steps0 + (t - lat) * share / share0

    def bus_bw(self, kind: str, link: str, nbytes: float) -> float | None:
        """nccl-tests' bus bandwidth (bytes/s) at the measured rank count: the bytes each rank sends
        (the ring's share of the full tensor) / time; None when that link was not measured."""
        ranks = min((p[2] for p in self.collectives if p[0] == kind and p[1] == link), default=None)
        t = None if ranks is None else self.collective_s(kind, ranks, nbytes, link)
        return None if not t or ranks is None else nbytes * _ring(kind, ranks)[1] / t

    # -- text ---------------------------------------------------------------------------------
    def label(self) -> str:
        """'calibrated on this cluster, 2026-12-02 (2 x cpu, local)'."""
        ranks = self.nodes * self.ranks_per_node
        nodes = f"{self.nodes} nodes x {self.ranks_per_node}" if self.nodes > 1 else f"{ranks}"
        return f"calibrated on this cluster, {self.created[:10]} ({nodes} x {self.device}, {self.backend})"

    def to_dict(self) -> dict:
        return {"format": FORMAT, "device": self.device, "created": self.created, "host": self.host,
                "backend": self.backend, "nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
                "threads_per_rank": self.threads_per_rank, "memory_bw": self.memory_bw,
                "op_overhead_s": self.op_overhead_s,
                "gemm": [list(p) for p in self.gemm], "collectives": [list(p) for p in self.collectives],
                "memory_bw_dtype": {d: bw for d, bw in self.memory_bw_dtype},
                "overheads": {f: {k: v for i, (k, v) in enumerate(zip(OVERHEAD_KEYS, costs)) if v or i < 2}
                              for f, *costs in self.overheads},
                "probes": [list(p) for p in self.probes], "cpu_cores": self.cpu_cores,
                "gemm_grad": [list(p) for p in self.gemm_grad], "attention": [list(p) for p in self.attention],
                "elementwise": [list(p) for p in self.elementwise]}


def _interp(series: list, x: float) -> float:
    """Monotone log-log interpolation through (bytes, seconds) points sorted by bytes."""
    if x <= series[0][0]:
        return series[0][1]
    if x >= series[-1][0]:
        b, t = series[-1]
        if len(series) == 1:
            return t * x / b
        b0, t0 = series[-2]
        per_byte = max((t - t0) / (b - b0), 0.0) if b > b0 else 0.0
        return t + (x - b) * (per_byte or t / b)
    for (b0, t0), (b1, t1) in zip(series, series[1:]):
        if b0 <= x <= b1:
            if b1 == b0 or t0 <= 0:
                return t1
            w = math.log(x / b0) / math.log(b1 / b0)
            return math.exp(math.log(t0) + w * math.log(t1 / t0))
    return series[-1][1]


# -- files ------------------------------------------------------------------------------------
def _fail(where: str, name: str, rule: str) -> ConfigError:
    return ConfigError(f"hardware profile {where}: {name}: {rule}. Run `workbench calibrate SPEC` again to "
                       "write a fresh one (or remove the file).")


def _int(raw, name: str, where: str, lo: int, hi: int) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or not lo <= raw <= hi:
        raise _fail(where, name, f"an integer from {lo:,} to {hi:,}, not {clip(repr(raw), 80)}")
    return raw


def _pos(raw, name: str, where: str, allow_zero: bool = False) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw) \
            or raw < 0 or (raw == 0 and not allow_zero) or raw > 1e30:
        raise _fail(where, name, f"a finite positive number, not {clip(repr(raw), 80)}")
    return float(raw)


def _bandwidth(raw, name: str, where: str) -> float:
    """Bytes/s of memory: a measured rate lies between a slow disk's and any HBM's (a figure far
    outside is a typo or an edited file, and would price a step at ~0 or ~forever)."""
    bw = _pos(raw, name, where)
    if not MIN_MEMORY_BW <= bw <= MAX_MEMORY_BW:
        raise _fail(where, name, f"bytes/s from {MIN_MEMORY_BW:.0e} to {MAX_MEMORY_BW:.0e} (a measured memory "
                                 f"bandwidth), not {clip(repr(raw), 80)}")
    return bw


def _text(raw, name: str, where: str, limit: int = 255) -> str:
    if not isinstance(raw, str) or not raw or len(raw) > limit or not raw.isprintable():
        raise _fail(where, name, f"printable text of 1 to {limit} characters, not {clip(repr(raw), 80)}")
    return raw


def _choice(raw, name: str, where: str, choices) -> str:
    if raw not in choices or not isinstance(raw, str):
        raise _fail(where, name, f"one of {', '.join(choices)}, not {clip(repr(raw), 80)}"
                    + (did_you_mean(raw, choices) if isinstance(raw, str) else ""))
    return raw


def _rows(raw, name: str, where: str, width: int) -> list:
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_POINTS:
        raise _fail(where, name, f"a list of 1 to {MAX_POINTS:,} measured points, not {clip(repr(raw), 80)}")
    for i, row in enumerate(raw):
        if not isinstance(row, list) or len(row) != width:
            raise _fail(where, f"{name}[{i}]", f"a list of {width} values, not {clip(repr(row), 80)}")
    return raw


def profile_from_dict(raw, where: str = "(dict)") -> HardwareProfile:
    """A HardwareProfile from its plain-data form, every field checked. Raises ConfigError naming the field."""
    from workbench.catalog import DEVICES

    _check_fields(raw, where)
    device = _choice(raw["device"], "device", where, tuple(DEVICES))
    created = _created(raw["created"], where)
    gemm = _gemm_rows(raw["gemm"], where)
    colls = _collective_rows(raw["collectives"], where)
    bw_pairs = _memory_bw_dtype(raw.get("memory_bw_dtype") or {}, where)
    overheads = _overheads(raw.get("overheads") or {}, where)
    probes = _probe_rows(raw["probes"], where) if raw.get("probes") else ()
    cores = raw.get("cpu_cores", 0)
    grad = _grad_rows(raw["gemm_grad"], where) if raw.get("gemm_grad") else ()
    attention = _attention_rows(raw["attention"], where) if raw.get("attention") else ()
    elementwise = _elementwise_rows(raw["elementwise"], where) if raw.get("elementwise") else ()
    return HardwareProfile(
        gemm_grad=grad, attention=attention, elementwise=elementwise,
        memory_bw_dtype=bw_pairs, overheads=overheads, probes=probes,
        cpu_cores=_int(cores, "cpu_cores", where, 0, 1 << 20),
        device=device, created=created, host=_text(raw["host"], "host", where),
        backend=_choice(raw["backend"], "backend", where, BACKENDS),
        nodes=_int(raw["nodes"], "nodes", where, 1, MAX_RANKS),
        ranks_per_node=_int(raw["ranks_per_node"], "ranks_per_node", where, 1, MAX_RANKS),
        threads_per_rank=_int(raw["threads_per_rank"], "threads_per_rank", where, 1, 1 << 16),
        gemm=gemm, memory_bw=_bandwidth(raw["memory_bw"], "memory_bw", where),
        op_overhead_s=_pos(raw["op_overhead_s"], "op_overhead_s", where, allow_zero=True), collectives=colls)


_REQUIRED = {"format", "device", "created", "host", "backend", "nodes", "ranks_per_node", "threads_per_rank",
             "gemm", "memory_bw", "op_overhead_s", "collectives"}
_KNOWN = _REQUIRED | {"memory_bw_dtype", "overheads", "probes", "cpu_cores", "gemm_grad", "attention",
                       "elementwise"}


def _check_fields(raw, where: str) -> None:
    """A mapping of this format's fields: none unknown, none of the required missing."""
    if not isinstance(raw, dict):
        raise _fail(where, "(top level)", f"a mapping of fields, not {type(raw).__name__}")
    if raw.get("format", FORMAT) != FORMAT:
        raise _fail(where, "format", f"{FORMAT!r} (this version reads that), not {clip(repr(raw.get('format')), 80)}")
    for key in raw:
        if key not in _KNOWN:
            raise _fail(where, clip(str(key), 80), "not a field of a hardware profile" + did_you_mean(str(key), _KNOWN))
    for key in _REQUIRED - {"format"}:
        if key not in raw:
            raise _fail(where, key, "missing")


def _created(raw, where: str) -> str:
    created = _text(raw, "created", where, 64)
    try:
        datetime.fromisoformat(created.replace("Z", "+00:00"))
    except ValueError:
        raise _fail(where, "created", f"an ISO 8601 time such as 2026-12-02T10:00:00+00:00, not {created!r}") from None
    return created


def _gemm_rows(raw, where: str) -> tuple:
    gemm = []
    for i, (dtype, m, n, k, t) in enumerate(_rows(raw, "gemm", where, 5)):
        name = f"gemm[{i}]"
        gemm.append((_choice(dtype, f"{name} dtype", where, DTYPES), _int(m, f"{name} m", where, 1, MAX_DIM),
                     _int(n, f"{name} n", where, 1, MAX_DIM), _int(k, f"{name} k", where, 1, MAX_DIM),
                     _pos(t, f"{name} seconds", where)))
    return tuple(gemm)


def _collective_rows(raw, where: str) -> tuple:
    """Measured collectives; none (an empty list) for a single-rank profile."""
    if raw == []:
        return ()
    colls = []
    for i, (kind, link, ranks, nbytes, t) in enumerate(_rows(raw, "collectives", where, 5)):
        name = f"collectives[{i}]"
        colls.append((_choice(kind, f"{name} kind", where, KINDS), _choice(link, f"{name} link", where, LINKS),
                      _int(ranks, f"{name} ranks", where, 2, MAX_RANKS),
                      _int(nbytes, f"{name} nbytes", where, 1, 1 << 50), _pos(t, f"{name} seconds", where)))
    return tuple(colls)


def _memory_bw_dtype(raw, where: str) -> tuple:
    if not isinstance(raw, dict):
        raise _fail(where, "memory_bw_dtype", f"a mapping of dtype to bytes/s, not {clip(repr(raw), 80)}")
    return tuple((_choice(d, "memory_bw_dtype dtype", where, DTYPES), _bandwidth(bw, f"memory_bw_dtype {d}", where))
                 for d, bw in raw.items())


def _overheads(raw, where: str) -> tuple:
    if not isinstance(raw, dict):
        raise _fail(where, "overheads", f"a mapping of strategy family to costs, not {clip(repr(raw), 80)}")
    overheads = []
    for fam, costs in raw.items():
        name = f"overheads {clip(str(fam), 40)}"
        _choice(fam, name, where, FAMILIES)
        if not isinstance(costs, dict) or not set(OVERHEAD_KEYS[:2]) <= set(costs) <= set(OVERHEAD_KEYS):
            raise _fail(where, name, "{per_step_s: seconds, per_block_s: seconds, and optionally "
                        f"{', '.join(OVERHEAD_KEYS[2:])}}}, not {clip(repr(costs), 80)}")
        overheads.append((fam, *(_pos(costs.get(k, 0.0), f"{name} {k}", where, allow_zero=True)
                                 for k in OVERHEAD_KEYS)))
    return tuple(overheads)


def _probe_rows(raw, where: str) -> tuple:
    probes = []
    for i, row in enumerate(_rows(raw, "probes", where, 8)):
        name = f"probes[{i}]"
        probes.append((_choice(row[0], f"{name} family", where, FAMILIES),
                       *(_int(x, f"{name} {what}", where, 1, MAX_RANKS)
                         for x, what in zip(row[1:6], ("dp", "tp", "pp", "layers", "micro-batches"))),
                       _pos(row[6], f"{name} measured", where), _pos(row[7], f"{name} modelled", where)))
    return tuple(probes)


def _grad_rows(raw, where: str) -> tuple:
    grad = []
    for i, (kind, dtype, m, n, k, t) in enumerate(_rows(raw, "gemm_grad", where, 6)):
        name = f"gemm_grad[{i}]"
        grad.append((_choice(kind, f"{name} kind", where, GRAD_KINDS), _choice(dtype, f"{name} dtype", where, DTYPES),
                     _int(m, f"{name} m", where, 1, MAX_DIM), _int(n, f"{name} n", where, 1, MAX_DIM),
                     _int(k, f"{name} k", where, 1, MAX_DIM), _pos(t, f"{name} seconds", where)))
    return tuple(grad)


def _attention_rows(raw, where: str) -> tuple:
    rows = []
    for i, (kind, dtype, *dims, t) in enumerate(_rows(raw, "attention", where, 7)):
        name = f"attention[{i}]"
        rows.append((_choice(kind, f"{name} pass", where, ATTENTION_PASSES), _choice(dtype, f"{name} dtype", where, DTYPES),
                     *(_int(x, f"{name} {what}", where, 1, MAX_DIM) for x, what in zip(dims, ("batch", "heads", "seq",
                                                                                               "head_dim"))),
                     _pos(t, f"{name} seconds", where)))
    return tuple(rows)


def _elementwise_rows(raw, where: str) -> tuple:
    rows = []
    for i, (op, kind, dtype, r, c, t) in enumerate(_rows(raw, "elementwise", where, 6)):
        name = f"elementwise[{i}]"
        rows.append((_choice(op, f"{name} op", where, ELEMENTWISE_OPS), _choice(kind, f"{name} pass", where, ATTENTION_PASSES),
                     _choice(dtype, f"{name} dtype", where, DTYPES), _int(r, f"{name} rows", where, 1, MAX_DIM),
                     _int(c, f"{name} columns", where, 1, MAX_DIM), _pos(t, f"{name} seconds", where)))
    return tuple(rows)


def load_profile(path) -> HardwareProfile:
    """Read a profile file (YAML, at most 1 MiB). Raises ConfigError naming the file and the field."""
    p = Path(path)
    where = repr(clip(str(p), 300))
    return profile_from_dict(parse_yaml(read_bounded(p, "hardware profile", MAX_PROFILE_BYTES), where, "hardware profile"), where)


def save_profile(profile: HardwareProfile, path) -> None:
    """Write `profile` as YAML, atomically (a temporary file beside it, then os.replace)."""
    import yaml

    p = Path(path)
    text = yaml.safe_dump(profile.to_dict(), sort_keys=False, default_flow_style=None, width=200)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, p)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    except OSError as e:
        raise ConfigError(f"cannot write the hardware profile to {clip(str(p), 300)!r}: {e.strerror or e}. "
                          "Pass a writable path with -o.") from None


def workbench_home() -> Path:
    """$WORKBENCH_HOME, default ~/.workbench."""
    return Path(os.environ.get("WORKBENCH_HOME") or Path.home() / ".workbench")


def default_profile_path(device: str) -> Path:
    """$WORKBENCH_HOME/profiles/<device>.yaml (WORKBENCH_HOME defaults to ~/.workbench)."""
    from workbench.catalog import DEVICES

    if device not in DEVICES:
        raise ConfigError(f"device {clip(repr(device), 80)}: not in the catalog.{did_you_mean(str(device), DEVICES)}")
    return workbench_home() / "profiles" / f"{device}.yaml"


def find_profile(device: str, explicit: str | None = None) -> HardwareProfile | None:
    """The profile to plan `device` with: `explicit` path > $WORKBENCH_PROFILE > the default path;
    None when there is none. A $WORKBENCH_PROFILE measured on another device is passed over; an
    explicit one is a ConfigError.

    Raises:
        ConfigError: the file is not a valid profile, or an explicit one is for another device.
    """
    if explicit is None and os.environ.get("WORKBENCH_PROFILE"):
        profile = load_profile(os.environ["WORKBENCH_PROFILE"])
        if profile.device == device:
            return profile
    elif explicit is not None:
        path = explicit
        profile = load_profile(path)
        if profile.device != device:
            raise ConfigError(f"hardware profile {clip(str(path), 300)!r} was measured on {profile.device}, but the "
                              f"spec plans for {device}. Calibrate on {device} (`workbench calibrate SPEC`), or "
                              "drop the profile to use the catalog defaults.")
        return profile
    default = default_profile_path(device)
    try:
        saved = default.is_file()
    except OSError as e:  # e.g. a WORKBENCH_HOME whose names are longer than the file system allows
        raise ConfigError(f"the saved profile {clip(str(default), 300)!r} (under $WORKBENCH_HOME): cannot read it: "
                          f"{e.strerror or e}. Set WORKBENCH_HOME to a folder you can read.") from None
    return load_profile(default) if saved else None
