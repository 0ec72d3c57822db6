"""Step-time model from the work each rank does: GEMMs, memory-bound ops, collectives, host dispatch.

One optimizer step on the busiest pipeline rank is built from what a micro-batch runs:
- every GEMM of the forward and backward with its (m, n, k), timed at a shape-dependent
  achievable rate (`Hardware.gemm_s`);
- the attention core, fused (flash) or unfused (scores in memory);
- the memory-bound work (norms, activations, rotary, residual adds, the loss's softmax, casts,
  gradient accumulation, the optimizer step) as bytes moved at the device's memory bandwidth;
- each collective by its algorithm (ring, or tree across nodes for small all-reduces) at the bus
  bandwidth of the link it crosses, with a node's NICs shared by the group's ranks on that node;
- overlap only where the engine overlaps (our runtime: DDP buckets with backward, FSDP prefetch;
  Megatron-Core's flags for the published runs), bounded by what is left to overlap with;
- the pipeline bubble per schedule and the recompute of each checkpointing mode;
- the host's dispatch of every kernel: a GPU step takes max(device, host) (the host runs ahead
  asynchronously); a CPU step takes their sum (one thread does both).

`Hardware` answers from the catalog's data sheets (workbench/catalog.py) or, once the user ran
`workbench calibrate`, from the profile measured on their cluster (workbench/hwprofile.py).

FLOPs per token (fwd + bwd) = 6 N + 12 L h s (Kaplan et al. 2020's 6N plus attention's score and
value matmuls, PaLM appendix B convention); N counts the matmul weights (the input embedding
lookup is not a matmul; a tied head is). MFU counts model FLOPs only (no recompute) and is only
given for accelerators (None on CPU: a CPU has no tensor-core peak to be a share of).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import TYPE_CHECKING

from workbench.memory.nvme import nvme_transfer_s
from workbench.memory.params import block_numel, unit_blocks, whole_unit

if TYPE_CHECKING:
    from workbench.catalog import Device
    from workbench.hwprofile import HardwareProfile

# -- fitted (bench/calibrate.py over the `fit` third of workbench/calibration.yaml) -----------
# Share of the dense peak that large GEMMs sustain through a training run, per device generation:
# cuBLAS's best shape (~80-87% in microbenchmarks, see MAMF below) times the clocks a GPU holds
# under sustained load. Fitted on several runs of each generation, never one.
GEMM_EFFICIENCY = {"a100": 0.699, "h100": 0.585}
GEMM_EFFICIENCY_DEFAULT = 0.642  # devices with no published run: the fitted generations' mean
# Devices that share a fitted generation's compute die (the rest of the catalog uses the default).
GENERATION = {"h100-80gb": "h100", "h100-pcie": "h100", "h100-nvl": "h100", "h200": "h100",
              "a100-40gb": "a100", "a100-80gb": "a100"}
# A GEMM reaches x / (x + half) of that share in each of its dimensions: the narrow side of a
# tp-sharded GEMM and few tokens per micro-batch fill the tensor cores less (tile quantisation).
GEMM_HALF_WIDTH = 190.0
TOKENS_HALF = 25.2
# The attention core unfused (QK^T and AV as head_dim-wide batched matmuls around a softmax that
# writes the s x s scores to memory, as in Megatron-LM 2021, BLOOM, OPT, MT-NLG) runs at this
# fraction of the dense GEMM efficiency.
ATTENTION_EFFICIENCY = 0.374
# Share of the compute a collective can hide behind when the engine overlaps it (DDP buckets with
# backward, FSDP prefetch with the next block, Megatron-Core's overlap flags): the two contend for
# SMs and memory bandwidth.
OVERLAP = 1.0

# -- stated, not fitted ----------------------------------------------------------------------
# Fused attention relative to the dense GEMM rate: FlashAttention-2 reaches 50-73% of A100 peak
# forward + backward (Dao 2023, fig. 4), about what large GEMMs reach; on H100 it reaches about
# 35% of peak (Shah et al. 2024, FlashAttention-3, sec. 1) where cuBLAS reaches ~70%: half.
FLASH_RELATIVE = {"a100": 0.528, "h100": 0.326}
FLASH_RELATIVE_DEFAULT = 0.75
# Elementwise kernels reach this share of the HBM data-sheet bandwidth (STREAM-like copy/triad
# kernels on A100/H100 reach 80-90%); `workbench calibrate` measures the real one.
HBM_EFFICIENCY = 0.8
# Host time to dispatch one kernel from eager PyTorch (CUDA launch ~3-5 us plus the dispatcher;
# PyTorch's performance tuning guide): the floor of a step made of many small kernels.
LAUNCH_S = 5e-6
# Bus bandwidth a ring collective reaches as a share of the link's rate (nccl-tests busbw on
# DGX A100/H100: ~230 of 300 GB/s NVLink, ~22 of 25 GB/s HDR InfiniBand per NIC).
LINK_EFFICIENCY = 0.8
# Per-step latency of a collective (NCCL's tuning model: ~1 us per NVLink hop, several us per
# network hop).
HOP_LATENCY_S = {"intra": 1e-6, "inter": 5e-6}
PCIE_BW = 25e9  # bytes/s host <-> device per GPU (PCIe Gen4 x16, practical)
CPU_ADAM_PARAMS_PER_S = 0.25e9  # fp32 Adam updates per second per GPU's share of host cores
# Kernels per block (forward; backward runs about twice as many): the ops of workbench/models.py
# (norms, the four attention projections, the attention core, the MLP's matmuls and activation,
# the residual adds; rotary's slices, multiplies and concatenations for llama).
OPS_PER_BLOCK = {"gpt": 14, "llama": 24}
# Kernels of a torch.optim step per parameter tensor without foreach (the CPU default):
# AdamW's decay, two moment updates, the bias corrections, sqrt, the division and the update.
OPTIMIZER_OPS_PER_TENSOR = 12


@dataclass(frozen=True)
class StepTime:
    step_time_s: float
    tokens_per_s: float
    mfu: float | None  # None on CPU
    compute_s: float
    bubble: float
    exposed_comm_s: float
    optimizer_s: float
    detail: dict


@dataclass(frozen=True)
class Engine:
    """What the training engine overlaps. Our runtime: DDP's buckets with backward and FSDP's
    prefetch (`WORKBENCH`); published runs say theirs (workbench/calibration.yaml)."""

    name: str = "workbench"
    grad_reduce: bool = True  # gradient reduction overlapped with backward (DDP buckets / FSDP)
    prefetch: bool = True  # ZeRO-3/FSDP's parameter all-gathers overlapped with the previous block
    per_tensor: bool = False  # ZeRO-3 collectives per parameter tensor (DeepSpeed 2021), not per block (FSDP2)
    distributed_optimizer: bool = False  # ZeRO-1 as reduce-scatter + all-gather (Megatron-Core), not all-reduce + all-gather (ours)
    param_gather: bool = False  # ZeRO-1's parameter all-gather overlapped with the next forward
    tp_comm: bool = False  # tensor-parallel collectives overlapped with the GEMMs
    # FSDP1's backward prefetch (torch.distributed.fsdp.BackwardPrefetch): "pre" issues the next block's
    # all-gather before the current block's gradient computation (overlapping the two; FSDP2 and our
    # runtime prefetch alike); "post" issues it after, so the all-gather waits exposed and only the
    # reduce-scatter overlaps the next block's gradient computation (the API's own docstring).
    backward_prefetch: str = "pre"
    # Bytes per gradient element that ZeRO-2/3 (FSDP) reduce-scatters: 4 (fp32: our runtime, and
    # FSDP1 MixedPrecision with reduce_dtype fp32) or 2 (reduce_dtype bf16/fp16, e.g. Composer's PURE).
    grad_reduce_bytes: int = 4
    # ZeRO-2 keeps the gathered parameters from one micro-batch to the next where the layout allows
    # (ours: Parallelism.keeps_gathered), so only a step's first micro-batch all-gathers them.
    keep_gathered: bool = False
    # ZeRO-2/3 shard consecutive blocks as one FSDP2 unit up to `bucket_mb` (ours:
    # Parallelism.fsdp_unit_mb), not one unit per block (FSDP1/FSDP2 as torchtitan and Composer wrap).
    fsdp_units: bool = False


WORKBENCH = Engine(keep_gathered=True, fsdp_units=True)


@dataclass(frozen=True)
class Hardware:
    """The device as the step-time model asks about it: from the catalog, or a measured profile.

    Args:
        dev: catalog Device.
        gpus_per_node: devices per node (which groups stay on NVLink, how many share the NICs).
        profile: a HardwareProfile from `workbench calibrate` for this device, or None.
    """

    dev: Device
    gpus_per_node: int
    profile: HardwareProfile | None = None
    _cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def cpu(self) -> bool:
        return self.dev.name == "cpu"

    @property
    def source(self) -> str:
        if self.profile is not None:
            return self.profile.label()
        if self.cpu:
            return "catalog defaults (cpu: nominal figures; run `workbench calibrate` for this host's)"
        return f"catalog defaults ({self.dev.name})"

    def gemm_s(self, m: float, n: float, k: float, dtype: str) -> float:
        """Seconds of one (m x k) @ (k x n)."""
        if self.profile is not None:
            return self.profile.gemm_s(int(m), int(n), int(k), dtype)
        return 2 * m * n * k / (self.dev.compute_flops[dtype] * gemm_efficiency(self.dev, min(n, k), m))

    def grad_gemm_s(self, m: float, n: float, k: float, dtype: str) -> float:
        """Seconds of the backward of a forward (m x k) @ (k x n): the input gradient (m x n) @ (n x k)
        and the weight gradient (n x m) @ (m x k) as autograd lays them out, where the profile
        measured them; else both at the forward GEMM's rate (the catalog; older profiles)."""
        if self.profile is not None:
            dgrad = self.profile.grad_gemm_s("dgrad", int(m), int(k), int(n), dtype)
            wgrad = self.profile.grad_gemm_s("wgrad", int(n), int(k), int(m), dtype)
            if dgrad is not None and wgrad is not None:
                return dgrad + wgrad
        return self.gemm_s(m, k, n, dtype) + self.gemm_s(k, n, m, dtype)

    def attention_s(self, flops: float, dtype: str, tokens: int, width: float, fused: bool, seq: int,
                    head_dim: int, backward: bool = False) -> float:
        """Seconds of the attention core's matmuls executing `flops` over `tokens` rows of `width`
        (heads x head_dim on this rank), fused (flash) or not, in its forward or `backward` pass."""
        if self.profile is not None and fused:  # the fused kernel itself, where calibrate timed it
            measured = self.profile.attention_s("bwd" if backward else "fwd", dtype, tokens / seq * width / head_dim,
                                                seq, head_dim)
            if measured is not None:
                return measured
        if self.profile is not None:  # measured: as many (tokens x seq) @ (seq x head_dim) GEMMs
            one = 2 * tokens * seq * head_dim
            return flops / one * self.profile.gemm_s(tokens, head_dim, seq, dtype)
        gen = GENERATION.get(self.dev.name, "")
        rel = FLASH_RELATIVE.get(gen, FLASH_RELATIVE_DEFAULT) if fused else ATTENTION_EFFICIENCY
        return flops / (self.dev.compute_flops[dtype] * gemm_efficiency(self.dev, width, tokens) * rel)

    def memory_s(self, nbytes: float, dtype: str = "fp32") -> float:
        """Seconds of memory-bound work moving `nbytes` (reads + writes) of `dtype` elements (a
        profile may have measured another rate for bf16: a CPU without bf16 units converts)."""
        if self.profile is not None:
            return nbytes / self.profile.elementwise_bw(dtype)
        return nbytes / (self.dev.hbm_bw * HBM_EFFICIENCY)

    def elementwise_s(self, op: str, kind: str, dtype: str, rows: float, cols: int, nbytes: float) -> float:
        """Seconds of a block's norm or activation (`op`, workbench/shapes.py ELEMENTWISE) in its `kind`
        pass over `rows` x `cols`: as the profile measured it at the model's shapes, else its `nbytes`
        at the memory bandwidth (a GPU's are bound by bandwidth; a CPU's by their math)."""
        measured = self.profile.elementwise_s(op, kind, dtype, rows, cols) if self.profile is not None else None
        return measured if measured is not None else self.memory_s(nbytes, dtype)

    def overhead(self, lay, block_params: float) -> tuple[float, float, float]:
        """(seconds per step, per block and micro-batch, per block once a step) that the runtime's
        step for this layout's strategy family costs beyond the modelled work, for blocks of
        `block_params` parameters on the rank: measured by `workbench calibrate` (the runtime's own
        step on a near-empty model and on the spec's model, at 1 and 2 micro-batches); zeros from
        the catalog or an older profile."""
        if self.profile is None:
            return 0.0, 0.0, 0.0
        return self.profile.overhead(overhead_family(lay), block_params) or (0.0, 0.0, 0.0)

    @property
    def launch_s(self) -> float:
        return self.profile.op_overhead_s if self.profile is not None else LAUNCH_S

    @property
    def overlap(self) -> float:
        """Share of compute a collective hides behind; none on CPU (gloo and the math share the cores)."""
        return 0.0 if self.cpu else OVERLAP

    def collective_s(self, kind: str, size: int, nbytes: float, stride: int) -> float:
        """Seconds of one collective over `size` ranks `stride` apart (mesh order pp, dp, tp)."""
        if size <= 1 and kind != "p2p":
            return 0.0
        key = (kind, size, nbytes, stride)
        if key not in self._cache:
            self._cache[key] = self._collective(kind, size, nbytes, stride)
        return self._cache[key]

    def _collective(self, kind: str, size: int, nbytes: float, stride: int) -> float:
        link = link_of(size, stride, self.gpus_per_node)
        if self.profile is not None:
            measured = self.profile.collective_s(kind, size, nbytes, link)
            if measured is not None:
                return measured
        local = group_ranks_per_node(size, stride, self.gpus_per_node)
        return collective_s(kind, size, nbytes, link, self.dev, local, self.gpus_per_node)


