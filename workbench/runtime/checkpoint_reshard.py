"""Resume across the two homes of the optimizer state: a torch optimizer over the fp32 parameters
(zero 0/2/3 in fp32, zero 2/3 in mixed precision) and the fp32 master (zero 1, zero 0 in mixed
precision, offload=nvme). DCP reshards within one home; between them the state goes through
canonical form: full fp32 weights and moments by parameter name, and the optimizer's step count.

The conversion loads full tensors on every rank (one model's state in host memory); resuming in
the checkpoint's own home needs no conversion and stays sharded.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MOMENTS = {"adamw": ("exp_avg", "exp_avg_sq"), "adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


@dataclass
class Canonical:
    """A checkpoint's model and optimizer state, layout-free."""

    weights: dict[str, torch.Tensor]  # full fp32 tensors by canonical parameter name
    moments: list[dict[str, torch.Tensor]]  # per moment (MOMENTS order), by name
    step: int  # optimizer steps taken


def home(parts: set[str]) -> str:
    """"master" or "optim": where a state dict (or a checkpoint's keys) keeps the optimizer state."""
    return "master" if "master" in parts else "optim"


def layout_diff(saved: dict, now: dict) -> str:
    """Only the layout keys that differ, e.g. "zero: 0 -> 1, tp: 2 -> 1"."""
    keys = [k for k in now if k in saved and saved[k] != now[k]]
    return ", ".join(f"{k}: {saved[k]} -> {now[k]}" for k in keys) or "same layout"


def load_canonical(reader_factory, url: str, manifest: dict, param_order: list[tuple[str, torch.Size]],
                   optimizer: str, **dcp_kwargs) -> Canonical:
    """Read a checkpoint's model/optimizer state into canonical form (every rank reads it all).

    Args:
        reader_factory: checkpoint_safe's reader class for the store.
        param_order: the writer's trainable parameters as (canonical name, shape).
        optimizer: train.optimizer (which moments to expect).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from workbench.runtime.checkpoint_safe import SafeLoadPlanner

    meta = reader_factory(url).read_metadata().state_dict_metadata
    targets: dict = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
                     if isinstance(m, TensorStorageMetadata) and k.split(".", 1)[0] in ("model", "optim", "master")}
    if "master.num_steps" in meta:
        targets["master.num_steps"] = 0  # a non-tensor: DCP replaces the value
    dcp.load(targets, storage_reader=reader_factory(url), planner=SafeLoadPlanner(), **dcp_kwargs)
    names = MOMENTS[optimizer]
    if "master.num_steps" in targets:  # the master keeps full tensors by canonical name (parallel/master.py)
        kinds = ["master"] + [f"moment{i}" for i in range(len(names))]
        by_kind = [{k[len(f"master.{kind}."):]: v.float() for k, v in targets.items() if k.startswith(f"master.{kind}.")}
                   for kind in kinds]
        return Canonical(by_kind[0], by_kind[1:], int(targets["master.num_steps"]))
    weights = {k[len("model."):]: v.float() for k, v in targets.items() if k.startswith("model.")}
    moments = [{n: targets[f"optim.state.{n}.{m}"].float() for n, _ in param_order} for m in names]
    steps = [v for k, v in targets.items() if k.startswith("optim.state.") and k.endswith(".step")]
    return Canonical(weights, moments, int(steps[0].item()) if steps else int(manifest["step"]))


def local_part(full: torch.Tensor, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`full` laid out like `like`: its shard (DTensor) or itself, in `dtype` (default `like`'s)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(dtype=dtype or like.dtype)
    if isinstance(like, DTensor):  # every rank holds `full`: slice locally, no communication
        return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
    return full.to(like.device)


def fill_optim(template: dict, state: Canonical, optimizer: str) -> dict:
    """A flattened torch optimizer state dict (get_state_dict's) filled from canonical state."""
    out = dict(template)
    for key, like in template.items():
        if not key.startswith("state."):
            continue
        name, _, field = key[len("state."):].rpartition(".")
        if field == "step":
            out[key] = torch.tensor(float(state.step), dtype=like.dtype) if torch.is_tensor(like) else state.step
        elif field in MOMENTS[optimizer]:
            out[key] = local_part(state.moments[MOMENTS[optimizer].index(field)][name], like)
    return out


def master_state(master, state: Canonical) -> dict:
    """MasterOptimizer.load_state_dict's input from canonical state: per canonical name (the
    master's own names), each value this rank's part of the full tensor."""
    def by_name(values: dict) -> dict:
        return {n: local_part(values[n], p, torch.float32) for n, p in zip(master.names, master.params)}

    out = {"num_steps": state.step, "master": by_name(state.weights)}
    for i, moment in enumerate(state.moments):
        out[f"moment{i}"] = by_name(moment)
    return out
