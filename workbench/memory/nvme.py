"""Bytes and seconds offload=nvme moves between files and host memory per optimizer step.

Torch-free, for the memory model, the planner and the step-time model (workbench/steptime.py
adds `nvme_transfer_s` to the optimizer step's time). What moves is what parallel/offload.py does:

- zero 0/1: the rank's flat range of fp32 master and optimizer moments is read and written back
  once per step (chunk by chunk): (4 + moments) bytes x range, each way.
- zero 2/3 (ZeRO-Infinity): FSDP2's fp32 shards are read before their all-gather in forward (and
  again before backward's at zero 3, which re-gathers), and read + written once by the step; the
  moments are read and written once by the step.
"""
from __future__ import annotations

from dataclasses import dataclass

from workbench.memory.states import OPTIMIZER_BYTES


@dataclass(frozen=True)
class NvmeTraffic:
    read_bytes: float
    write_bytes: float

    def seconds(self, bandwidth: float) -> float:
        """At `bandwidth` bytes/s for reads and for writes (one drive does one at a time)."""
        return (self.read_bytes + self.write_bytes) / bandwidth


def nvme_traffic(zero: int, shard: float, optimizer: str) -> NvmeTraffic:
    """File traffic of one rank per optimizer step.

    Args:
        zero: layout.zero.
        shard: parameters this rank's files hold (zero 0: all of the rank's; zero 1: its flat
            range; zero 2/3: its FSDP2 shard).
        optimizer: train.optimizer (adam/adamw: 8 bytes of moments per parameter, sgd: 4).
    """
    moments = OPTIMIZER_BYTES[optimizer]
    if zero < 2:
        return NvmeTraffic((4 + moments) * shard, (4 + moments) * shard)
    gathers = 2 if zero == 3 else 1  # forward, and backward's re-gather at zero 3
    return NvmeTraffic((4 * (gathers + 1) + moments) * shard, (4 + moments) * shard)


def nvme_transfer_s(lay, shard: float, dev) -> float:
    """Seconds per step of file I/O for offload=nvme (0 otherwise), at the device's catalog
    `nvme_bw` (workbench/catalog.py). Not overlapped with compute: the prefetch window hides the
    forward/backward reads behind blocks' compute when the drive keeps up, the step's I/O is not hidden."""
    if lay.offload != "nvme":
        return 0.0
    return nvme_traffic(lay.zero, shard, lay.optimizer).seconds(dev.nvme_bw)
