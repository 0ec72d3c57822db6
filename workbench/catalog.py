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
    source: str
    hbm_bw: float = 2.0e12  # bytes/s device memory bandwidth (the optimizer step is bound by it)
    bf16_native: bool = True  # False: bf16 runs at fp32 speed (V100, T4 have fp16 tensor cores only)
    host_memory_bytes: int = 0  # host RAM per device on the usual instance (offload=cpu); 0 = unknown
    nics_per_node: int = 8  # network adapters of the usual node (rail-aligned: one per GPU on DGX/HGX)
    # bytes/s per device to the node's local NVMe (offload=nvme), read or write: the instance's NVMe
    # drives' sequential bandwidth / its devices. Default 3 GB/s: one PCIe Gen4 x4 NVMe drive per GPU
    # (p4d: 8 x 1 TB NVMe, p5: 8 x 3.84 TB NVMe SSD, from the EC2 instance pages; ~3 GB/s sequential
    # each per the drives' datasheets). The CPU worker's figure is dd's on this workbench's /tmp
    # (bench/bench_nvme.py measures it again on every run).
    nvme_bw: float = 3.0e9

    @property
    def compute_flops(self) -> dict[str, float]:
        """Peak dense FLOP/s by training dtype."""
        half = self.bf16_flops
        return {"fp32": self.fp32_flops, "fp16": half, "bf16": half if self.bf16_native else self.fp32_flops}


