"""The direct path's torch.optim optimizer steps DTensor parameters with torch's foreach kernels,
with the numbers of the per-tensor loop: tensor parallelism mixes plain and DTensor parameters,
which one foreach call refuses."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from workbench.parallel.step import build_optimizer


@pytest.fixture
def mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _params(mesh):
    torch.manual_seed(0)
    return [torch.nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])),
            torch.nn.Parameter(torch.randn(4)),  # a norm weight tp leaves plain
            torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Replicate()]))]


def _train(optimizer_of, mesh, steps=3):
    params = _params(mesh)
    opt = optimizer_of(params)
    for _ in range(steps):
        loss = sum((p.full_tensor() if hasattr(p, "full_tensor") else p).square().sum() for p in params)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in params]


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
def test_mixed_plain_and_dtensor_parameters_step_foreach_with_per_tensor_numbers(mesh, name):
    opt = build_optimizer(_params(mesh), name, lr=1e-2, weight_decay=0.1)
    # the mesh's DTensors on foreach, the plain one on torch's own choice (the per-tensor loop on CPU)
    assert [(len(g["params"]), g["foreach"]) for g in opt.param_groups] == [(2, True), (1, None)]

    def per_tensor(params):
        opt = build_optimizer(params, name, lr=1e-2, weight_decay=0.1)
        for g in opt.param_groups:
            g["foreach"] = False
        return opt

    got = _train(lambda ps: build_optimizer(ps, name, lr=1e-2, weight_decay=0.1), mesh)
    want = _train(per_tensor, mesh)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
