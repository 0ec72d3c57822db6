"""Step-time model: compute from GEMM shapes, each collective as latency + bytes / link bandwidth,
overlap only where the runtime overlaps, the pipeline bubble per schedule, recompute per mode.

FLOPs per token (fwd + bwd) = 6 N + 12 L h s (Kaplan et al. 2020's 6N plus attention's
score and value matmuls, PaLM appendix B convention); N counts the matmul weights (the input
embedding lookup is not a matmul; a tied head is). MFU counts model FLOPs only (no recompute).
The constants marked "fitted" come from bench/calibrate.py over the fit half of
workbench/calibration.yaml; docs/planning.md shows fit and held-out errors side by side.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

# -- fitted (bench/calibrate.py; docs/planning.md) -----------------------------------------
# Share of the device's dense peak that large GEMMs reach end to end (kernels, launch gaps,
# memory-bound elementwise work folded in), per device generation.
GEMM_EFFICIENCY = {"a100": 0.69, "h100": 0.74}
GEMM_EFFICIENCY_DEFAULT = 0.72  # devices with no published run in the calibration set: their mean
# Devices that share a fitted generation's compute die (the rest of the catalog uses the default).
GENERATION = {"h100-80gb": "h100", "h100-pcie": "h100", "h100-nvl": "h100", "h200": "h100",
              "a100-40gb": "a100", "a100-80gb": "a100"}
# A GEMM whose narrowest dimension is w (hidden/tp columns per rank; tp shrinks it) reaches
# w / (w + GEMM_HALF_WIDTH) of that share: narrow GEMMs fill the tensor cores less.
GEMM_HALF_WIDTH = 34.2
# The attention core unfused (QK^T and AV as head_dim-wide batched matmuls around a softmax that
# writes the s x s scores to memory, as in Megatron-LM 2021, BLOOM, OPT, MT-NLG) runs at this
# fraction of the dense GEMM efficiency.
ATTENTION_EFFICIENCY = 0.288
# Share of the compute a collective can hide behind when the runtime overlaps it (DDP buckets
# with backward, FSDP prefetch with the next block): the two contend for SMs and HBM.
OVERLAP = 0.52

# -- stated, not fitted --------------------------------------------------------------------
# Fused (flash) attention, what our runtime runs (F.scaled_dot_product_attention): FlashAttention-2
# reaches 50-73% of A100 peak forward + backward (Dao 2023, fig. 4), about what large GEMMs reach,
# and causal masking skips part of the work we count; taken as the dense GEMM efficiency.
FLASH_ATTENTION_EFFICIENCY = 1.0
# Bus bandwidth a ring collective reaches as a share of the link's rate (nccl-tests busbw on
# DGX A100/H100: ~230 of 300 GB/s NVLink, ~22 of 25 GB/s HDR InfiniBand per GPU).
LINK_EFFICIENCY = 0.8
# Per-step latency of a ring collective (NCCL's tuning model: ~1 us per NVLink hop, several us
# per network hop); a ring over n ranks takes n-1 steps per all-gather / reduce-scatter.
HOP_LATENCY_S = {"intra": 1e-6, "inter": 5e-6}
TOKENS_HALF = 128  # GEMM rows (tokens per micro-batch) at which efficiency halves
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
    """(model FLOPs per token for fwd+bwd, extra FLOPs per token per fully recomputed block)."""
    dense, attn, head = _forward_flops(shape)
    return 3 * (shape.layers * (dense + attn) + head), dense + attn


@lru_cache(maxsize=256)
def _forward_flops(shape) -> tuple[float, float, float]:
    """Forward FLOPs per token: (dense matmuls of one block, its attention core, the head)."""
    from workbench.memory.params import block_tensors, numel

    matmul = sum(numel(t) for t in block_tensors(shape, 1))  # 6N counts every weight (biases and norms are ~0.1%)
    return 2 * matmul, 4 * shape.hidden * shape.seq_len, 2 * shape.vocab * shape.hidden


def gemm_efficiency(dev, width: float, tokens: int) -> float:
    """Share of peak for a GEMM `width` columns wide over `tokens` rows on `dev`."""
    if dev.name == "cpu":
        return 1.0
    top = GEMM_EFFICIENCY.get(GENERATION.get(dev.name, ""), GEMM_EFFICIENCY_DEFAULT)
    return top * width / (width + GEMM_HALF_WIDTH) * tokens / (tokens + TOKENS_HALF)


def recomputed_forward(mode: str, blocks: int, every: int) -> tuple[int, int]:
    """(blocks whose dense forward is recomputed, blocks whose attention core is recomputed):
    full recomputes whole blocks (every k-th), selective the attention core of every block."""
    from workbench.memory.activations import checkpointed_blocks

    if mode == "selective":
        return 0, blocks
    n = checkpointed_blocks(range(blocks), mode, every)
    return n, n


def _link(size: int, stride: int, gpus_per_node: int) -> str:
    """'intra' when one node holds the `size` ranks `stride` apart, else 'inter'."""
    return "intra" if size * stride <= gpus_per_node else "inter"


def collective_s(kind: str, size: int, nbytes: float, link: str, dev) -> float:
    """Seconds of one ring collective over `size` ranks moving `nbytes` (the full tensor) on `link`.

    kind: "all_reduce" (2 (n-1)/n of the bytes, 2 (n-1) steps), "all_gather" / "reduce_scatter"
    ((n-1)/n, n-1 steps) or "p2p" (the bytes, one step).
    """
    if size <= 1 and kind != "p2p":
        return 0.0
    bw = (dev.intra_node_bw if link == "intra" else dev.inter_node_bw) * LINK_EFFICIENCY
    hop = HOP_LATENCY_S[link]
    if kind == "p2p":
        return hop + nbytes / bw
    steps = 2 * (size - 1) if kind == "all_reduce" else size - 1
    return steps * hop + steps / size * nbytes / bw


@lru_cache(maxsize=4096)
def _rank_work(shape, pp: int, chunks: int) -> tuple[int, bool]:
    """(blocks on the busiest pipeline rank, does that rank hold the head): the slowest stage sets the pace."""
    from workbench.memory.params import stage_blocks
    from workbench.parallelism import looped_stages

    n = pp * chunks
    split = stage_blocks(shape, n)
    per_rank = [sum(len(split[s]) for s in looped_stages(k, pp, chunks)) for k in range(pp)]
    dense, attn, head = _forward_flops(shape)
    cost = [b * (dense + attn) + (head if k == pp - 1 else 0) for k, b in enumerate(per_rank)]
    k = max(range(pp), key=cost.__getitem__)
    return per_rank[k], k == pp - 1


def step_time(shape, lay, dev, global_batch: int, gpus_per_node: int, params_per_rank: float,
              shard_per_rank: float, attention: str = "flash") -> StepTime:
    """Predicted seconds per optimizer step for a Layout (see workbench.memory.Layout).

    Args:
        shape: ModelShape.
        lay: Layout (degrees, zero, offload, checkpointing, micro_batch, num_micro, dtype).
        dev: catalog Device.
        global_batch: sequences per step.
        gpus_per_node: for deciding which collectives stay on NVLink.
        params_per_rank, shard_per_rank: parameters held before / after ZeRO sharding.
        attention: "flash" (our runtime's fused kernel) or "unfused" (published runs before it).
    Returns:
        StepTime with the parts that make it up.
    """
    from workbench.memory.activations import DTYPE_BYTES

    w = DTYPE_BYTES[lay.dtype]
    s, m = shape.seq_len, lay.num_micro
    tokens = lay.micro_batch * s
    model_fpt, _ = flops_per_token(shape)
    blocks, has_head = _rank_work(shape, lay.pp, lay.chunks)

    # Compute of one micro-batch on the busiest rank: dense GEMMs at a shape-dependent efficiency,
    # the attention core slower, recompute adding forwards per checkpointing mode.
    dense, attn, head = _forward_flops(shape)
    peak = dev.compute_flops[lay.dtype]
    eff = gemm_efficiency(dev, shape.hidden / lay.tp, tokens)
    fused = attention == "flash" or dev.name == "cpu"
    eff_attn = eff * (FLASH_ATTENTION_EFFICIENCY if fused else ATTENTION_EFFICIENCY)
    re_dense, re_attn = recomputed_forward(lay.activation_checkpointing, blocks, lay.checkpoint_every)
    dense_f = (3 * blocks + re_dense) * dense + (3 * head if has_head else 0.0)
    attn_f = (3 * blocks + re_attn) * attn
    per_micro = tokens * (dense_f / eff + attn_f / eff_attn) / (peak * lay.tp)
    backward_micro = per_micro * 2 / 3

    # Tensor parallel: per block 2 all-reduces forward, 2 backward, 2 more per recomputed block,
    # of the micro-batch's activations (with sequence parallelism the same bytes as all-gather +
    # reduce-scatter, and backward gathers the saved sequence shard again for each column-parallel
    # linear: wq, wk, wv, w1 (+ w3), parallel/sequence_parallel.py); not overlapped by the runtime.
    tp_link = _link(lay.tp, 1, gpus_per_node)
    act_bytes = tokens * shape.hidden * w
    if lay.sequence_parallel and lay.tp > 1:
        gather = collective_s("all_gather", lay.tp, act_bytes, tp_link, dev)
        one = gather + collective_s("reduce_scatter", lay.tp, act_bytes, tp_link, dev)
        regather = (4 + (shape.family == "llama")) * gather
    else:
        one, regather = collective_s("all_reduce", lay.tp, act_bytes, tp_link, dev), 0.0
    tp_micro = (4 * blocks + 2 * re_dense) * one + blocks * regather

    # ZeRO-2/3 (FSDP2): each block's parameters are all-gathered in forward (and, zero 3, again in
    # backward) and its gradients reduce-scattered, every micro-batch; the runtime prefetches one
    # block ahead, so a block's collectives hide behind at most one block's compute.
    dp_link = _link(lay.dp, lay.tp, gpus_per_node)
    block_params = params_per_rank / max(1, blocks)
    fsdp_micro = 0.0
    if lay.grad_sync == "fsdp":
        gather = collective_s("all_gather", lay.dp, block_params * w, dp_link, dev)
        scatter = collective_s("reduce_scatter", lay.dp, block_params * w, dp_link, dev)
        fwd_block, bwd_block = per_micro / 3 / max(1, blocks), per_micro * 2 / 3 / max(1, blocks)
        backward = scatter + (gather if lay.reshard_after_forward else 0.0)
        per_block = max(0.0, gather - OVERLAP * fwd_block) + max(0.0, backward - OVERLAP * bwd_block)
        fsdp_micro = blocks * per_block + gather  # the first block's gather has nothing to hide behind

    # Pipeline: the bubble per schedule, and one activation send per stage boundary per micro-batch
    # and direction (virtual stages add boundaries); the runtime does not overlap these.
    p, v = lay.pp, lay.chunks
    p2p_micro = tied_s = 0.0
    if p > 1:
        pp_link = _link(p, lay.dp * lay.tp, gpus_per_node)
        p2p_micro = 2 * v * collective_s("p2p", 2, act_bytes / lay.tp if lay.sequence_parallel else act_bytes,
                                          pp_link, dev)
        if shape.tie_embeddings:  # the tied embedding's gradient, summed by the first and last stage (parallel/tied.py)
            tied_s = collective_s("all_reduce", 2, shape.vocab * shape.hidden / lay.tp * w, pp_link, dev)
    bubble = _bubble(lay.pp_schedule, p, m, v)
    micro = per_micro + tp_micro + fsdp_micro + p2p_micro
    pipelined = m * micro / (1 - bubble)

    # Data parallel with ZeRO 0/1: one all-reduce of the gradients (ZeRO-1: reduce-scatter +
    # all-gather, the same bytes) after the last micro-batch; DDP overlaps its buckets with that
    # micro-batch's backward. With tp or pp the buckets are fp32 (parallel/grad_sync.py).
    exposed_dp = dp_comm = 0.0
    if lay.grad_sync in ("ddp", "all-reduce"):
        grad_bytes = params_per_rank * (4 if lay.grad_sync == "all-reduce" else w)
        dp_comm = collective_s("all_reduce", lay.dp, grad_bytes, dp_link, dev)
        last_bucket = collective_s("all_reduce", lay.dp, min(grad_bytes, lay.bucket_mb * 2**20), dp_link, dev)
        exposed_dp = max(0.0, dp_comm - OVERLAP * backward_micro) + last_bucket

    optimizer = _optimizer_time(lay, dev, shard_per_rank, params_per_rank, w)
    total = pipelined + tied_s + exposed_dp + optimizer
    tokens_per_s = global_batch * s / total
    mfu = tokens_per_s * model_fpt / (lay.world_size * peak)
    compute = m * per_micro
    exposed = m * (tp_micro + fsdp_micro + p2p_micro) + tied_s + exposed_dp
    detail = {"flops_per_token": model_fpt, "efficiency": eff, "attention_efficiency": eff_attn,
              "tp_comm_s": m * tp_micro, "fsdp_exposed_s": m * fsdp_micro, "dp_exposed_s": exposed_dp, "dp_comm_s": dp_comm,
              "p2p_s": m * p2p_micro + tied_s, "bubble_s": pipelined - m * micro}
    return StepTime(total, tokens_per_s, mfu, compute, bubble, exposed, optimizer, detail)


def _bubble(schedule: str, p: int, m: int, v: int) -> float:
    """Idle share of the pipelined time: (p-1) / (v m + p - 1) for 1F1B/GPipe (v=1) and interleaved
    1F1B (Narayanan et al. 2021, eq. 1 and 2); zero-bubble ZB-H1 splits backward into B and W
    (F = B = W), a third of 1F1B's idle time (Qi et al. 2023)."""
    if p == 1:
        return 0.0
    if schedule == "zero-bubble":
        return (p - 1) / (3 * m + p - 1)  # see workbench.timeline
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (m + p - 1)


def _optimizer_time(lay, dev, shard: float, params: float, w: int) -> float:
    """The optimizer step: memory-bound on the device, PCIe + host Adam with offload=cpu,
    and a read + write of master weights and moments with offload=nvme."""
    updated = shard if lay.shards_optimizer_state else params
    device_step = updated * 36 / dev.hbm_bw  # read/write weights, grads, master, 2 moments
    if lay.offload == "none":
        return device_step
    transfer = updated * (4 + w) / PCIE_BW  # gradients down, updated weights up
    host = updated / CPU_ADAM_PARAMS_PER_S
    if lay.offload == "nvme":
        host += 2 * updated * 12 / NVME_BW  # master + moments in and out of files
    return transfer + host
