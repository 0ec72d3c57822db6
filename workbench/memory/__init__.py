"""Predicted memory per rank for a JobSpec: `estimate_memory(spec) -> MemoryEstimate`.

Pure Python over the model's shape (no tensors are allocated), so a 70B plan costs nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from workbench.memory.estimate import CONVENTION, Layout, StageMemory, device_used, estimate_stage
from workbench.parallelism import Parallelism

__all__ = ["estimate_memory", "MemoryEstimate", "RankMemory", "Layout", "layout_from_spec", "estimate_stage"]

COMPONENTS = ("params", "grads", "master", "optimizer", "activations", "buffers")


@dataclass(frozen=True)
class RankMemory:
    rank: int
    coords: dict
    stage: StageMemory

    def to_dict(self) -> dict:
        s = self.stage
        out = {"rank": self.rank, "coords": dict(self.coords)}
        out.update({k: getattr(s, k) for k in COMPONENTS})
        out["total"] = s.total
        if s.offloaded:
            out["offloaded_bytes"] = s.offloaded
            out["host_bytes"], out["disk_bytes"] = s.host, s.disk
        return out


@dataclass
class MemoryEstimate:
    """Per-rank prediction. `to_dict()` is the `workbench memory --json` contract."""

    world_size: int
    device: str
    device_memory: int
    per_rank: list[RankMemory]
    convention: str = CONVENTION
    offload: str = "none"
    notes: list[str] = field(default_factory=list)
    host_memory: int = 0  # host RAM per device (offload=cpu); 0 = unknown
    layout: Layout | None = None

    @property
    def peak_bytes(self) -> int:
        """The largest allocated peak of a rank (torch.cuda.max_memory_allocated's convention)."""
        return max(r.stage.total for r in self.per_rank)

    @property
    def device_used_bytes(self) -> int:
        """`peak_bytes` plus the allocator's reserve, the CUDA context and NCCL's buffers (CUDA)."""
        return int(device_used(self.peak_bytes, self.layout)) if self.layout else self.peak_bytes

    @property
    def fits(self) -> bool:
        """Device use within the device's memory (and, with offload=cpu, the host's share)."""
        host_ok = self.offload == "none" or not self.host_memory or \
            max(r.stage.host for r in self.per_rank) <= self.host_memory
        return self.device_used_bytes <= self.device_memory and host_ok

    def to_dict(self) -> dict:
        out = {"world_size": self.world_size, "device_memory": self.device_memory, "fits": self.fits,
               "device_used": self.device_used_bytes,
               "per_rank": [r.to_dict() for r in self.per_rank], "device": self.device,
               "convention": self.convention, "notes": list(self.notes)}
        if self.offload != "none":
            out["offloaded_to"] = "host memory" if self.offload == "cpu" else "files (nvme)"
            if self.host_memory:
                out["host_memory"] = self.host_memory
        return out

    def _stages(self) -> list[RankMemory]:
        """One representative rank per pipeline stage (every dp/tp rank of a stage is alike)."""
        seen, out = set(), []
        for r in self.per_rank:
            if r.coords["pp"] not in seen:
                seen.add(r.coords["pp"])
                out.append(r)
        return out

    def table(self) -> str:
        cols = COMPONENTS + ("total",)
        head = f"{'stage':<6}{'ranks':>7}" + "".join(f" {c:>11}" for c in cols)
        lines = [head, "-" * len(head)]
        for r in self._stages():
            n = sum(1 for q in self.per_rank if q.coords["pp"] == r.coords["pp"])
            vals = [getattr(r.stage, c) for c in COMPONENTS] + [r.stage.total]
            lines.append(f"pp{r.coords['pp']:<4}{n:>7}" + "".join(f" {_gib(v):>11}" for v in vals))
        verdict = "fits" if self.fits else "DOES NOT FIT"
        used = ""
        if self.device_used_bytes != self.peak_bytes:
            used = f", {_gib(self.device_used_bytes)} with the allocator's reserve, CUDA context and NCCL buffers"
        lines.append(f"peak {_gib(self.peak_bytes)} allocated{used}, of {_gib(self.device_memory)} per {self.device}: "
                     f"{verdict} ({self.world_size} ranks)")
        host = max(r.stage.host for r in self._stages())
        disk = max(r.stage.disk for r in self._stages())
        if host:
            lines.append(f"host memory per rank (stage max): {_gib(host)}")
        if disk:
            lines.append(f"files per rank (stage max): {_gib(disk)} under layout.nvme_path")
        lines.append(f"convention: {self.convention}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __repr__(self) -> str:
        verdict = "fits" if self.fits else "does not fit"
        return f"MemoryEstimate({self.world_size} ranks, peak {_gib(self.peak_bytes)} of {_gib(self.device_memory)}: {verdict})"

    def _repr_html_(self) -> str:
        cols = COMPONENTS + ("total",)
        head = "".join(f"<th>{c}</th>" for c in ("stage", *cols))
        rows = []
        for r in self._stages():
            vals = [getattr(r.stage, c) for c in COMPONENTS] + [r.stage.total]
            rows.append(f"<tr><td>pp{r.coords['pp']}</td>" + "".join(f"<td>{_gib(v)}</td>" for v in vals) + "</tr>")
        color = "green" if self.fits else "crimson"
        verdict = "fits" if self.fits else "does not fit"
        return (f"<table><tr>{head}</tr>{''.join(rows)}</table><p style='color:{color}'>peak "
                f"{_gib(self.peak_bytes)} of {_gib(self.device_memory)} per {self.device}: {verdict}</p>"
                f"<p><small>{self.convention}</small></p>")


def _gib(b: float) -> str:
    if b >= 2**50:
        return f"{b / 2**50:.2f} PiB"
    if b >= 2**40:
        return f"{b / 2**40:.2f} TiB"
    if b >= 2**30 * 0.1:
        return f"{b / 2**30:.2f} GiB"
    return f"{b / 2**20:.1f} MiB" if b >= 2**20 * 0.1 else f"{b / 2**10:.1f} KiB"


def layout_from_spec(spec) -> Layout:
    """The spec's Parallelism (parallelism.py) with its optimizer and device kind."""
    par = Parallelism.from_spec(spec)
    return Layout(
        **{f.name: getattr(par, f.name) for f in fields(Parallelism)},
        optimizer=spec.train.optimizer, device="cpu" if spec.resources.gpu == "cpu" else "cuda",
    )


def model_of(spec):
    """The model's ModelShape, or its parameter count (a size-only or a factory model).

    A factory is imported and called (on the meta device) only when the user trusts it
    (workbench/factory.py); `model.params` beside it is used as it is.
    """
    if spec.model.params is not None:
        return float(spec.model.params)
    if spec.model.factory is not None:
        from workbench.factory import build_factory_meta, planning_refusal

        if not spec.model.trust_factory:
            raise planning_refusal(spec.model.factory)

        model = build_factory_meta(spec.model.factory, spec.model.kwargs)
        return float(sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()))
    return spec.model.shape()


def estimate_memory(spec, convention: str | None = None) -> MemoryEstimate:
    """Predicted memory per rank.

    Args:
        spec: a JobSpec, or anything `workbench.load_spec` accepts.
        convention: "workbench" (what our runtime allocates) or "zero-paper" (the ZeRO paper's
            accounting, for comparison with published figures). Default: "workbench", and
            "zero-paper" for a size-only model ({params: N}), which nothing runs.
    Returns:
        MemoryEstimate; `.to_dict()` is the `workbench memory --json` schema.
    Raises:
        ConfigError: invalid spec, or a factory that is not trusted (model.trust_factory) or cannot be imported.
    """
    from workbench.catalog import get_device
    from workbench.errors import ConfigError
    from workbench.memory.states import CONVENTIONS
    from workbench.spec import load_spec

    spec = load_spec(spec)
    if convention is not None and not isinstance(convention, str):
        raise ConfigError(f"convention: one of {', '.join(CONVENTIONS)}, not a value of type {type(convention).__name__}.")
    model = model_of(spec)
    lay = layout_from_spec(spec)
    if convention is None:
        convention = "zero-paper" if spec.model.params is not None and spec.model.factory is None else "workbench"
    if convention not in CONVENTIONS:
        raise ConfigError(f"convention {convention!r}: use one of {', '.join(CONVENTIONS)}.")
    dev = get_device(spec.resources.gpu)
    stages = [estimate_stage(model, lay, k, convention) for k in range(lay.pp)]
    per_rank = []
    for k in range(lay.pp):
        for i in range(lay.dp):
            for j in range(lay.tp):
                rank = lay.rank_of(pp=k, dp=i, tp=j)
                per_rank.append(RankMemory(rank, {"dp": i, "tp": j, "pp": k}, stages[k]))
    notes = sorted({n for s in stages for n in s.notes})
    return MemoryEstimate(lay.world_size, dev.name, dev.memory_bytes, per_rank,
                          convention=CONVENTION + f" [{convention}]", offload=lay.offload, notes=notes,
                          host_memory=dev.host_memory_bytes, layout=lay)
