"""Offload: optimizer state and fp32 master in files (nvme, ZeRO-Infinity style) or FSDP2's CPU offload.

nvme: the rank's flat fp32 master and optimizer moments live in files under `layout.nvme_path`;
the optimizer step streams them through small staging buffers one chunk at a time (read, update,
write back), so memory holds 3 chunks instead of 12 bytes per parameter.
cpu: FSDP2's CPUOffloadPolicy keeps the sharded parameters, gradients and optimizer state in host
memory and runs the optimizer step there; on a CPU-only machine that is where they already are.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref

import torch

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
