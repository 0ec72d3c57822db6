"""Step-time model: compute from FLOPs, communication per strategy, pipeline bubble, offload.

FLOPs per token (fwd + bwd) = 6 N + 12 L h s (Kaplan et al. 2020's 6N plus attention's
score and value matmuls, PaLM appendix B convention); N counts the matmul weights (the input
embedding lookup is not a matmul; a tied head is). Recomputation adds one forward (2 N_blocks +
4 L h s) per checkpointed block. MFU counts model FLOPs only (no recompute).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

# Achievable share of peak for a dense transformer's matmuls on tensor cores, calibrated on
# published runs: Megatron-LM's GPT-3 175B on 1536 A100s reached 148 TFLOP/s per GPU end to end
# (47% of peak; Narayanan et al. 2021, Table 1) and Llama 3 405B 38-43% MFU on 16k H100s (Llama 3
# paper, 2024). Small matmuls fill the tensor cores less: the share is scaled by t/(t+128) for
# t tokens per micro-batch and w/(w+64) for w = hidden/tp columns per rank.
PEAK_EFFICIENCY = 0.6
DEVICE_EFFICIENCY = {"h100-80gb": 0.5, "h200": 0.5}
PCIE_BW = 25e9  # bytes/s host <-> device per GPU (PCIe Gen4 x16, practical)
CPU_ADAM_PARAMS_PER_S = 0.25e9  # fp32 Adam updates per second per GPU's share of host cores
NVME_BW = 3e9  # bytes/s per GPU to local NVMe (read or write)


@dataclass(frozen=True)
class StepTime:
    step_time_s: float
    tokens_per_s: float
    mfu: float
    compute_s: float
    bubble: float
    exposed_comm_s: float
    optimizer_s: float
    detail: dict


@lru_cache(maxsize=256)
def flops_per_token(shape) -> tuple[float, float]:
    """(model FLOPs per token for fwd+bwd, extra FLOPs per token per recomputed block)."""
    from workbench.memory.params import block_tensors, numel

    block = sum(numel(t) for t in block_tensors(shape, 1))
    head = shape.vocab * shape.hidden  # the output projection (tied or not)
    matmul_params = shape.layers * block + head
    attn = 12 * shape.layers * shape.hidden * shape.seq_len
    recompute_block = 2 * block + 4 * shape.hidden * shape.seq_len
    return 6 * matmul_params + attn, recompute_block


def _efficiency(tokens_per_micro: int, width: float, device_name: str) -> float:
    if device_name == "cpu":
        return 1.0
    peak = DEVICE_EFFICIENCY.get(device_name, PEAK_EFFICIENCY)
    return peak * tokens_per_micro / (tokens_per_micro + 128) * width / (width + 64)


def _group_bw(size: int, stride: int, gpus_per_node: int, dev) -> float:
    """Bandwidth of a collective over `size` ranks `stride` apart: NVLink when one node holds them."""
    return dev.intra_node_bw if size * stride <= gpus_per_node else dev.inter_node_bw


def _ring(size: int, nbytes: float, bw: float) -> float:
    return 2 * (size - 1) / size * nbytes / bw if size > 1 else 0.0


def step_time(shape, lay, dev, global_batch: int, gpus_per_node: int, params_per_rank: float,
              shard_per_rank: float) -> StepTime:
    """Predicted seconds per optimizer step for a Layout (see workbench.memory.Layout).

    Args:
        shape: ModelShape.
        lay: Layout (degrees, zero, offload, checkpointing, micro_batch, num_micro, dtype).
        dev: catalog Device.
        global_batch: sequences per step.
        gpus_per_node: for deciding which collectives stay on NVLink.
        params_per_rank, shard_per_rank: parameters held before / after ZeRO sharding.
    Returns:
        StepTime with the parts that make it up.
    """
    from workbench.memory.activations import DTYPE_BYTES, checkpointed_blocks

    w = DTYPE_BYTES[lay.dtype]
    s = shape.seq_len
    model_fpt, recompute_fpt = flops_per_token(shape)
    n_ckpt = checkpointed_blocks(range(shape.layers), lay.activation_checkpointing, lay.checkpoint_every)
    hw_fpt = model_fpt + n_ckpt * recompute_fpt
    tokens_per_rank = global_batch // lay.dp * s
    peak = dev.compute_flops[lay.dtype]
    eff = _efficiency(lay.micro_batch * s, shape.hidden / lay.tp, dev.name)
    compute = tokens_per_rank * hw_fpt / (lay.tp * lay.pp) / (peak * eff)
    backward = compute * 2 / 3

    # Tensor parallel: per block 2 all-reduces forward, 2 backward (+2 when recomputed), of the
    # micro-batch's activations; NVLink inside the node; on the critical path.
    tp_bytes = lay.micro_batch * s * shape.hidden * w
    tp_bw = _group_bw(lay.tp, 1, gpus_per_node, dev)
    per_block = (4 + (2 if n_ckpt else 0)) * _ring(lay.tp, tp_bytes, tp_bw)
    tp_comm = per_block * shape.layers / lay.pp * lay.num_micro

    # Data parallel: gradients (or ZeRO's shards) over dp ranks `tp` apart.
    dp_bw = _group_bw(lay.dp, lay.tp, gpus_per_node, dev)
    # With tp or pp, zero 0/1 average gradients in fp32 buckets (parallel/grad_sync.py).
    grad_bytes = params_per_rank * (4 if lay.zero < 2 and lay.tp * lay.pp > 1 else w)
    if lay.zero == 3:
        dp_comm = 1.5 * _ring(lay.dp, grad_bytes, dp_bw)  # all-gather fwd + bwd, reduce-scatter
        overlap = compute * 0.9  # prefetched gathers hide behind compute
    else:
        dp_comm = _ring(lay.dp, grad_bytes, dp_bw)  # all-reduce, or reduce-scatter + all-gather
        overlap = backward / lay.num_micro if lay.pp == 1 else backward  # last micro-batch's backward
    last_bucket = min(grad_bytes, lay.bucket_mb * 2**20) / dp_bw if lay.dp > 1 else 0.0
    exposed_dp = max(0.0, dp_comm - overlap) + last_bucket

    # Pipeline: bubble, and one activation hop per stage boundary on the critical path.
    m, p = lay.num_micro, lay.pp
    if p == 1:
        bubble = 0.0
    elif lay.pp_schedule == "interleaved-1f1b":
        bubble = (p - 1) / (lay.chunks * m + p - 1)
    elif lay.pp_schedule == "zero-bubble":
        bubble = (p - 1) / (3 * m + p - 1)  # ZB-H1 with F = B = W (see workbench.timeline)
    else:
        bubble = (p - 1) / (m + p - 1)
    pp_bw = _group_bw(p, lay.dp * lay.tp, gpus_per_node, dev)
    p2p = 2 * (p - 1) * lay.micro_batch * s * shape.hidden * w / pp_bw if p > 1 else 0.0
    if p > 1 and shape.tie_embeddings:
        # The tied embedding's gradient, summed between the first and the last stage (parallel/tied.py).
        p2p += _ring(2, shape.vocab * shape.hidden / lay.tp * w, pp_bw)
    pipelined = (compute + tp_comm) / (1 - bubble) + p2p

    optimizer = _optimizer_time(lay, dev, shard_per_rank, params_per_rank, w)
    total = pipelined + exposed_dp + optimizer
    tokens_per_s = global_batch * s / total
    mfu = tokens_per_s * model_fpt / (lay.world_size * peak)
    detail = {"flops_per_token": model_fpt, "hw_flops_per_token": hw_fpt, "efficiency": eff,
              "tp_comm_s": tp_comm, "dp_comm_s": dp_comm, "p2p_s": p2p}
    return StepTime(total, tokens_per_s, mfu, compute, bubble, tp_comm + exposed_dp + p2p, optimizer, detail)


def _optimizer_time(lay, dev, shard: float, params: float, w: int) -> float:
    """The optimizer step: memory-bound on the device, PCIe + host Adam with offload=cpu,
    and a read + write of master weights and moments with offload=nvme."""
    updated = shard if lay.zero >= 1 else params
    device_step = updated * 36 / dev.hbm_bw  # read/write weights, grads, master, 2 moments
    if lay.offload == "none":
        return device_step
    transfer = updated * (4 + w) / PCIE_BW  # gradients down, updated weights up
    host = updated / CPU_ADAM_PARAMS_PER_S
    if lay.offload == "nvme":
        host += 2 * updated * 12 / NVME_BW  # master + moments in and out of files
    return transfer + host