# host_memory_bytes: the instance's RAM / its GPUs (p4d/p4de 1152 GiB, p5/p5en 2048 GiB, g5/g6.48xlarge
# 768 GiB, p3.16xlarge 488 GiB, p3dn 768 GiB, g4dn.12xlarge 192 GiB / 4), from the EC2 instance pages.
DEVICES: dict[str, Device] = {
    d.name: d
    for d in [
        # A CPU "device": what the local runtime uses when there is no GPU. Its figures are
        # rough and only used to give the planner something finite on this machine.
        Device("cpu", 16 * GiB, 0.2e12, 0.2e12, 10e9, 1.25e9, "nominal; CPU worker", hbm_bw=20e9, nics_per_node=1,
               nvme_bw=1.0e9),
        Device("a100-40gb", 40 * GiB, 312e12, 19.5e12, 300e9, 25e9,
               "NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TF bf16 dense, 19.5 TF fp32, 1.555 TB/s HBM2, "
               "NVLink3 600 GB/s bidirectional; DGX A100: one 200 Gb/s HDR InfiniBand NIC per GPU",
               host_memory_bytes=1152 * GiB // 8, hbm_bw=1.555e12),
        Device("a100-80gb", 80 * GiB, 312e12, 19.5e12, 300e9, 25e9,
               "NVIDIA A100 Tensor Core GPU datasheet (2021): 80GB SXM, 2.039 TB/s HBM2e",
               host_memory_bytes=1152 * GiB // 8, hbm_bw=2.039e12),
        # 81559 MiB is what nvidia-smi reports for an H100 SXM 80GB.
        Device("h100-80gb", 81559 * 2**20, 989e12, 67e12, 450e9, 50e9,
               "NVIDIA H100 Tensor Core GPU datasheet (2023), SXM: 989 TF bf16 dense, 67 TF fp32, 3.35 TB/s HBM3, "
               "NVLink4 900 GB/s bidirectional; 400 Gb/s NDR/EFA per GPU (AWS p5: 3200 Gb/s per 8 GPUs)",
               host_memory_bytes=2048 * GiB // 8, hbm_bw=3.35e12),
        Device("h200", 141 * GB, 989e12, 67e12, 450e9, 50e9,
               "NVIDIA H200 Tensor Core GPU datasheet (2024), SXM: 141 GB HBM3e at 4.8 TB/s, H100's compute",
               host_memory_bytes=2048 * GiB // 8, hbm_bw=4.8e12),
        # PCIe cards: NVLink bridges join pairs only, so a group of the node's GPUs meets over PCIe
        # Gen5 x16 (64 GB/s per direction; 50 practical); the usual PCIe servers have no GPUDirect
        # RDMA fabric: 100 Gb/s Ethernet per 8 GPUs assumed across nodes.
        Device("h100-pcie", 80 * GB, 756e12, 51e12, 50e9, 12.5e9 / 8,
               "NVIDIA H100 Tensor Core GPU datasheet (2023), PCIe: 80 GB HBM2e at 2.0 TB/s, 756 TF bf16 dense "
               "(1,513 with sparsity), 51 TF fp32, NVLink bridge 600 GB/s bidirectional per pair, PCIe Gen5",
               hbm_bw=2.0e12, nics_per_node=1),
        Device("h100-nvl", 94 * GB, 835e12, 60e12, 50e9, 12.5e9 / 8,
               "NVIDIA H100 Tensor Core GPU datasheet (2023), H100 NVL: 94 GB HBM3 at 3.9 TB/s, 835 TF bf16 dense "
               "(1,671 with sparsity), 60 TF fp32, NVLink bridge 600 GB/s bidirectional per pair, PCIe Gen5",
               hbm_bw=3.9e12, nics_per_node=1),
        Device("b200", 180 * GB, 2.25e15, 80e12, 900e9, 50e9,
               "NVIDIA HGX B200 datasheet (2024): 180 GB HBM3e at 7.7 TB/s per GPU, 2.25 PF bf16 dense (4.5 with "
               "sparsity), NVLink5 1.8 TB/s bidirectional; DGX B200: 8 x 400 Gb/s ConnectX-7 per 8 GPUs. fp32 "
               "(non-tensor) is not on the sheet: 80 TF assumed (it only prices fp32 jobs)",
               host_memory_bytes=2048 * GiB // 8, hbm_bw=7.7e12),
        Device("l4", 24 * GB, 121e12, 30.3e12, 32e9, 12.5e9 / 8,
               "NVIDIA L4 datasheet (2023): 242 TF fp16 with sparsity -> 121 dense, 300 GB/s GDDR6; PCIe Gen4 "
               "x16 (no NVLink); AWS g6.48xlarge 100 Gb/s per 8 GPUs",
               host_memory_bytes=768 * GiB // 8, hbm_bw=300e9, nics_per_node=1),
        Device("a10g", 24 * GB, 70e12, 31.2e12, 32e9, 12.5e9 / 8,
               "AWS g5 (A10G): ~70 TF fp16/bf16 dense tensor (NVIDIA A10 datasheet: 125 TF at higher clocks), "
               "600 GB/s GDDR6; PCIe Gen4; g5.48xlarge 100 Gb/s per 8 GPUs",
               host_memory_bytes=768 * GiB // 8, hbm_bw=600e9, nics_per_node=1),
        Device("v100-16gb", 16 * GiB, 125e12, 15.7e12, 150e9, 25e9 / 8 / 8,
               "NVIDIA V100 datasheet (2020), SXM2: 125 TF fp16 tensor (no bf16), 15.7 TF fp32, 900 GB/s HBM2, "
               "NVLink2 300 GB/s bidirectional; AWS p3.16xlarge 25 Gb/s per node",
               host_memory_bytes=488 * GiB // 8, hbm_bw=900e9,
               bf16_native=False, nics_per_node=1),
        Device("v100-32gb", 32 * GiB, 125e12, 15.7e12, 150e9, 100e9 / 8 / 8,
               "NVIDIA V100 datasheet (2020), SXM2 32GB; AWS p3dn.24xlarge 100 Gb/s per node",
               host_memory_bytes=768 * GiB // 8, hbm_bw=900e9,
               bf16_native=False, nics_per_node=1),
        Device("t4", 16 * GB, 65e12, 8.1e12, 16e9, 50e9 / 8 / 4,
               "NVIDIA T4 datasheet (2019): 65 TF fp16 mixed precision (no bf16), 8.1 TF fp32, 320 GB/s GDDR6; "
               "PCIe Gen3 x16; AWS g4dn.12xlarge 50 Gb/s per 4 GPUs",
               host_memory_bytes=192 * GiB // 4, hbm_bw=320e9, bf16_native=False, nics_per_node=1),
        # TPUs: fp32 matmuls run as several bf16 passes; a quarter of bf16 peak is our assumption.
        Device("tpu-v5e", 16 * GB, 197e12, 197e12 / 4, 200e9, 25e9,
               "Google Cloud TPU v5e documentation: 197 TF bf16, 16 GB HBM2 at 819 GB/s, ICI 1600 Gb/s per chip",
               hbm_bw=819e9),
        Device("tpu-v5p", 95 * GB, 459e12, 459e12 / 4, 600e9, 25e9,
               "Google Cloud TPU v5p documentation: 459 TF bf16, 95 GB HBM2e at 2765 GB/s, ICI 4800 Gb/s per chip",
               hbm_bw=2.765e12),
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
