"""The DeviceMesh of a layout: axes MESH_AXES ("pp", "dp", "tp"), tp fastest so TP groups share a node."""
from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from workbench.parallelism import MESH_AXES, Parallelism


def build_mesh(device_type: str, *, dp: int, tp: int, pp: int) -> DeviceMesh | None:
    """The named mesh for dp x tp x pp, or None for a single process without a process group.

    Raises:
        RuntimeError: the process group's world size differs from dp x tp x pp.
    """
    par = Parallelism(dp=dp, tp=tp, pp=pp)
    world = par.world_size
    if not dist.is_initialized():
        if world != 1:
            raise RuntimeError(f"layout needs {world} ranks but torch.distributed is not initialized")
        return None
    if dist.get_world_size() != world:
        raise RuntimeError(
            f"dp({dp}) x tp({tp}) x pp({pp}) = {world} ranks, but the process group has {dist.get_world_size()}"
        )
    # Pass the device type explicitly: on CPU the default would try CUDA.
    return init_device_mesh(device_type, par.mesh_shape, mesh_dim_names=MESH_AXES)


def coords(mesh: DeviceMesh | None) -> dict[str, int]:
    """This rank's index along each mesh axis."""
    if mesh is None:
        return {axis: 0 for axis in MESH_AXES}
    return {axis: mesh.get_local_rank(axis) for axis in MESH_AXES}
