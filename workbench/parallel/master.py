"""fp32 master weights and optimizer state over a flat range of the parameters (ZeRO-1 style).

The parameters are seen as one flat vector. A rank owns a contiguous range of it (all of it for
zero=0, 1/N for zero=1), keeps that range's fp32 master and optimizer moments (in memory or, for
offload=nvme, in files), and steps them chunk by chunk with torch's own functional optimizers,
so the numbers are exactly torch.optim's. Updated values go back into the (low-precision)
parameters; with a dp group (zero=1) each chunk is all-gathered so every rank gets every range.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from workbench.parallel.local import local

MAX_CHUNK = 4 * 1024 * 1024  # elements; 16 MiB per fp32 staging buffer
# On a GPU, in memory: 256 MiB per fp32 staging buffer. Each chunk launches ~11 kernels from
# Python; at 4 Mi elements a 1.3B model's step took 334 chunks, and the H200 sat idle 29% of the
# step waiting for launches (bench/gpu/profile_step.py, docs/benchmarks.md).
MAX_CHUNK_CUDA = 64 * 1024 * 1024
MIN_CHUNK = 4096


class FlatParams:
    """A flat view over a list of parameters' local tensors: read grads, write values by range."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + local(p).numel())
        self.numel = self.offsets[-1]

    def _pieces(self, start: int, end: int):
        """(param, lo, hi, at): elements [lo, hi) of param's flat local tensor sit at [at, ...) of the range."""
        for i, p in enumerate(self.params):
            a, b = self.offsets[i], self.offsets[i + 1]
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                yield p, lo - a, hi - a, lo - start

    def read(self, start: int, end: int, *, grad: bool, out: torch.Tensor) -> torch.Tensor:
        """Copy grads (or values) of flat range [start, end) into `out` (zeros past the end), in
        one foreach copy (casting to `out`'s dtype) rather than a copy per parameter."""
        dst, src = [], []
        covered = 0
        for p, lo, hi, at in self._pieces(start, end):
            t = p.grad if grad else p
            if t is None:
                continue
            dst.append(out[at:at + hi - lo])
            src.append(local(t).detach().reshape(-1)[lo:hi])
            covered += hi - lo
        if covered < out.numel():  # padding past the end, or parameters without a gradient
            out.zero_()
        if dst:
            torch._foreach_copy_(dst, src)
        return out

    @torch.no_grad()
    def write(self, start: int, end: int, values: torch.Tensor) -> None:
        dst, src = [], []
        for p, lo, hi, at in self._pieces(start, end):
            dst.append(local(p).view(-1)[lo:hi])
            src.append(values[at:at + hi - lo])
        if dst:
            torch._foreach_copy_(dst, src)


# torch >= 2.13 names it all_gather_single (all_gather_into_tensor warns there); older torch has only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def chunk_size(range_numel: int) -> int:
    """At least ~8 chunks per range (staging stays small next to the state), at most MAX_CHUNK."""
    return max(MIN_CHUNK, min(MAX_CHUNK, math.ceil(range_numel / 8)))


