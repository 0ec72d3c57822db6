"""Predicted vs measured memory: run layouts through the runtime, compare component by component.

Used by bench/memory_accuracy.py (which writes docs/memory-accuracy.md) and by the accuracy
test. The measured side is the runtime's `memory` events (workbench/runtime/meter.py).
"""
from __future__ import annotations

from dataclasses import dataclass

STATES = ("params", "grads", "master", "optimizer")
# Defensible bounds: model states are exact byte counts of known tensors (only padding and
# bookkeeping can differ: 5%); activations depend on which kernels autograd runs (15%).
THRESHOLDS = {"params": 0.05, "grads": 0.05, "master": 0.05, "optimizer": 0.05, "offloaded": 0.05,
              "activations": 0.15, "disk": 0.05, "host": 0.05}

# (label, layout, precision) tried for each model; the runtime skips what it cannot run yet.
LAYOUTS: list[tuple[str, dict, str]] = [
    ("dp2", {"dp": 2}, "fp32"),
    ("dp2 bf16", {"dp": 2}, "bf16"),
    ("dp2 zero1", {"dp": 2, "zero": 1}, "fp32"),
    ("dp2 zero1 bf16", {"dp": 2, "zero": 1}, "bf16"),
    ("dp2 zero2", {"dp": 2, "zero": 2}, "fp32"),
    ("dp2 zero3", {"dp": 2, "zero": 3}, "fp32"),
    ("dp2 zero3 bf16", {"dp": 2, "zero": 3}, "bf16"),
    ("dp2 full ckpt", {"dp": 2, "activation_checkpointing": "full"}, "fp32"),
    ("dp2 full ckpt every 2", {"dp": 2, "activation_checkpointing": "full", "checkpoint_every": 2}, "fp32"),
    ("dp2 zero3 offload cpu", {"dp": 2, "zero": 3, "offload": "cpu"}, "fp32"),
    ("dp2 zero1 offload nvme", {"dp": 2, "zero": 1, "offload": "nvme"}, "fp32"),
    ("dp2 zero3 offload nvme", {"dp": 2, "zero": 3, "offload": "nvme"}, "fp32"),
    ("dp2 zero2 offload nvme bf16", {"dp": 2, "zero": 2, "offload": "nvme"}, "bf16"),
    ("tp2", {"tp": 2}, "fp32"),
    ("tp2 sp", {"tp": 2, "sequence_parallel": True}, "fp32"),
    ("pp2 1f1b", {"pp": 2}, "fp32"),
    ("pp2 gpipe", {"pp": 2, "pp_schedule": "gpipe"}, "fp32"),
    ("dp2 tp2", {"dp": 2, "tp": 2}, "fp32"),
    ("dp2 pp2", {"dp": 2, "pp": 2}, "fp32"),
    ("dp2 zero3 tp2", {"dp": 2, "zero": 3, "tp": 2}, "fp32"),
    ("tp2 bf16", {"tp": 2}, "bf16"),
    ("tp2 sp fp16", {"tp": 2, "sequence_parallel": True}, "fp16"),
    ("pp2 1f1b bf16", {"pp": 2}, "bf16"),
    ("dp2 zero3 tp2 bf16", {"dp": 2, "zero": 3, "tp": 2}, "bf16"),
]


@dataclass
class Row:
    model: str
    layout: str
    rank: int
    component: str
    predicted: int
    measured: int

    @property
    def error(self) -> float:
        """(predicted - measured) / measured; 0 when both are 0, inf when only measured is 0."""
        if self.measured == 0:
            return 0.0 if self.predicted == 0 else float("inf")
        return (self.predicted - self.measured) / self.measured

    @property
    def within(self) -> bool:
        return abs(self.error) <= THRESHOLDS.get(self.component, 0.15)


