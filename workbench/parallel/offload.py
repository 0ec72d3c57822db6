"""Offload: optimizer state and fp32 master in files (nvme, ZeRO-Infinity style) or FSDP2's CPU offload.

nvme at zero 0/1 (FileStore): the rank's flat fp32 master and optimizer moments live in files under
`layout.nvme_path`; the optimizer step streams them through small staging buffers one chunk at a
time (read, update, write back), so memory holds 3 chunks instead of 12 bytes per parameter.
nvme at zero 2/3 (NvmeShards + NvmeShardOptimizer, ZeRO-Infinity): FSDP2's fp32 shards in a
memory-mapped file, read ahead of their all-gather and dropped after it, written back after the
step; the moments in files streamed by I/O threads (docs/strategies.md).
cpu: FSDP2's CPUOffloadPolicy keeps the sharded parameters, gradients and optimizer state in host
memory and runs the optimizer step there; on a CPU-only machine that is where they already are.
"""
from __future__ import annotations

import functools
import logging
import mmap
import os
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn as nn

from workbench.parallel.local import local

log = logging.getLogger(__name__)

CPU_NOOP_NOTE = ("offload=cpu is a no-op on this CPU-only machine: parameters, gradients and optimizer "
                 "state already live in CPU memory (FSDP2's CPUOffloadPolicy is applied, but there is no "
                 "device memory to save).")


