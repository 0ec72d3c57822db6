"""The facts the training loop reads beside the layout's strategies, each defined once on
Parallelism: the mesh's rank order (as torch's DeviceMesh numbers its ranks) and the micro-batch count."""
import itertools

import pytest
import torch

from workbench.memory import estimate_memory, layout_from_spec
from workbench.parallelism import MESH_AXES, Parallelism
from workbench.spec import load_spec


@pytest.mark.parametrize("dp,tp,pp", [(1, 1, 1), (2, 1, 1), (1, 4, 1), (2, 2, 2), (3, 2, 4)])
def test_rank_order_is_the_device_meshs(dp, tp, pp):
    """init_device_mesh lays ranks out as arange(world).view(mesh_shape): rank_of and stride agree."""
    par = Parallelism(dp=dp, tp=tp, pp=pp)
    mesh = torch.arange(par.world_size).view(par.mesh_shape)
    assert MESH_AXES == ("pp", "dp", "tp") and par.mesh_shape == (pp, dp, tp)
    for k, i, j in itertools.product(range(pp), range(dp), range(tp)):
        assert par.rank_of(pp=k, dp=i, tp=j) == int(mesh[k, i, j])
    for axis, size in zip(MESH_AXES, par.mesh_shape):
        if size > 1:  # neighbours along the axis are `stride` ranks apart
            step = [0, 0, 0]
            step[MESH_AXES.index(axis)] = 1
            assert int(mesh[tuple(step)] - mesh[0, 0, 0]) == par.stride(axis)


def test_the_memory_estimate_numbers_ranks_in_mesh_order():
    spec = load_spec({"model": {"preset": "gpt-tiny"}, "layout": {"dp": 2, "tp": 2, "pp": 2},
                      "train": {"global_batch": 8, "micro_batch": 1}})
    par = Parallelism.from_spec(spec)
    for row in estimate_memory(spec).per_rank:
        assert row.rank == par.rank_of(**row.coords)


@pytest.mark.parametrize("dp,global_batch,micro_batch,num_micro", [(1, 8, 2, 4), (2, 8, 2, 2), (4, 8, 2, 1)])
def test_micro_batch_count_is_one_fact(dp, global_batch, micro_batch, num_micro):
    spec = load_spec({"model": {"preset": "gpt-tiny"}, "layout": {"dp": dp},
                      "train": {"global_batch": global_batch, "micro_batch": micro_batch}})
    par = Parallelism.from_spec(spec)
    assert (par.micro_batch, par.num_micro, par.global_batch) == (micro_batch, num_micro, global_batch)
    assert layout_from_spec(spec).num_micro == num_micro  # the memory model's Layout is the same Parallelism


def test_world_size_has_one_definition():
    spec = load_spec({"model": {"preset": "gpt-tiny"}, "layout": {"dp": 2, "tp": 2},
                      "train": {"global_batch": 8, "micro_batch": 1}})
    assert spec.world_size == spec.layout.world_size == Parallelism.from_spec(spec).world_size == 4