def build_spec(model: str, layout: dict, dtype: str, steps: int = 2, tmp: str = "/tmp/workbench-accuracy") -> dict:
    world = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1)
    return {
        "name": f"accuracy-{model}", "model": {"preset": model},
        "train": {"steps": steps, "global_batch": 8, "micro_batch": 2, "optimizer": "adamw"},
        "layout": {**layout, **({"nvme_path": tmp} if layout.get("offload") == "nvme" else {})},
        "precision": {"dtype": dtype}, "resources": {"gpu": "cpu", "gpus_per_node": world},
    }


def runnable(spec: dict) -> str | None:
    """None when the runtime can run `spec`, else its reason."""
    from workbench.errors import ConfigError
    from workbench.spec import load_spec
    from workbench.validate import check_runnable

    try:
        check_runnable(load_spec(spec))
    except ConfigError as e:
        return str(e)
    return None


def compare(model: str, label: str, spec: dict, events: list[dict]) -> list[Row]:
    """Rows for each rank's last memory event against estimate_memory(spec)."""
    from workbench.memory import estimate_memory

    predicted = {r["rank"]: r for r in estimate_memory(spec).to_dict()["per_rank"]}
    last: dict[int, dict] = {}
    for e in events:
        if e.get("event") == "memory" and e["step"] >= last.get(e["rank"], {}).get("step", 0):
            last[e["rank"]] = e
    rows = []
    offload = spec["layout"].get("offload", "none")
    infinity = offload == "nvme" and spec["layout"].get("zero", 0) >= 2
    for rank, e in sorted(last.items()):
        meas, pred = e["measured"], predicted[rank]
        for c in STATES + ("activations",):
            if (offload == "cpu" or infinity) and c in STATES:
                continue  # compared as one host-memory total below
            if offload == "nvme" and c in ("master", "optimizer"):
                continue
            rows.append(Row(model, label, rank, c, int(pred[c]), int(meas.get(c, 0))))
        if offload == "cpu":
            host = meas.get("cpu_offloaded", sum(meas.get(c, 0) for c in STATES))
            rows.append(Row(model, label, rank, "offloaded", int(pred.get("offloaded_bytes", 0)), int(host)))
        elif infinity:  # host and disk apart: gradient shards + staging in memory; shards + moments in files
            disk = sum(meas.get(f"{c}_on_disk", 0) for c in STATES)
            rows.append(Row(model, label, rank, "disk", int(pred.get("disk_bytes", 0)), int(disk)))
            host = meas.get("grads", 0) + meas.get("offload_staging", 0)
            rows.append(Row(model, label, rank, "host", int(pred.get("host_bytes", 0)), int(host)))
            resident = sum(meas.get(c, 0) for c in ("params", "master", "optimizer"))
            rows.append(Row(model, label, rank, "files resident", 0, int(resident)))
        elif offload == "nvme":
            disk = meas.get("master_on_disk", 0) + meas.get("optimizer_on_disk", 0)
            rows.append(Row(model, label, rank, "offloaded", int(pred.get("offloaded_bytes", 0)), int(disk)))
        if "peak" in meas and _on_cuda():  # CPU has no allocator statistics: peak is a sum there
            rows.append(Row(model, label, rank, "total", int(pred["total"]), int(meas["peak"])))
    return rows


def _on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def measure(models=("gpt-tiny", "gpt-mini"), layouts=LAYOUTS, timeout_s: float = 300, log=print):
    """Run every runnable (model, layout) on spawned gloo ranks. Returns (rows, skipped)."""
    from workbench.runtime.spawn import SpawnPool

    plan: dict[int, list] = {}
    skipped = []
    for model in models:
        for label, layout, dtype in layouts:
            spec = build_spec(model, layout, dtype)
            reason = runnable(spec)
            if reason:
                skipped.append((model, label, reason))
                continue
            world = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1)
            plan.setdefault(world, []).append((model, label, spec))
    rows: list[Row] = []
    for world, jobs in sorted(plan.items()):
        with SpawnPool(world) as pool:
            for model, label, spec in jobs:
                log(f"  {model:<9} {label:<24} on {world} gloo ranks")
                rows += compare(model, label, spec, pool.run(spec, timeout_s=timeout_s))
    return rows, skipped
