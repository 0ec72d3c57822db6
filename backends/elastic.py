"""`backend.elastic`: the layout that the nodes a Ray cluster has left can hold after a node loss,
at the same global batch: fewer data-parallel replicas, each accumulating more micro-batches, so
every step trains on the same sequences and the loss curve continues unchanged.

Only dp shrinks: a tensor-parallel group is one placement bundle (one node), a pipeline needs all
its stages, so a replica (tp x pp ranks) is whole or gone. A layout never changes the model.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from workbench.errors import ConfigError
from workbench.parallelism import Parallelism
from workbench.validate import check_runnable

if TYPE_CHECKING:
    from workbench.spec import JobSpec


def groups_that_fit(nodes: list[dict], bundle: dict[str, float]) -> int:
    """How many `bundle`s (one tp group each) the live nodes hold, by their total resources.

    Args:
        nodes: `ray.nodes()` entries ("Alive", "Resources").
        bundle: resources of one group, e.g. {"CPU": 2.0} or {"CPU": 8.0, "GPU": 8.0}.
    """
    wanted = {k: v for k, v in bundle.items() if v > 0}
    # 1e-9: fractional CPUs (0.5 x 4) must count as exactly 2, not 1.999...
    return sum(min(int(n.get("Resources", {}).get(k, 0.0) / v + 1e-9) for k, v in wanted.items())
               for n in nodes if n.get("Alive"))


def _resources(spec: JobSpec, world: int) -> dict:
    """resources.* for `world` ranks: whole nodes of gpus_per_node where they divide, else one node."""
    per_node = spec.resources.gpus_per_node
    if world % per_node == 0:
        return {"resources.nodes": world // per_node}
    return {"resources.nodes": 1, "resources.gpus_per_node": world}


def shrink(spec: JobSpec, groups: int) -> JobSpec | None:
    """The spec at the largest dp the cluster's `groups` tp groups hold, or None when it fits as is.

    Args:
        spec: the running layout.
        groups: tp groups the live nodes hold (`groups_that_fit`).
    Returns:
        The spec with a smaller layout.dp (and resources to match), or None.
    Raises:
        ConfigError: no smaller dp runs the same job; the reason for each dp tried, and a fix.
    """
    lay, t = spec.layout, spec.train
    fit = groups // lay.pp
    if fit >= lay.dp:
        return None
    if fit == 0:
        raise ConfigError(
            f"backend.elastic: the nodes left hold {groups} group(s) of tp({lay.tp}) ranks, but one model replica "
            f"needs pp({lay.pp}) of them (tp x pp = {lay.tp * lay.pp} ranks); the layout cannot shrink below dp=1. "
            "Add nodes to the cluster, then resume from the last checkpoint (workbench run --resume).")
    reasons = []
    for dp in range(fit, 0, -1):
        if t.global_batch % (dp * t.micro_batch):
            reasons.append(f"dp={dp}: global_batch({t.global_batch}) is not divisible by dp({dp}) x "
                           f"micro_batch({t.micro_batch}) = {dp * t.micro_batch}")
            continue
        try:
            candidate = spec.replace(**{"layout.dp": dp, **_resources(spec, dp * lay.tp * lay.pp)})
            check_runnable(candidate)
        except ConfigError as e:
            reasons.append(f"dp={dp}: {e}")
            continue
        return candidate
    every = math.lcm(*range(1, lay.dp + 1)) * t.micro_batch
    raise ConfigError(
        f"backend.elastic: the nodes left hold dp <= {fit} of the layout's dp({lay.dp}), but no smaller dp runs "
        f"the same job: {'; '.join(reasons)}. Use a global_batch that every smaller dp x micro_batch divides "
        f"(e.g. {every}, a multiple of lcm(1..{lay.dp}) x micro_batch), or add nodes.")


def describe(old: JobSpec, new: JobSpec, groups: int) -> str:
    """The warning a shrink emits: what changed and what stays the same."""
    t = old.train

    def micro(s):
        return Parallelism.from_spec(s).num_micro

    return (f"backend.elastic: the nodes left hold {groups} group(s) of tp({old.layout.tp}) ranks; continuing from "
            f"the last checkpoint at dp={new.layout.dp} (was {old.layout.dp}), {new.world_size} ranks, "
            f"{micro(new)} micro-batches of {t.micro_batch} per rank and step (was {micro(old)}): the global batch "
            f"({t.global_batch}) and the loss curve stay the same")