class FileStore:
    """fp32 master + moments of one rank's flat range, in files, streamed through staging buffers.

    Args:
        init: the initial fp32 master of the range (written to disk, then dropped from memory).
        num_moments: optimizer moments per element (2 for adam/adamw, 1 for sgd).
        directory: where to create this store's own sub-directory (created if missing).
        chunk: elements per staging buffer.
    """

    kind = "nvme"

    def __init__(self, init: torch.Tensor, num_moments: int, directory: str, chunk: int):
        os.makedirs(directory, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix=f"rank{_rank()}-", dir=directory)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.numel, self.chunk = init.numel(), chunk
        names = ["master"] + [f"moment{i}" for i in range(num_moments)]
        self.fds = [os.open(os.path.join(self.dir, f"{n}.f32"), os.O_RDWR | os.O_CREAT, 0o600) for n in names]
        for fd in self.fds:
            os.ftruncate(fd, self.numel * 4)  # sparse zeros: moments start at 0
        self._fd_finalizers = [weakref.finalize(self, os.close, fd) for fd in self.fds]
        self.buffers = [bytearray(chunk * 4) for _ in self.fds]
        self.views = [torch.frombuffer(b, dtype=torch.float32) for b in self.buffers]
        host = init.detach().to("cpu", torch.float32)
        for c0 in range(0, self.numel, chunk):
            c1 = min(c0 + chunk, self.numel)
            self.views[0][: c1 - c0].copy_(host[c0:c1])
            self._write(0, c0, c1)
        self._loaded: tuple[int, int] | None = None

    def _write(self, i: int, c0: int, c1: int) -> None:
        os.pwrite(self.fds[i], memoryview(self.buffers[i])[: (c1 - c0) * 4], c0 * 4)

    def _read(self, i: int, c0: int, c1: int) -> None:
        n = os.preadv(self.fds[i], [memoryview(self.buffers[i])[: (c1 - c0) * 4]], c0 * 4)
        if n != (c1 - c0) * 4:
            raise OSError(f"short read from {self.dir}: {n} of {(c1 - c0) * 4} bytes")

    def load(self, c0: int, c1: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Read chunk [c0, c1) into the staging buffers; returns views (master, moments)."""
        for i in range(len(self.fds)):
            self._read(i, c0, c1)
        self._loaded = (c0, c1)
        views = [v[: c1 - c0] for v in self.views]
        return views[0], views[1:]

    def save(self, c0: int, c1: int) -> None:
        """Write the staged chunk back to its files."""
        for i in range(len(self.fds)):
            self._write(i, c0, c1)

    def tensors(self) -> dict:
        """Resident tensors: only the staging buffers (reported apart from master/optimizer)."""
        return {"master": [], "optimizer": []}

    def offloaded(self) -> dict:
        """Extra keys for the memory events: bytes on disk and the resident staging bytes."""
        return {"master_on_disk": self.numel * 4, "optimizer_on_disk": self.numel * 4 * (len(self.fds) - 1),
                "offload_staging": sum(len(b) for b in self.buffers)}


def build_file_store(directory: str):
    """A make_store(init, num_moments, chunk) for MasterOptimizer that keeps the state under `directory`."""

    def make(init: torch.Tensor, num_moments: int, chunk: int) -> FileStore:
        return FileStore(init, num_moments, directory, chunk)

    return make


def cpu_offload_policy(device: torch.device):
    """FSDP2's CPUOffloadPolicy for `device` (pinned host memory only when there is a GPU to copy to).

    Returns:
        (policy, note): note is the plain statement that it is a no-op on a CPU-only machine, else None.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy

    if device.type == "cpu":
        log.warning(CPU_NOOP_NOTE)
        return CPUOffloadPolicy(pin_memory=False), CPU_NOOP_NOTE
    return CPUOffloadPolicy(pin_memory=True), None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


# --------------------------------------------------------------------------------------------
# ZeRO-Infinity at zero 2/3: FSDP2's fp32 parameter shards (the master) and the optimizer moments
# in files. Built beside FSDP2 on its own extension points (docs/strategies.md, "nvme at zero 2/3"):
# FSDP2 keeps doing the all-gathers, reduce-scatters and mixed precision; the shards it reads
# are memory-mapped files, paged in ahead of the all-gather that needs them and dropped after.

PAGE = mmap.PAGESIZE
PREFETCH_BLOCKS = 2  # blocks whose shards are read ahead of the running one (forward and backward)
IO_THREADS = 2  # moment reads of the next chunk and writes of the previous one, beside the update
# Dirty page-cache bytes allowed before the step syncs its files: a memory cgroup (v1) cannot reclaim
# dirty file pages, and the kernel's dirty limits are global, so a step that wrote its whole shard
# before one fdatasync held ~12 bytes x shard in dirty cache and was OOM-killed under a cap.
SYNC_BYTES = 32 * 2**20


def _fadvise(fd: int, offset: int, length: int, advice: int) -> None:
    if length > 0 and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, advice)


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, for preadv/pwrite into and out of it (no copy)."""
    return memoryview(t.numpy()).cast("B")


class MappedFile:
    """A file of `nbytes` mapped shared into this process, as a flat fp32 tensor over its bytes.

    Writes through the tensor land in the page cache and reach the file on `flush`; `evict` drops
    a byte range from this process and from the page cache (clean pages only, hence flush first),
    `prefetch` asks the kernel to read a range ahead (asynchronous readahead). Correctness never
    depends on either: a page that is not resident is read on first touch.
    """

    def __init__(self, path: str, nbytes: int):
        self.path, self.nbytes = path, max(nbytes, PAGE)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, self.nbytes)  # sparse zeros
        self.mm = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.flat = torch.frombuffer(self.mm, dtype=torch.float32)  # shares the mapping's memory
        self._finalizer = weakref.finalize(self, os.close, self.fd)

    def prefetch(self, offset: int, length: int) -> None:
        _fadvise(self.fd, offset, length, getattr(os, "POSIX_FADV_WILLNEED", 3))
        self.mm.madvise(mmap.MADV_WILLNEED, offset, _page_round(length))

    def flush(self) -> None:
        self.mm.flush()  # msync(MS_SYNC): dirty pages written to the file

    def evict(self, offset: int, length: int) -> None:
        self.mm.madvise(mmap.MADV_DONTNEED, offset, _page_round(length))
        _fadvise(self.fd, offset, length, getattr(os, "POSIX_FADV_DONTNEED", 4))

    def resident_bytes(self) -> int:
        """Bytes of this mapping resident in this process (Rss of its /proc/self/smaps entry)."""
        return _smaps_rss(self.path)


def _page_round(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _smaps_rss(path: str) -> int:
    """Resident bytes of the mappings of `path` in this process (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    total, inside = 0, False
    for line in lines:
        head = line.split(None, 1)
        if head and "-" in head[0] and not head[0].endswith(":"):
            inside = line.rstrip().endswith(path)
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


@dataclass
class ShardGroup:
    """The FSDP2 parameters of one fully_shard module, at [offset, offset + nbytes) of the file."""

    label: str
    fsdp_params: list
    offset: int = 0
    nbytes: int = 0


class NvmeShards:
    """One rank's FSDP2 fp32 shards (padded, as FSDP2 all-gathers them) in one memory-mapped file.

    The shards are re-pointed at the mapping with FSDP2's own mechanism (`_sharded_param_data`
    and the sharded DTensor's `_local_tensor`, exactly what FSDPParam.reset_sharded_param
    assigns); each fully_shard module's shards are one page-aligned range, so they are read
    ahead, written back and dropped as a unit.

    Args:
        groups: (label, fsdp module) in forward order: the blocks, then the root.
        directory: where this rank's sub-directory of files is made.
        reshard_after_forward: zero=3 (the shards are read again for backward's all-gather).
        window: blocks read ahead of the running one.
    """

    def __init__(self, groups: list[tuple[str, nn.Module]], directory: str, *, reshard_after_forward: bool,
                 window: int = PREFETCH_BLOCKS):
        os.makedirs(directory, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix=f"rank{_rank()}-shards-", dir=directory)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.window, self.reshard_after_forward = window, reshard_after_forward
        self.groups = [ShardGroup(label, _fsdp_params(m)) for label, m in groups]
        self.modules = [m for _, m in groups]
        offset = 0
        for g in self.groups:
            g.offset = offset
            g.nbytes = sum(fp._sharded_param_data.numel() * 4 for fp in g.fsdp_params)
            offset += _page_round(g.nbytes)
        self.file = MappedFile(os.path.join(self.dir, "shards.f32"), offset)
        self.offsets: dict[int, int] = {}  # id(sharded param) -> element offset of its shard in the file
        with torch.no_grad():
            for g in self.groups:
                at = g.offset // 4
                for fp in g.fsdp_params:
                    self._move(fp, at)
                    at += fp._sharded_param_data.numel()
                os.fdatasync(self.file.fd)  # a group at a time: the dirty cache stays one group
                self.file.evict(g.offset, g.nbytes)
        self.flush_and_evict()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvme-prefetch")
        self._hooks: list = []
        self.prefetches = 0

    def _move(self, fp, at: int) -> None:
        data = fp._sharded_param_data
        if data.dtype != torch.float32:
            raise NotImplementedError(f"offload=nvme keeps fp32 shards; FSDP2 holds {data.dtype}")
        if fp.fsdp_placement.dim != 0:
            raise NotImplementedError("offload=nvme needs FSDP2's dim-0 sharding")
        view = self.file.flat[at:at + data.numel()]
        view.copy_(data.detach().reshape(-1).cpu())
        length = fp.sharded_param._local_tensor.size(0) if fp.sharded_param._local_tensor.numel() else 0
        fp._sharded_param_data = view
        fp.sharded_param._local_tensor = view.view(fp.padded_sharded_param_size).narrow(0, 0, length)
        self.offsets[id(fp.sharded_param)] = at

    # -- residency --------------------------------------------------------------------------
    def prefetch(self, indices) -> None:
        """Read the shards of these groups ahead (a thread asks the kernel; returns at once)."""
        for i in indices:
            if 0 <= i < len(self.groups):
                g = self.groups[i]
                self.prefetches += 1
                self._pool.submit(self.file.prefetch, g.offset, g.nbytes)

    def evict(self, indices) -> None:
        for i in indices:
            if 0 <= i < len(self.groups):
                self.file.evict(self.groups[i].offset, self.groups[i].nbytes)

    def flush_and_evict(self) -> None:
        """After the step: the updated shards written to the file, then dropped from memory."""
        self.file.flush()
        self.file.evict(0, self.file.nbytes)

    def install_hooks(self) -> None:
        """Forward: group i's pre-hook reads i+1..i+window ahead; its post-hook drops i (its
        all-gather is done). Backward (zero=3, where FSDP2 all-gathers again, and prefetches one
        block further itself): on the block's output gradient, before FSDP2's pre-backward, read
        i..i-window ahead and drop the groups after i. Registered with prepend=True, so each runs
        before FSDP2's own hook on the same module."""
        root = len(self.groups) - 1
        for i, module in enumerate(self.modules):
            if i == root:
                pre = functools.partial(self._root_pre_forward)
                self._hooks.append(module.register_forward_pre_hook(pre, prepend=True))
                continue
            self._hooks.append(module.register_forward_pre_hook(functools.partial(self._pre_forward, i),
                                                                prepend=True))
            self._hooks.append(module.register_forward_hook(functools.partial(self._post_forward, i),
                                                            prepend=True))

    def _root_pre_forward(self, module, args) -> None:
        self.prefetch([len(self.groups) - 1, *range(self.window)])

    def _pre_forward(self, i: int, module, args) -> None:
        if i == 0:  # the root's all-gather ran in its pre-forward: its shards can go
            self.evict([len(self.groups) - 1])
        self.prefetch(range(i + 1, i + 1 + self.window))

    def _post_forward(self, i: int, module, args, output) -> None:
        self.evict([i])
        if not (self.reshard_after_forward and torch.is_grad_enabled()):
            return
        out = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(functools.partial(self._pre_backward, i))

    def _pre_backward(self, i: int, grad) -> None:
        self.evict(range(i + 1, len(self.groups) - 1))
        self.prefetch(range(i, i - 1 - self.window, -1))

    # -- measurement ------------------------------------------------------------------------
    def resident_bytes(self) -> int:
        return self.file.resident_bytes()

    def file_bytes(self) -> int:
        return self.file.nbytes


def _fsdp_params(module: nn.Module) -> list:
    """FSDP2's FSDPParam objects of one fully_shard module (torch 2.13's FSDPState)."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    group = state._fsdp_param_group
    return list(group.fsdp_params) if group is not None else []


class NvmeShardOptimizer:
    """The optimizer step of zero 2/3 with offload=nvme: the fp32 shards (in NvmeShards' file,
    FSDP2's master) are updated in place through the mapping; the moments live in files of the
    same layout and stream through two staging slots per moment: while chunk k is updated, a thread
    reads chunk k+1's moments and another writes chunk k-1's back (os.preadv / os.pwrite, which
    release the GIL). Numbers: torch's functional adam/sgd, the same as torch.optim's.

    Has MasterOptimizer's interface for TrainStep and checkpoints (bind, step, state_dict,
    load_state_dict, names, params) and `params_are_master`: the parameters hold the trained
    weights (full_state reads them).
    """

    kind = "nvme"
    params_are_master = True

    def __init__(self, shards: NvmeShards, params: list[torch.Tensor], names: list[str], chunk: int,
                 mixed: bool = False):
        self.shards, self.params, self.names = shards, params, names
        self.mixed = mixed  # FSDP2 mixed precision: the fp32 shards are reported as master, not params
        self.chunk = chunk
        self.num_steps = 0
        self.num_moments = 0
        self.moments: list[MappedFile] = []
        # (param index, lo, hi, element offset in the files): the step's chunks, in file order.
        self.chunks = []
        for i, p in enumerate(params):
            at, n = shards.offsets[id(p)], local(p).numel()
            for lo in range(0, n, chunk):
                hi = min(lo + chunk, n)
                self.chunks.append((i, lo, hi, at + lo))
        self._pool = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="nvme-io")
        self._unsynced = 0  # bytes written since the last fdatasync (shards and moments)
        self._sync_lock = threading.Lock()

    def bind(self, num_moments: int) -> None:
        self.num_moments = num_moments
        self.moments = [MappedFile(os.path.join(self.shards.dir, f"moment{k}.f32"), self.shards.file.nbytes)
                        for k in range(num_moments)]
        self.staging = [[torch.zeros(self.chunk) for _ in range(num_moments)] for _ in range(2)]
        self.grad_buf = torch.zeros(self.chunk)

    def _read(self, slot: int, at: int, n: int) -> None:
        for k, f in enumerate(self.moments):
            got = os.preadv(f.fd, [_bytes_view(self.staging[slot][k][:n])], at * 4)
            if got != n * 4:
                raise OSError(f"short read from {f.path}: {got} of {n * 4} bytes")

    def _write(self, slot: int, at: int, n: int) -> None:
        for k, f in enumerate(self.moments):
            view = _bytes_view(self.staging[slot][k][:n])
            done = 0
            while done < len(view):
                done += os.pwrite(f.fd, view[done:], at * 4 + done)
        with self._sync_lock:  # the chunk's shard (updated through the mapping) and its moments
            self._unsynced += n * 4 * (1 + len(self.moments))
            if self._unsynced < SYNC_BYTES:
                return
            self._unsynced = 0
            # fdatasync writes the mapping's dirty pages too (the kernel tracks them per file).
            for fd in (self.shards.file.fd, *(f.fd for f in self.moments)):
                os.fdatasync(fd)

    def step(self, update, grad_coef: float) -> None:
        """One optimizer step over this rank's shards (no collective: FSDP2 already reduce-scattered)."""
        self.num_steps += 1
        flat = self.shards.file.flat
        reads: list = [None, None]
        writes: list = [None, None]
        if self.chunks:
            _, lo, hi, at = self.chunks[0]
            reads[0] = self._pool.submit(self._read, 0, at, hi - lo)
        for k, (i, lo, hi, at) in enumerate(self.chunks):
            slot, n = k % 2, hi - lo
            reads[slot].result()
            if k + 1 < len(self.chunks):
                other = 1 - slot
                if writes[other] is not None:
                    writes[other].result()  # its staging slot is free again
                _, lo2, hi2, at2 = self.chunks[k + 1]
                reads[other] = self._pool.submit(self._read, other, at2, hi2 - lo2)
            grad = self.params[i].grad
            g = self.grad_buf[:n]
            if grad is None:
                g.zero_()
            else:
                g.copy_(local(grad).detach().reshape(-1)[lo:hi])
            if grad_coef != 1.0:
                g.mul_(grad_coef)
            update(flat[at:at + n], g, [b[:n] for b in self.staging[slot]], self.num_steps)
            writes[slot] = self._pool.submit(self._write, slot, at, n)
        for w in writes:
            if w is not None:
                w.result()
        self.shards.flush_and_evict()
        for f in self.moments:
            os.fdatasync(f.fd)
            f.evict(0, f.nbytes)

    # -- memory ------------------------------------------------------------------------------
    def measured(self) -> dict:
        """Memory-event keys: the shards and moments resident now (measured from /proc/self/smaps),
        their file sizes, and the staging buffers."""
        key = "master" if self.mixed else "params"
        return {key: self.shards.resident_bytes(),
                "optimizer": sum(f.resident_bytes() for f in self.moments),
                f"{key}_on_disk": self.shards.file_bytes(),
                "optimizer_on_disk": sum(f.nbytes for f in self.moments),
                "offload_staging": sum(b.numel() * 4 for s in self.staging for b in s) + self.grad_buf.numel() * 4}

    # -- checkpoints -------------------------------------------------------------------------
    def _moment(self, k: int, p: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        at, shape = self.shards.offsets[id(p)], local(p).shape
        view = self.moments[k].flat[at:at + local(p).numel()].view(shape)
        if isinstance(p, DTensor):
            return DTensor.from_local(view, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        return view

    def state_dict(self) -> dict:
        """MasterOptimizer's format: the master is the parameter shard itself, the moments are
        views of their files (no copy; DCP reads them, or writes into them on load)."""
        out: dict = {"num_steps": self.num_steps, "master": dict(zip(self.names, self.params))}
        for k in range(self.num_moments):
            out[f"moment{k}"] = {n: self._moment(k, p) for n, p in zip(self.names, self.params)}
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
        kinds = ["master"] + [f"moment{k}" for k in range(self.num_moments)]
        for kind in kinds:
            for n, p in zip(self.names, self.params):
                dst = local(p) if kind == "master" else local(self._moment(int(kind[6:]), p))
                src = local(state[kind][n])
                if src.data_ptr() != dst.data_ptr():
                    dst.copy_(src.reshape(dst.shape))
        self.shards.flush_and_evict()
        for f in self.moments:
            f.flush()
            f.evict(0, f.nbytes)


def attach_nvme(module: nn.Module, directory: str, *, reshard_after_forward: bool, mixed: bool,
                chunk: int | None = None) -> NvmeShardOptimizer:
    """zero 2/3 with offload=nvme on a fully_shard'ed, materialized `module`: its shards into a
    file, the prefetch hooks, and the optimizer that steps them with moments in files."""
    from workbench.parallel.master import chunk_size
    from workbench.parallel.materialize import param_name

    blocks = getattr(module, "blocks", None)
    groups = [(f"blocks.{k}", b) for k, b in blocks.items()] if isinstance(blocks, nn.ModuleDict) else []
    groups.append(("root", module))
    shards = NvmeShards(groups, directory, reshard_after_forward=reshard_after_forward)
    shards.install_hooks()
    named = [(param_name(module, n), p) for n, p in module.named_parameters() if p.requires_grad]
    total = sum(local(p).numel() for _, p in named)
    return NvmeShardOptimizer(shards, [p for _, p in named], [n for n, _ in named], chunk or chunk_size(total),
                              mixed=mixed)
