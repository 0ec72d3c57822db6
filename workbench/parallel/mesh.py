"""The DeviceMesh of a layout: dims ("pp", "dp", "tp"), tp fastest so TP groups share a node."""
from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp", "tp")


def build_mesh(device_type: str, *, dp: int, tp: int, pp: int) -> DeviceMesh | None:
    """The named mesh for dp x tp x pp, or None for a single process without a process group.

    Raises:
        RuntimeError: the process group's world size differs from dp x tp x pp.
    """
    world = dp * tp * pp
    if not dist.is_initialized():
        if world != 1:
            raise RuntimeError(f"layout needs {world} ranks but torch.distributed is not initialized")
        return None
    if dist.get_world_size() != world:
        raise RuntimeError(
            f"dp({dp}) x tp({tp}) x pp({pp}) = {world} ranks, but the process group has {dist.get_world_size()}"
        )
    # Pass the device type explicitly: on CPU the default would try CUDA.
    return init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=MESH_DIMS)


def coords(mesh: DeviceMesh | None) -> dict[str, int]:
    """This rank's index along each mesh dim."""
    if mesh is None:
        return {name: 0 for name in MESH_DIMS}
    return {name: mesh.get_local_rank(name) for name in MESH_DIMS}