def overhead_family(lay) -> str:
    """The strategy family whose measured overhead a layout pays (workbench/hwprofile.py FAMILIES):
    the first of pipeline, tensor parallel, ZeRO 3/2/1, DDP, one rank that the layout uses."""
    if lay.pp > 1:
        return "pp"
    if lay.tp > 1:
        return "tp"
    if lay.dp > 1:
        return {3: "zero3", 2: "zero2", 1: "zero1"}.get(lay.zero, "ddp")
    return "single"


def link_of(size: int, stride: int, gpus_per_node: int) -> str:
    """'intra' when one node holds the `size` ranks `stride` apart, else 'inter'."""
    return "intra" if size * stride <= gpus_per_node else "inter"


def group_ranks_per_node(size: int, stride: int, gpus_per_node: int) -> int:
    """How many of a group's ranks share a node (each node's NICs serve that many of its rings)."""
    return max(1, min(size, gpus_per_node // max(1, stride)))


def bus_bandwidth(link: str, dev, local: int = 1, gpus_per_node: int = 8) -> float:
    """Bytes/s of a collective's bus bandwidth per rank on `link`.

    Inside a node: NVLink/NVSwitch (or PCIe) per device. Across nodes NCCL runs one ring per
    NIC (rail-aligned): a group with `local` ranks on each node drives `local` of the node's
    NICs at once, so its bus bandwidth is `local` x one GPU's share of the node's network,
    capped by the node's internal links (Jeaugey, NCCL 2.x talks; nccl-tests busbw).
    """
    if link == "intra":
        return dev.intra_node_bw * LINK_EFFICIENCY
    share = dev.inter_node_bw * min(local, gpus_per_node)
    return min(share, dev.intra_node_bw) * LINK_EFFICIENCY


def collective_s(kind: str, size: int, nbytes: float, link: str, dev, local: int = 1, gpus_per_node: int = 8) -> float:
    """Seconds of one collective over `size` ranks moving `nbytes` (the full tensor) on `link`.

    kind: "all_reduce" (ring: 2 (n-1)/n of the bytes in 2 (n-1) steps; across nodes NCCL's tree
    when its log-depth latency wins), "all_gather" / "reduce_scatter" ((n-1)/n, n-1 steps) or
    "p2p" (the bytes, one step).
    """
    if size <= 1 and kind != "p2p":
        return 0.0
    bw = bus_bandwidth(link, dev, local, gpus_per_node)
    hop = HOP_LATENCY_S[link]
    if kind == "p2p":
        return hop + nbytes / bw
    steps = 2 * (size - 1) if kind == "all_reduce" else size - 1
    ring = steps * hop + steps / size * nbytes / bw
    if kind == "all_reduce" and link == "inter":
        tree = 2 * math.ceil(math.log2(size)) * hop + 2 * nbytes / bw  # double binary tree: full bytes both ways
        return min(ring, tree)
    return ring


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


def gemm_efficiency(dev, width: float, tokens: float) -> float:
    """Share of peak for a GEMM `width` wide (its narrow weight side) over `tokens` rows on `dev`."""
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


@lru_cache(maxsize=4096)
def _rank_work(shape, pp: int, chunks: int, split: tuple[int, ...] | None = None) -> tuple[int, bool, bool]:
    """(blocks on the busiest pipeline rank, does it hold the head, does it hold the embedding), for
    the runtime's split or an engine's own (`split`: blocks per stage)."""
    from workbench.memory.params import stage_blocks
    from workbench.parallelism import looped_stages

    sizes = split or tuple(len(r) for r in stage_blocks(shape, pp * chunks))
    per_rank = [sum(sizes[s] for s in looped_stages(k, pp, chunks)) for k in range(pp)]
    dense, attn, head = _forward_flops(shape)
    cost = [b * (dense + attn) + (head if k == pp - 1 else 0) for k, b in enumerate(per_rank)]
    k = max(range(pp), key=cost.__getitem__)
    return per_rank[k], k == pp - 1, k == 0


def check_split(shape, lay, split: tuple[int, ...]) -> None:
    """An engine's own split covers the model: one count per (virtual) stage, none negative, summing
    to the model's layers.

    Raises:
        ConfigError: the rule, the numbers and a fix.
    """
    from workbench.errors import ConfigError

    if len(split) != lay.num_stages or min(split) < 0 or sum(split) != shape.layers:
        raise ConfigError(
            f"pipeline split {list(split)}: needs one block count per stage (pp({lay.pp}) x {lay.chunks} = "
            f"{lay.num_stages} stages), none negative, summing to the model's {shape.layers} layers; it has "
            f"{len(split)} counts summing to {sum(split)}. Give the blocks of every stage in stage order.")


def engine_split(layers: int, pp: int, chunks: int, account_for_embedding: bool = False,
                 account_for_loss: bool = False, first: int | None = None,
                 last: int | None = None) -> tuple[int, ...]:
    """Blocks per (virtual) stage, in stage order, as Megatron-Core builds them
    (megatron/core/transformer/transformer_block.py `get_num_layers_to_build`):
    `--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers` (`first`, `last`) give
    the first and last pipeline rank their own count and split the rest evenly; otherwise
    `--account-for-embedding-in-pipeline-split` / `--account-for-loss-in-pipeline-split` count the
    embedding and the loss as one layer each, and the first (last) virtual stage builds one block fewer.
    Each rank's count is then divided evenly over its `chunks` virtual stages. Llama 3 405B's
    pipeline is the second (Llama Team 2024, sec. 3.3.2: "we reduce one Transformer layer each from the
    first and the last stages").

    Raises:
        ConfigError: a split Megatron-Core refuses (its asserts), with the numbers and a fix.
    """
    from workbench.errors import ConfigError

    per_rank = _engine_rank_layers(layers + account_for_embedding + account_for_loss, pp, first, last)
    if any(n % chunks for n in per_rank):
        raise ConfigError(
            f"pipeline split: layers per pipeline rank {sorted(set(per_rank))} must divide into virtual_stages"
            f"({chunks}) (Megatron-Core: num_layers_per_pipeline_rank % vp_size == 0). Use virtual stages dividing "
            f"{min(per_rank)}.")
    stages = [per_rank[s % pp] // chunks for s in range(pp * chunks)]
    stages[0] -= account_for_embedding
    stages[-1] -= account_for_loss
    if min(stages) < 0:
        raise ConfigError(f"pipeline split: the first or last virtual stage has no block left for the embedding or "
                          f"the loss to replace ({stages[0]}, {stages[-1]}). Use fewer virtual stages.")
    return tuple(stages)


def _engine_rank_layers(layers: int, pp: int, first: int | None, last: int | None) -> list[int]:
    """Layers per pipeline rank of `engine_split` (Megatron-Core's even split, or its uneven first/last)."""
    from workbench.errors import ConfigError

    ends = (first is not None) + (last is not None)
    rest, left = layers - (first or 0) - (last or 0), pp - ends
    if left > 0 and rest % left or left <= 0 and rest:
        raise ConfigError(
            f"pipeline split: {layers} layers less the first ({first}) and last ({last}) stages leave {rest} for "
            f"{left} stages, which must divide evenly (Megatron-Core: 'the left over layers must be divisible by "
            f"left over stages'). Change first/last so that {left} divides the rest.")
    per = [rest // left if left > 0 else 0] * pp
    if first is not None:
        per[0] = first
    if last is not None:
        per[-1] = last
    return per


def split_params(shape, tp: int, pp: int, chunks: int, dp: int, split: tuple[int, ...],
                 pp_index: int = 0) -> tuple[int, int]:
    """(parameters, FSDP2 shard over dp) of pipeline rank `pp_index` under an engine's own split: its
    blocks, the embedding on stage 0 and the final norm and head on the last (memory.params.rank_counts'
    counting for the runtime's split)."""
    from workbench.memory.params import block_tensors, embedding_tensors, final_tensors, fsdp_shard_numel, numel
    from workbench.parallelism import looped_stages

    stages = looped_stages(pp_index, pp, chunks)
    edge = (embedding_tensors(shape, tp) if 0 in stages else []) + \
        (final_tensors(shape, tp, head_copy=pp * chunks > 1) if pp * chunks - 1 in stages else [])
    block = block_tensors(shape, tp)
    n = sum(split[s] for s in stages)
    return (sum(numel(t) for t in edge) + n * sum(numel(t) for t in block),
            fsdp_shard_numel(edge, dp) + n * fsdp_shard_numel(block, dp))


@lru_cache(maxsize=4096)
def _tensors(shape, tp: int, pp: int, chunks: int) -> int:
    """Parameter tensors on the first pipeline rank (the optimizer's per-tensor kernels)."""
    from workbench.memory.params import rank_counts

    return rank_counts(shape, tp, pp, 0, chunks)[2]


@lru_cache(maxsize=256)
def _block_tensor_count(shape) -> int:
    from workbench.memory.params import block_tensors

    return len(block_tensors(shape, 1))


@dataclass(frozen=True)
class _Work:
    """Device seconds and host kernel count of one piece of a micro-batch."""

    device_s: float = 0.0
    ops: float = 0.0

    def __add__(self, o: _Work) -> _Work:
        return _Work(self.device_s + o.device_s, self.ops + o.ops)

    def __mul__(self, k: float) -> _Work:
        return _Work(self.device_s * k, self.ops * k)


def _block_gemms(shape, t: int, tp: int) -> list[tuple[int, int, int]]:
    """(m, n, k) of one block's forward GEMMs on one tp rank: q, k, v, o, the MLP's."""
    h, kv, f = shape.hidden, shape.kv_dim, shape.ffn_hidden
    out = [(t, h // tp, h), (t, kv // tp, h), (t, kv // tp, h), (t, h, h // tp), (t, f // tp, h), (t, h, f // tp)]
    if shape.family == "llama":
        out.append((t, f // tp, h))  # SwiGLU's gate
    return out


def _gemm_work(hw: Hardware, gemms, dtype: str, backward: bool) -> _Work:
    """Forward: each GEMM once; backward: its input gradient (m x n @ n x k) and weight gradient
    (k x m @ m x n): twice the FLOPs at their own shapes."""
    s = 0.0
    for m, n, k in gemms:
        s += hw.grad_gemm_s(m, n, k, dtype) if backward else hw.gemm_s(m, n, k, dtype)
    return _Work(s, len(gemms) * (2 if backward else 1))


def _block_memory_s(hw: Hardware, shape, tokens: int, tp: int, sp: bool, dtype: str) -> tuple[float, float]:
    """Seconds of the memory-bound ops of one block per micro-batch (forward, backward).

    The two norms and the MLP's activation at their measured time where the profile has it
    (`Hardware.elementwise_s`), else at their bytes; the rest at their bytes. Per token, in
    elements: each norm reads and writes h (backward: reads x and dy, writes dx); each residual add
    reads 2h and writes h; gpt's GELU reads and writes f (backward 3f); llama's SwiGLU reads 2f and
    writes f, with silu's own pass 2f (backward 8f) and rotary reads and writes q and k three times
    (sin and cos products, the sum). Norms and residuals are split by tp only with sequence
    parallelism; what is inside the column/row-parallel regions always is.
    """
    from workbench.memory.activations import DTYPE_BYTES
    from workbench.shapes import elementwise_shapes

    w = DTYPE_BYTES[dtype]
    h, kv = shape.hidden, shape.kv_dim
    (norm, norm_rows, _), (act, _, f) = elementwise_shapes(shape, tokens, tp, sp)
    llama = shape.family == "llama"
    act_bytes = (5 * f, 8 * f) if llama else (2 * f, 3 * f)
    rest = 2 * 3 * h * (1 / tp if sp else 1.0) * tokens + (6 * (h + kv) / tp * tokens if llama else 0.0)
    out = []
    for i, kind in enumerate(("fwd", "bwd")):
        s = 2 * hw.elementwise_s(norm, kind, dtype, norm_rows, h, (2, 3)[i] * h * norm_rows * w)
        s += hw.elementwise_s(act, kind, dtype, tokens, f, act_bytes[i] * tokens * w)
        out.append(s + hw.memory_s(rest * w, dtype))
    return out[0], out[1]


@lru_cache(maxsize=4096)
def _block_work(hw: Hardware, shape, tokens: int, tp: int, sp: bool, dtype: str, fused: bool):
    """(forward, backward, attention-core forward, memory-bound seconds) of one block and micro-batch.

    GEMMs at their shapes; the attention core (flash runs the causal half of the 4 h s FLOPs per
    token and recomputes the scores in backward: 2.5x the forward; unfused computes the whole
    s x s and its backward twice); the memory-bound ops.
    """
    s = shape.seq_len
    gemms = _block_gemms(shape, tokens, tp)
    attn_flops = 4 * shape.hidden / tp * s * tokens
    executed = (0.5, 1.25) if fused else (1.0, 2.0)
    attn = [_Work(hw.attention_s(attn_flops * x, dtype, tokens, shape.hidden / tp, fused, s, shape.head_dim,
                                 backward=i == 1), 1 + 2 * i) for i, x in enumerate(executed)]
    mem_fwd, mem_bwd = _block_memory_s(hw, shape, tokens, tp, sp, dtype)
    mem_ops = OPS_PER_BLOCK.get(shape.family, 16) - len(gemms) - 1
    mem_f, mem_b = _Work(mem_fwd, mem_ops), _Work(mem_bwd, 2 * mem_ops)
    fwd = _gemm_work(hw, gemms, dtype, False) + attn[0] + mem_f
    bwd = _gemm_work(hw, gemms, dtype, True) + attn[1] + mem_b
    return fwd, bwd, attn[0], mem_f.device_s + mem_b.device_s


@lru_cache(maxsize=4096)
def _edge_work(hw: Hardware, shape, tokens: int, tp: int, dtype: str, has_head: bool, has_embedding: bool) -> _Work:
    """The head and the loss on the last stage: its GEMM (vocab sharded over tp), the fp32 cast
    and softmax of the logits forward and back ((2 w + 24) bytes per logit); the embedding's
    lookup and gradient on the first."""
    from workbench.memory.activations import DTYPE_BYTES

    w = DTYPE_BYTES[dtype]
    out = _Work()
    if has_head:
        hg = [(tokens, shape.vocab // tp, shape.hidden)]
        out = _gemm_work(hw, hg, dtype, False) + _gemm_work(hw, hg, dtype, True)
        out += _Work(hw.memory_s(tokens * shape.vocab / tp * (2 * w + 24)), 8)
    if has_embedding:
        out += _Work(hw.memory_s(tokens * shape.hidden * (w + 3 * 4)), 3)
    return out


def step_time(shape, lay, dev, global_batch: int, gpus_per_node: int, params_per_rank: float,
              shard_per_rank: float, attention: str = "flash", hw: Hardware | None = None,
              engine: Engine = WORKBENCH, split: tuple[int, ...] | None = None) -> StepTime:
    """Predicted seconds per optimizer step for a Layout (see workbench.memory.Layout).

    Args:
        shape: ModelShape.
        lay: Layout (degrees, zero, offload, checkpointing, micro_batch, num_micro, dtype).
        dev: catalog Device.
        global_batch: sequences per step.
        gpus_per_node: for deciding which collectives stay on NVLink and how many share a NIC.
        params_per_rank, shard_per_rank: parameters held before / after ZeRO sharding.
        attention: "flash" (our runtime's fused kernel) or "unfused" (published runs before it).
        hw: the Hardware to ask (default: the catalog's figures for `dev`).
        engine: what the engine overlaps (default: our runtime).
        split: blocks per (virtual) stage where a published run's engine split the model its own way
            (`engine_split`); None: the runtime's split (contiguous, min-max parameters: parallel/pp.py).
    Returns:
        StepTime with the parts that make it up.
    Raises:
        ConfigError: a layout `validate` and `run` refuse, with their message (`check_priceable`).
    """
    from workbench.memory.activations import DTYPE_BYTES

    check_priceable(shape, lay, global_batch, split)
    hw = hw or Hardware(dev, gpus_per_node)
    w = DTYPE_BYTES[lay.dtype]
    s, m, tp = shape.seq_len, lay.num_micro, lay.tp
    tokens = lay.micro_batch * s
    model_fpt, _ = flops_per_token(shape)
    blocks, fwd_block, bwd_block, re_dense, head_and_recompute, mem = _compute(hw, shape, lay, tokens, attention, split)
    fwd_all, bwd_all = fwd_block * blocks, bwd_block * blocks
    compute = fwd_all + bwd_all + head_and_recompute
    # Gradient accumulation: every micro-batch after the first adds into the gradients.
    accumulate = _Work(hw.memory_s(params_per_rank * 3 * (4 if lay.fsdp else w)), 1) if m > 1 else _Work()
    act_bytes = tokens * shape.hidden * w
    tp_micro, tp_ops = _tp_comm(hw, shape, lay, act_bytes, blocks, re_dense, (fwd_all + bwd_all).device_s, engine)
    fsdp = _fsdp_comm(hw, shape, lay, params_per_rank / max(1, blocks), w, blocks, fwd_block, bwd_block, engine)
    p2p_micro, tied_s = _pp_comm(hw, shape, lay, act_bytes, w)
    bubble = _bubble(lay.pp_schedule, lay.pp, m, lay.chunks)
    micro, later = (_timed(hw, compute + accumulate, tp_micro + f + p2p_micro, tp_ops) for f in fsdp)
    per_micro = (compute + accumulate).device_s
    steady = micro + (m - 1) * later  # zero 2 may gather in the first micro-batch only (_fsdp_comm)
    pipelined = steady / (1 - bubble)
    exposed_dp, dp_comm = _dp_comm(hw, lay, params_per_rank, w, fwd_all, bwd_all, engine)
    optimizer = _optimizer_time(lay, hw, shard_per_rank, params_per_rank, w, _tensors(shape, tp, lay.pp, lay.chunks))
    # The runtime's own step cost beyond this work, as a calibrated profile measured it (hw.overhead).
    per_step, per_block, per_block_step = hw.overhead(lay, block_numel(shape, tp))
    runtime_s = per_step + blocks * (m * per_block + per_block_step)
    total = pipelined + tied_s + exposed_dp + optimizer + runtime_s
    tokens_per_s = global_batch * s / total
    mfu = None if hw.cpu else tokens_per_s * model_fpt / (lay.world_size * dev.compute_flops[lay.dtype])
    exposed = m * (tp_micro + p2p_micro) + fsdp[0] + (m - 1) * fsdp[1] + tied_s + exposed_dp
    detail = {"flops_per_token": model_fpt, "efficiency": gemm_efficiency(dev, shape.hidden / tp, tokens),
              "gemm_s": m * (fwd_all + bwd_all).device_s, "memory_bound_s": m * mem * blocks,
              "host_s": m * (compute.ops + tp_ops) * hw.launch_s,
              "tp_comm_s": m * tp_micro, "fsdp_exposed_s": fsdp[0] + (m - 1) * fsdp[1], "dp_exposed_s": exposed_dp,
              "dp_comm_s": dp_comm, "p2p_s": m * p2p_micro + tied_s, "bubble_s": pipelined - steady, "runtime_overhead_s": runtime_s,
              "source": hw.source}
    return StepTime(total, tokens_per_s, mfu, m * per_micro, bubble, exposed, optimizer, detail)


def check_priceable(shape, lay, global_batch: int, split: tuple[int, ...] | None = None) -> None:
    """Refuse what `validate` and `run` refuse, with their ConfigError (validate.check_layout_rules: rule,
    numbers, fix), so no layout the runtime would not run gets a price; with an engine's own `split`
    (a published run), a stage may hold no block, and the split must cover the model (`check_split`)."""
    from workbench.validate import check_layout_rules

    check_layout_rules(shape, lay, global_batch, explicit_split=split is not None)
    if split is not None:
        check_split(shape, lay, split)


def _compute(hw: Hardware, shape, lay, tokens: int, attention: str, split: tuple[int, ...] | None = None):
    """The rank's compute per micro-batch: (blocks, one block's forward, its backward, blocks
    recomputed, head + embedding + recomputation work, one block's memory-bound seconds)."""
    blocks, has_head, has_embedding = _rank_work(shape, lay.pp, lay.chunks, split)
    fused = attention == "flash" or hw.cpu
    fwd_block, bwd_block, attn_fwd, mem = _block_work(hw, shape, tokens, lay.tp, lay.sequence_parallel, lay.dtype,
                                                      fused)
    re_dense, re_attn = recomputed_forward(lay.activation_checkpointing, blocks, lay.checkpoint_every)
    recompute = fwd_block * re_dense if lay.activation_checkpointing == "full" else attn_fwd * re_attn
    head = _edge_work(hw, shape, tokens, lay.tp, lay.dtype, has_head, has_embedding)
    return blocks, fwd_block, bwd_block, re_dense, recompute + head, mem


def _timed(hw: Hardware, work: _Work, comm: float, comm_ops: float = 0) -> float:
    """Host dispatch: a GPU runs ahead of the host, a CPU rank's one thread does both."""
    host = (work.ops + comm_ops) * hw.launch_s
    return work.device_s + host + comm if hw.cpu else max(work.device_s + comm, host)


def _tp_comm(hw: Hardware, shape, lay, act_bytes: float, blocks: int, re_dense: float, gemm_s: float,
             engine: Engine) -> tuple[float, float]:
    """(seconds, collective count) of tensor parallelism per micro-batch.

    Per block 2 all-reduces forward, 2 backward, 2 more per recomputed block, of the micro-batch's
    activations. With sequence parallelism our runtime (parallel/sequence_stream.py) all-reduces
    the 2 row-parallel outputs forward (keeping the full rows beside its shard) and, per region
    backward, all-gathers the output gradient together with the saved input shard (twice the
    bytes) and reduce-scatters the input gradient: 6 collectives per block. On gloo (a CPU) where
    `sp_backward_rows` holds, each region's backward is one all-reduce of the input gradient with
    the previous region's two saved shards (3x the bytes), and only the last region all-gathers
    (its gradient, saved input and norm input): 4 per block and 1 per micro-batch. Published runs' SP
    (Megatron) pays all-gather + reduce-scatter per region each way and gathers the saved shard
    again for each column-parallel linear, counted as in our runtime before #35 (wq, wk, wv, w1, +w3).
    """
    tp = lay.tp
    if tp == 1:
        return 0.0, 0
    if lay.sequence_parallel and engine.name == WORKBENCH.name and hw.cpu and lay.sp_backward_rows:
        reduce = hw.collective_s("all_reduce", tp, act_bytes, 1)
        tp_micro = blocks * (2 * reduce + 2 * hw.collective_s("all_reduce", tp, 3 * act_bytes, 1)) + \
            hw.collective_s("all_gather", tp, 3 * act_bytes, 1)
        count: float = 4 * blocks + 1
    elif lay.sequence_parallel and engine.name == WORKBENCH.name:
        reduce = hw.collective_s("all_reduce", tp, act_bytes, 1)
        backward = hw.collective_s("all_gather", tp, 2 * act_bytes, 1) + hw.collective_s("reduce_scatter", tp, act_bytes, 1)
        tp_micro = blocks * (2 * reduce + 2 * backward) + 2 * re_dense * reduce
        count = 6 * blocks + 2 * re_dense
    elif lay.sequence_parallel:
        gather = hw.collective_s("all_gather", tp, act_bytes, 1)
        tp_one = gather + hw.collective_s("reduce_scatter", tp, act_bytes, 1)
        tp_micro = (4 * blocks + 2 * re_dense) * tp_one + blocks * (4 + (shape.family == "llama")) * gather
        count = 2 * (4 * blocks + 2 * re_dense)
    else:
        tp_micro = (4 * blocks + 2 * re_dense) * hw.collective_s("all_reduce", tp, act_bytes, 1)
        count = 4 * blocks + 2 * re_dense
    if engine.tp_comm:  # overlapped with the GEMMs around them (Megatron-Core --tp-comm-overlap)
        tp_micro = max(0.0, tp_micro - hw.overlap * gemm_s)
    return tp_micro, count


def _fsdp_comm(hw: Hardware, shape, lay, block_params: float, w: int, blocks: int, fwd_block: _Work,
               bwd_block: _Work, engine: Engine) -> tuple[float, float]:
    """Exposed seconds of ZeRO-2/3 (FSDP) collectives in a step's first micro-batch and in each later
    one, per FSDP unit (a block, or k consecutive blocks with `Engine.fsdp_units`): each unit's
    parameters are all-gathered in forward (and, zero 3, again in backward; in the first micro-batch
    only where the engine keeps zero 2's gathered weights: `Engine.keep_gathered`) and its gradients
    reduce-scattered; prefetch hides a unit's collectives behind at most one unit's compute. With FSDP1's
    BACKWARD_POST prefetch (`Engine.backward_prefetch == "post"`) the backward all-gather is not
    hidden: only the reduce-scatter overlaps the next block's gradient computation."""
    if lay.grad_sync != "fsdp":
        return 0.0, 0.0
    k, reshard = 1, lay.reshard_after_forward
    if engine.fsdp_units and blocks > 0:  # k blocks per unit: one unit's collectives, behind k blocks' compute
        k = min(blocks, unit_blocks(block_numel(shape, lay.tp), lay.fsdp_unit_mb))
        stage_params = block_params * blocks / lay.chunks  # the runtime's test, per stage module (parallel/zero.py)
        if whole_unit(stage_params, lay.fsdp_unit_mb):  # one unit per stage, kept to backward's end
            k, reshard = blocks, False
    one = partial(_fsdp_micro_comm, hw, shape, lay, block_params * k, w, -(-blocks // k), fwd_block * k,
                  bwd_block * k, engine, reshard)
    first = one(gathered=False)
    return first, one(gathered=True) if engine.keep_gathered and lay.keeps_gathered else first


def _fsdp_micro_comm(hw: Hardware, shape, lay, block_params: float, w: int, blocks: int, fwd_block: _Work,
                     bwd_block: _Work, engine: Engine, reshard: bool, gathered: bool) -> float:
    """`_fsdp_comm` of one micro-batch, whose weights are already `gathered` or not (`blocks`,
    `block_params` and the work: the units')."""
    k = _block_tensor_count(shape) if engine.per_tensor else 1
    gather = 0.0 if gathered else k * hw.collective_s("all_gather", lay.dp, block_params * w / k, lay.tp)
    scatter = k * hw.collective_s("reduce_scatter", lay.dp, block_params * engine.grad_reduce_bytes / k, lay.tp)
    regather = gather if reshard else 0.0
    hide_f = hw.overlap * fwd_block.device_s if engine.prefetch else 0.0
    hide_b = hw.overlap * bwd_block.device_s if engine.prefetch and engine.grad_reduce else 0.0
    if engine.backward_prefetch == "post":  # the next block's gather is issued after this block's gradients
        per_block = max(0.0, gather - hide_f) + regather + max(0.0, scatter - hide_b)
    else:
        per_block = max(0.0, gather - hide_f) + max(0.0, scatter + regather - hide_b)
    return blocks * per_block + gather  # the first block's gather has nothing to hide behind


def _pp_comm(hw: Hardware, shape, lay, act_bytes: float, w: int) -> tuple[float, float]:
    """(seconds per micro-batch, seconds per step) of the pipeline's sends: one activation send per
    stage boundary per micro-batch and direction (virtual stages add boundaries), not overlapped;
    and the tied embedding's gradient, summed by the first and last stage (parallel/tied.py)."""
    p, tp = lay.pp, lay.tp
    if p == 1:
        return 0.0, 0.0
    pp_stride = lay.dp * tp
    p2p_micro = 2 * lay.chunks * hw.collective_s("p2p", p, act_bytes / tp if lay.sequence_parallel else act_bytes,
                                                 pp_stride)
    tied_s = 0.0
    if shape.tie_embeddings:
        tied_s = hw.collective_s("all_reduce", 2, shape.vocab * shape.hidden / tp * w, pp_stride * (p - 1))
    return p2p_micro, tied_s


def _dp_comm(hw: Hardware, lay, params_per_rank: float, w: int, fwd_all: _Work, bwd_all: _Work,
             engine: Engine) -> tuple[float, float]:
    """(exposed seconds, total collective seconds) of data parallel with ZeRO 0/1: one all-reduce of
    the gradients after the last micro-batch (fp32 buckets with tp or pp, parallel/grad_sync.py);
    DDP hides its buckets behind that micro-batch's backward, the last bucket never. ZeRO-1 then
    all-gathers the updated weights."""
    if lay.grad_sync not in ("ddp", "all-reduce"):
        return 0.0, 0.0
    dp_stride = lay.tp
    grad_bytes = params_per_rank * (4 if lay.grad_sync == "all-reduce" else w)
    reduce = "reduce_scatter" if engine.distributed_optimizer and lay.zero == 1 else "all_reduce"
    dp_comm = hw.collective_s(reduce, lay.dp, grad_bytes, dp_stride)
    last_bucket = hw.collective_s(reduce, lay.dp, min(grad_bytes, lay.bucket_mb * 2**20), dp_stride)
    hidden = hw.overlap * bwd_all.device_s if engine.grad_reduce else 0.0
    exposed_dp = max(0.0, dp_comm - hidden) + last_bucket
    if lay.zero == 1 and lay.dp > 1:
        gather = hw.collective_s("all_gather", lay.dp, params_per_rank * w, dp_stride)
        exposed_dp += max(0.0, gather - hw.overlap * fwd_all.device_s) if engine.param_gather else gather
    return exposed_dp, dp_comm


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


def _optimizer_time(lay, hw: Hardware, shard: float, params: float, w: int, n_tensors: int) -> float:
    """The optimizer step: memory-bound on the device (read and write weights, gradients, master
    and two moments: 36 bytes per updated parameter), with a kernel per op and tensor on CPU;
    PCIe + host Adam with offload=cpu, and a read + write of master weights and moments with nvme."""
    updated = shard if lay.shards_optimizer_state else params
    device_step = hw.memory_s(updated * 36)
    if hw.cpu:
        device_step += n_tensors * OPTIMIZER_OPS_PER_TENSOR * hw.launch_s
    if lay.offload == "none":
        return device_step
    transfer = updated * (4 + w) / PCIE_BW  # gradients down, updated weights up
    host = updated / CPU_ADAM_PARAMS_PER_S
    if lay.offload == "nvme":
        host += nvme_transfer_s(lay, updated, hw.dev)  # master (zero 3: the parameters) + moments
    return transfer + host
