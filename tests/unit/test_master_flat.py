"""master.py's flat range on one process: the chunk size never changes the numbers, reads zero what
no gradient covers, and low-precision parameters get the master's rounding."""
from __future__ import annotations

import torch

from workbench.parallel.master import (
    MAX_CHUNK,
    MAX_CHUNK_CUDA,
    MIN_CHUNK,
    FlatParams,
    MasterOptimizer,
    MemoryStore,
    memory_chunk_size,
)
from workbench.parallel.step import functional_update


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in ((13, 7), (5,), (101,), (2, 3))]


def _stepped(params, chunk, steps=3):
    update, moments = functional_update("adamw", lr=1e-2, weight_decay=0.1)
    master = MasterOptimizer(params, None, MemoryStore, chunk=chunk)
    master.bind(moments)
    for k in range(steps):
        for i, p in enumerate(params):
            # parameter 1 has no gradient on the second step: its range reads as zeros
            p.grad = None if (i == 1 and k == 1) else torch.full_like(p, 0.1 * (i + 1) * (-1) ** k)
        master.step(update, 0.5)
    return master


def test_chunking_does_not_change_the_master_or_the_parameters():
    one, chunked = _params(), _params()
    a, b = _stepped(one, chunk=None), _stepped(chunked, chunk=7)
    assert a.chunk >= a.range_numel  # in memory: the whole range in one chunk
    assert torch.equal(a.full_master(), b.full_master())
    for x, y in zip(one, chunked):
        assert torch.equal(x, y)
    for ma, mb in zip(a.store.moments, b.store.moments):
        assert torch.equal(ma, mb)
    # fp32 parameters are the master itself
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in one]), a.full_master())


def test_low_precision_parameters_are_the_rounded_master():
    params = _params(torch.bfloat16)
    master = _stepped(params, chunk=None)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    assert flat.dtype == torch.bfloat16
    assert torch.equal(flat, master.full_master().to(torch.bfloat16))


def test_read_casts_and_zero_fills():
    params = _params(torch.bfloat16)
    params[0].grad = torch.ones_like(params[0])
    flat = FlatParams(params)
    out = torch.full((flat.numel + 4,), 7.0)
    flat.read(0, flat.numel + 4, grad=True, out=out)
    n0 = params[0].numel()
    assert torch.equal(out[:n0], torch.ones(n0)) and torch.equal(out[n0:], torch.zeros(out.numel() - n0))
    values = flat.read(3, 40, grad=False, out=torch.empty(37))
    assert torch.equal(values, torch.cat([p.detach().reshape(-1) for p in params])[3:40].float())


def test_memory_chunk_size_bounds():
    assert memory_chunk_size(10) == MIN_CHUNK
    assert memory_chunk_size(MIN_CHUNK * 3) == MIN_CHUNK * 3
    assert memory_chunk_size(MAX_CHUNK * 5) == MAX_CHUNK
    assert memory_chunk_size(MAX_CHUNK * 5, cuda=True) == MAX_CHUNK * 5  # fewer launches on a GPU
    assert memory_chunk_size(MAX_CHUNK_CUDA * 2, cuda=True) == MAX_CHUNK_CUDA
    # a sharded master all-gathers one chunk per rank: the staging stays within MAX_CHUNK_CUDA
    assert memory_chunk_size(MAX_CHUNK_CUDA, cuda=True, world=8) == MAX_CHUNK_CUDA // 8
    assert memory_chunk_size(MAX_CHUNK_CUDA, cuda=True, world=64) == MAX_CHUNK