def memory_chunk_size(range_numel: int, cuda: bool = False, world: int = 1) -> int:
    """In memory the master and moments are stepped in place (views), so only the gradient and
    all-gather staging scale with the chunk: the whole range up to MAX_CHUNK, in one step (each
    chunk costs an all-gather and a pass over the parameters; ~8 of them were 1/8 of gpt-tiny's
    zero=1 step). On a GPU up to MAX_CHUNK_CUDA elements of all-gather staging over the `world`
    ranks of a sharded master (never below MAX_CHUNK per rank). The chunks never change the
    result: the update is elementwise."""
    cap = max(MAX_CHUNK, MAX_CHUNK_CUDA // world) if cuda else MAX_CHUNK
    return max(MIN_CHUNK, min(cap, range_numel))


class MemoryStore:
    """Master and moments as fp32 tensors on the parameters' device."""

    kind = "memory"

    def __init__(self, init: torch.Tensor, num_moments: int, chunk: int = 0):
        self.master = init
        self.moments = [torch.zeros_like(init) for _ in range(num_moments)]

    def load(self, c0: int, c1: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.master[c0:c1], [m[c0:c1] for m in self.moments]

    def save(self, c0: int, c1: int) -> None:
        """Nothing to do: load returned views."""

    def tensors(self) -> dict:
        return {"master": [self.master], "optimizer": self.moments}


class MasterOptimizer:
    """Steps the fp32 master of this rank's flat range of `params` and writes it back.

    Args:
        params: the parameters (plain tensors or DTensors; their local tensors are used).
        group: the dp process group to shard over (zero=1), or None to own everything.
        make_store: (initial fp32 range, number of moments, chunk) -> a store (MemoryStore or
            offload.FileStore); called by bind().
        chunk: elements stepped at a time (default: chunk_size of the range).
        names: the parameters' canonical names (default "0", "1", ...): the checkpoint keys.
    """

    def __init__(self, params: list[torch.Tensor], group, make_store, chunk: int | None = None,
                 names: list[str] | None = None):
        self.flat = FlatParams(params)
        self.names = names or [str(i) for i in range(len(params))]
        self.group = group
        world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        self.world = world
        self.range_numel = math.ceil(self.flat.numel / world)  # padded: every rank owns the same count
        self.start = rank * self.range_numel
        self.device = local(params[0]).device
        if chunk:
            self.chunk = chunk
        elif make_store is MemoryStore:
            self.chunk = memory_chunk_size(self.range_numel, cuda=self.device.type == "cuda", world=world)
        else:
            self.chunk = chunk_size(self.range_numel)
        self.param_dtype = local(params[0]).dtype
        init = torch.zeros(self.range_numel, dtype=torch.float32, device=self.device)
        self.flat.read(self.start, self.start + self.range_numel, grad=False, out=init)
        # The store is made once the optimizer (its number of moments) is known: bind().
        self._init, self._make_store, self.store = init, make_store, None
        self.num_steps = 0

    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters, in the order of `names`."""
        return self.flat.params

    def bind(self, num_moments: int) -> None:
        """Create the master/moment store (2 moments for adam/adamw, 1 for sgd)."""
        self.num_moments = num_moments
        self.store = self._make_store(self._init, num_moments, self.chunk)
        self._init = None

    def step(self, update, grad_coef: float) -> None:
        """One optimizer step: for each chunk, fp32 grad x grad_coef -> update(master, grad, moments, step).

        `update` is a functional optimizer step over one chunk (see step.py). All ranks of the
        group must call this together (the chunks are all-gathered).
        """
        self.num_steps += 1
        grad_buf = None
        for c0 in range(0, self.range_numel, self.chunk):
            c1 = min(c0 + self.chunk, self.range_numel)
            master, moments = self.store.load(c0, c1)
            if grad_buf is None or grad_buf.numel() < c1 - c0:
                grad_buf = torch.empty(c1 - c0, dtype=torch.float32, device=self.device)
            g = self.flat.read(self.start + c0, self.start + c1, grad=True, out=grad_buf[:c1 - c0])
            g = g.to(master.device)
            if grad_coef != 1.0:
                g.mul_(grad_coef)
            update(master, g, moments, self.num_steps)
            self.store.save(c0, c1)
            self._publish(c0, c1, master)

    def _publish(self, c0: int, c1: int, master: torch.Tensor) -> None:
        values = master.to(device=self.device, dtype=self.param_dtype)
        if self.group is None:
            self.flat.write(self.start + c0, self.start + c1, values)
            return
        # One all-gather into one buffer (rank r's chunk at r * n), then one foreach copy per rank.
        n = c1 - c0
        gathered = torch.empty(n * self.world, dtype=values.dtype, device=self.device)
        _all_gather_single(gathered, values.contiguous(), group=self.group)
        for r in range(self.world):
            base = r * self.range_numel
            self.flat.write(base + c0, base + c1, gathered[r * n:(r + 1) * n])

    # -- checkpoints ---------------------------------------------------------------------------
    def _valid(self) -> int:
        """Elements of this rank's range that are real parameters (the rest is padding)."""
        return max(0, min(self.range_numel, self.flat.numel - self.start))

    def state_dict(self) -> dict:
        """Master and moments per parameter name, each shaped and placed like its parameter (a
        DTensor with the parameter's tensor-parallel placements, else a plain tensor), so any
        layout can load them: torch.distributed.checkpoint keeps one copy of what dp replicas
        and pipeline stages share (names) and reshards DTensors.

        Collective over the group (zero=1): the ranges are all-gathered, a transient full copy.
        """
        from torch.distributed.tensor import DTensor

        out: dict = {"num_steps": self.num_steps}
        kinds = ["master"] + [f"moment{i}" for i in range(self.num_moments)]
        for k, kind in enumerate(kinds):
            by_name = {}
            for name, p, t in zip(self.names, self.flat.params, self.unflatten(self._full(k))):
                if isinstance(p, DTensor):
                    t = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                           stride=p.stride())
                by_name[name] = t
            out[kind] = by_name
        return out

    def load_state_dict(self, state: dict) -> None:
        """Load a state_dict() (possibly saved under another layout) and write the master into the parameters."""
        self.num_steps = int(state["num_steps"])
        n = self._valid()
        kinds = ["master"] + [f"moment{i}" for i in range(self.num_moments)]
        values = []
        for kind in kinds:
            flat = torch.cat([local(state[kind][name]).reshape(-1).float() for name in self.names])
            values.append(flat[self.start:self.start + n].to(self.device))
        for c0 in range(0, self.range_numel, self.chunk):
            c1 = min(c0 + self.chunk, self.range_numel)
            master, moments = self.store.load(c0, c1)
            for dst, src in zip([master] + moments, values):
                hi = max(c0, min(c1, n))
                if hi > c0:
                    dst[: hi - c0].copy_(src[c0:hi])
            self.store.save(c0, c1)
            self._publish(c0, c1, master)

    def _full(self, kind: int) -> torch.Tensor:
        """The whole flat fp32 master (kind 0) or moment kind-1 on every rank of the group."""
        pieces = []
        for c0 in range(0, self.range_numel, self.chunk):
            c1 = min(c0 + self.chunk, self.range_numel)
            master, moments = self.store.load(c0, c1)
            pieces.append(([master] + moments)[kind].to(self.device).clone())
        mine = torch.cat(pieces)
        if self.group is None:
            return mine[: self.flat.numel]
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine, group=self.group)
        return torch.cat(parts)[: self.flat.numel]

    def full_master(self) -> torch.Tensor:
        """The whole flat fp32 master on every rank of the group (tests, checkpoints)."""
        return self._full(0)

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Split a flat vector into tensors shaped like the parameters' local tensors."""
        return [flat[a:b].view(local(p).shape) for p, a, b in
                zip(self.flat.params, self.flat.offsets, self.flat.offsets[1:])]
