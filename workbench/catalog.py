"""Accelerators the spec may name, with the facts the estimators need.

Numbers are per device, dense (no sparsity), from the vendors' public data sheets; `source`
names the sheet. Memory is the usable HBM capacity in bytes as the driver reports it
(vendor GB are 10^9 bytes).
"""
from __future__ import annotations

from dataclasses import dataclass

GB = 10**9
GiB = 2**30


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int
    bf16_flops: float  # peak dense bf16/fp16 tensor FLOP/s
    fp32_flops: float  # peak dense fp32 FLOP/s (non-tensor-core; TF32 not assumed)
    intra_node_bw: float  # bytes/s per device inside a node (NVLink / ICI), one direction
    inter_node_bw: float  # bytes/s per device across nodes (InfiniBand / EFA / DCN)
    max_per_node: int
    source: str


DEVICES: dict[str, Device] = {
    d.name: d
    for d in [
        # A CPU "device": what the local runtime uses when there is no GPU. Its figures are
        # rough and only used to give the planner something finite on this machine.
        Device("cpu", 16 * GiB, 0.2e12, 0.2e12, 10e9, 1.25e9, 64, "nominal; CPU worker"),
        Device("a100-40gb", 40 * GiB, 312e12, 19.5e12, 300e9, 25e9, 8,
               "NVIDIA A100 datasheet (2021): 312 TF bf16 dense, NVLink3 600 GB/s bidirectional"),
        Device("a100-80gb", 80 * GiB, 312e12, 19.5e12, 300e9, 25e9, 8,
               "NVIDIA A100 80GB datasheet (2021)"),
        Device("h100-80gb", 80 * GiB, 989e12, 67e12, 450e9, 50e9, 8,
               "NVIDIA H100 SXM datasheet (2023): 989 TF bf16 dense, NVLink4 900 GB/s bidirectional"),
        Device("h200", 141 * GB, 989e12, 67e12, 450e9, 50e9, 8,
               "NVIDIA H200 SXM datasheet (2024): 141 GB HBM3e, same compute as H100"),
        Device("l4", 24 * GB, 121e12, 30.3e12, 32e9, 12.5e9, 8,
               "NVIDIA L4 datasheet (2023): 242 TF fp16 with sparsity -> 121 dense; PCIe Gen4 x16"),
        Device("a10g", 24 * GB, 70e12, 31.2e12, 32e9, 12.5e9, 8,
               "NVIDIA A10 datasheet (2021): 125 TF fp16 dense (A10G on AWS g5 is ~70 TF)"),
        Device("v100-16gb", 16 * GiB, 125e12, 15.7e12, 150e9, 12.5e9, 8,
               "NVIDIA V100 SXM2 datasheet (2020): 125 TF fp16 tensor, NVLink2 300 GB/s"),
        Device("v100-32gb", 32 * GiB, 125e12, 15.7e12, 150e9, 12.5e9, 8,
               "NVIDIA V100 SXM2 32GB datasheet (2020)"),
        Device("t4", 16 * GB, 65e12, 8.1e12, 16e9, 6.25e9, 8,
               "NVIDIA T4 datasheet (2019): 65 TF fp16 mixed precision"),
        Device("tpu-v5e", 16 * GB, 197e12, 197e12 / 4, 200e9, 25e9, 8,
               "Google Cloud TPU v5e docs: 197 TF bf16, 16 GB HBM2, ICI 1600 Gbps"),
        Device("tpu-v5p", 95 * GB, 459e12, 459e12 / 4, 600e9, 25e9, 4,
               "Google Cloud TPU v5p docs: 459 TF bf16, 95 GB HBM2e, ICI 4800 Gbps"),
    ]
}


def get_device(name: str) -> Device:
    from workbench.errors import ConfigError

    try:
        return DEVICES[name]
    except KeyError:
        raise ConfigError(
            f"resources.gpu: unknown GPU type {name!r}. Known types: {', '.join(DEVICES)}."
        ) from None
