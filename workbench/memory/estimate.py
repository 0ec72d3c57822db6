"""Per-rank memory of a layout: model states + activations in flight + transient buffers.

`Layout` is the plain description the planner enumerates (no pydantic on the hot path);
`estimate_stage` prices one pipeline stage (every dp/tp rank of a stage holds the same bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from workbench.memory import activations as act
from workbench.memory import params as prm
from workbench.memory.states import States, model_states, offload
from workbench.parallelism import Parallelism
from workbench.timeline import max_in_flight

# What a CUDA device holds beyond the tensors (the convention: `total` is the allocated peak,
# torch.cuda.max_memory_allocated; `device_used` adds the rest, what nvidia-smi shows):
# the CUDA context with lazy module loading and the cuBLAS workspace (~0.5 GiB on H100 under
# CUDA 12, as nvidia-smi shows before the first tensor), NCCL's buffers per communicator
# (NCCL_BUFFSIZE 4 MiB per channel and peer, up to 32 channels on NVSwitch systems: 256 MiB),
# and the caching allocator's reserve over what is allocated at the peak (fragmentation; the
# reserved/allocated ratio PyTorch's memory snapshots show in training is 1.05-1.2).
CUDA_CONTEXT_BYTES = 512 * 2**20
# cuBLAS's workspace, which PyTorch takes from its caching allocator (so it is in the allocated
# peak) once per cuBLAS handle and stream: 4096 KiB x 8 = 32 MiB on Hopper (sm90), 8.125 MiB on
# earlier GPUs (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize; cuBLASLt shares
# it). A training step uses two handles: forward on the caller's thread, backward on autograd's
# device thread. Measured on an H200 (torch 2.11, CUDA 13): a gpt-tiny step's allocated peak is
# 67-68 MiB above its tensors (bench/results/gpu.json, docs/planning.md). Priced at Hopper's size.
CUBLAS_WORKSPACE_BYTES = 2 * 32 * 2**20
NCCL_BYTES_PER_GROUP = 256 * 2**20
ALLOCATOR_RESERVE = 0.1

CONVENTION = ("bytes/param: ZeRO paper 2+2+12 in mixed precision (fp16/bf16 weights 2, grads 2, fp32 master 4 "
              "+ Adam moments 8; SGD momentum 4), fp32: 4+4+8 with no master copy")


@dataclass(frozen=True)
class Layout(Parallelism):
    """A Parallelism (with its batch split) plus what the memory and step-time models also need:
    the optimizer and the device kind. The plain object the planner enumerates."""

    optimizer: str = "adamw"
    device: str = "cpu"  # "cpu" or "cuda": which kernels' saved tensors to count (norms differ)


@dataclass(frozen=True)
class StageMemory:
    params: int
    grads: int
    master: int
    optimizer: int
    activations: int
    buffers: int
    offloaded: int  # host + disk: every byte held off the device
    notes: tuple[str, ...]
    host: int = 0  # host-memory bytes per rank kept between steps (offload=cpu: the states; nvme at zero 2/3: gradients + staging)
    disk: int = 0  # bytes per rank in files under layout.nvme_path (offload=nvme)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optimizer + self.activations + self.buffers


@lru_cache(maxsize=65536)
def _stage_params(shape, tp: int, pp: int, pp_index: int, chunks: int, dp: int) -> tuple[int, int]:
    """(parameters on the rank, its FSDP shard over dp): cached, the planner asks often."""
    total, shard, _ = prm.rank_counts(shape, tp, pp, pp_index, chunks, dp)
    return total, shard


@lru_cache(maxsize=65536)
def _tensor_count(shape, tp: int, pp: int, pp_index: int, chunks: int) -> int:
    return prm.rank_counts(shape, tp, pp, pp_index, chunks)[2]


@lru_cache(maxsize=65536)
def _chunk_activation_bytes(shape, lay: Layout, stage: int, num_stages: int, blocks: range) -> float:
    """Bytes one micro-batch leaves in one (virtual) stage until its backward."""
    tokens = lay.micro_batch * shape.seq_len
    full = act.block_bytes_per_token(shape, lay.dtype, lay.tp, lay.sequence_parallel, lay.device)
    edge = act.boundary_bytes_per_token(shape, lay.dtype, lay.tp, lay.sequence_parallel)
    n_ckpt = act.checkpointed_blocks(blocks, lay.activation_checkpointing, lay.checkpoint_every)
    if lay.activation_checkpointing == "selective":
        full -= act.attention_core_bytes_per_token(shape, lay.tp)
    per_token = n_ckpt * edge + (len(blocks) - n_ckpt) * full
    if stage == num_stages - 1:
        per_token += act.head_bytes_per_token(shape, lay.dtype, lay.tp, lay.sequence_parallel, lay.device)
    out = per_token * tokens
    if stage == 0 and shape.family == "gpt":
        out += shape.seq_len * 8  # the positions' int64 arange, made per forward
    if stage == num_stages - 1:
        out += 4  # cross-entropy's fp32 total weight
    return out


def _activations(shape, lay: Layout, pp_index: int) -> float:
    return _activations_cached(shape, lay.tp, lay.pp, lay.chunks, lay.sequence_parallel, lay.micro_batch,
                               lay.num_micro, lay.pp_schedule, lay.activation_checkpointing,
                               lay.checkpoint_every, lay.dtype, pp_index, lay.global_batch, lay.device)


@lru_cache(maxsize=65536)
def _activations_cached(shape, tp, pp, chunks, sp, micro_batch, num_micro, schedule, ckpt, every, dtype,
                        pp_index, global_batch, device) -> float:
    # Only the knobs that change activations are in the key (not zero, offload or dp).
    lay = Layout(tp=tp, pp=pp, virtual_stages=chunks, pp_schedule=schedule, sequence_parallel=sp,
                 micro_batch=micro_batch, num_micro=num_micro, activation_checkpointing=ckpt,
                 checkpoint_every=every, dtype=dtype, device=device)
    num_stages = lay.pp * lay.chunks
    split = prm.stage_blocks(shape, num_stages)
    stages = lay.stage_indices(pp_index)
    per_chunk = [_chunk_activation_bytes(shape, lay, s, num_stages, split[s]) for s in stages]
    if lay.pp > 1:
        held = max_in_flight(lay.pp_schedule, lay.pp, lay.num_micro, pp_index, lay.chunks)
    else:
        held = (1,)  # gradient accumulation: one micro-batch at a time
    total = sum(n * b for n, b in zip(held, per_chunk))
    if pp_index == 0:
        batch = global_batch if pp == 1 else micro_batch * num_micro
        total += act.token_batch_bytes(batch, shape.seq_len)
    if shape.family == "llama" and not (lay.activation_checkpointing == "full" and lay.checkpoint_every == 1):
        # Rotary cos/sin tables, cached by the model (checkpointed blocks do not save them).
        total += shape.seq_len * shape.head_dim * 4
    return total


def device_used(total: float, lay: Layout) -> float:
    """Device bytes a rank whose allocated peak is `total` uses (CUDA: + the allocator's reserve,
    the context and NCCL's buffers per process group it talks in; CPU: `total`)."""
    if lay.device != "cuda":
        return total
    groups = sum(1 for n in (lay.dp, lay.tp, lay.pp) if n > 1) + (lay.world_size > 1)
    return total * (1 + ALLOCATOR_RESERVE) + CUDA_CONTEXT_BYTES + groups * NCCL_BYTES_PER_GROUP


def _chunk_numel(range_numel: float, lay: Layout) -> int:
    """Elements per chunk of the master-weight step and the nvme staging (docs/strategies.md); on
    a GPU with the states in memory, the whole range up to 64 Mi elements of all-gather staging
    over the ranks (parallel/master.py, memory_chunk_size)."""
    if lay.device == "cuda" and lay.offload == "none":
        cap = max(4 * 2**20, 64 * 2**20 // lay.dp) if lay.master_sharded else 64 * 2**20
        return min(cap, max(4096, int(range_numel)))
    return min(4 * 2**20, max(4096, -(-int(range_numel) // 8)))


def _held_buffers(shape, lay: Layout, pp_index: int, w: int) -> float:
    """Transient bytes held whatever the checkpointing mode: cuBLAS's workspaces (CUDA), the logits
    and the pipeline's in-flight stage outputs. A stage's buffers are these, then
    `_recomputed_buffers`, then `_state_buffers`."""
    tokens = lay.micro_batch * shape.seq_len
    out = float(CUBLAS_WORKSPACE_BYTES) if lay.device == "cuda" else 0.0
    if pp_index == lay.pp - 1:
        # The head's logits of one micro-batch and, when they are not fp32, the loss's fp32 copy;
        # sharded over the vocabulary with tp (the loss runs under loss_parallel).
        out += tokens * shape.vocab / lay.tp * (w + (4 if w != 4 else 0))
    if lay.pp > 1 and pp_index < lay.pp - 1:
        # The schedule keeps each in-flight micro-batch's stage output until its backward (not
        # a tensor autograd saves, so not counted as activations by the runtime's meter).
        held = sum(max_in_flight(lay.pp_schedule, lay.pp, lay.num_micro, pp_index, lay.chunks))
        out += held * tokens * act.boundary_bytes_per_token(shape, lay.dtype, lay.tp, lay.sequence_parallel)
    return out


def _recomputed_buffers(shape, lay: Layout) -> tuple[float, list[str]]:
    """What backward's recomputation brings back briefly: the only buffers the checkpointing mode sets."""
    tokens = lay.micro_batch * shape.seq_len
    if lay.activation_checkpointing == "selective":
        # Backward re-runs one attention core at a time: its output and log-sum-exp come back briefly.
        c = act.DTYPE_BYTES[lay.dtype]
        return (tokens * (shape.hidden * c / lay.tp + act.attention_core_bytes_per_token(shape, lay.tp)),
                ["selective checkpointing: one recomputed attention core's output during backward (buffers)"])
    if lay.activation_checkpointing != "none":
        # Backward re-runs one checkpointed block at a time: its activations come back briefly.
        return (tokens * act.block_bytes_per_token(shape, lay.dtype, lay.tp, lay.sequence_parallel, lay.device),
                ["checkpointing: one recomputed block's activations during backward (buffers)"])
    return 0.0, []


def _state_buffers(shape, lay: Layout, p: int, w: int, pp_index: int) -> tuple[list[float], list[str]]:
    """Transient bytes of the sharded states, added after the recomputed ones (in this order, so the
    sum is the same float whichever way it is assembled): master-step and staging chunks, ZeRO gathers."""
    terms: list[float] = []
    notes: list[str] = []
    rng = -(-p // lay.dp) if lay.master_sharded else p
    chunk = _chunk_numel(rng, lay)
    if lay.needs_master and (lay.mixed or lay.shards_optimizer_state):
        terms.append(chunk * 4)  # the master step converts one chunk of gradients to fp32
    if lay.master_sharded:
        terms.append(lay.dp * chunk * w)  # all-gather of one chunk per rank
    if lay.offload == "nvme" and not lay.fsdp:
        terms.append(3 * chunk * 4)  # staging: master, moment 1, moment 2 of one chunk
    if not lay.fsdp:
        return terms, notes
    if prm.whole_unit(p / lay.chunks, lay.fsdp_unit_mb):  # per stage module (interleaved: the rank's mean)
        terms.append(p * w + 4 * p)
        notes.append(f"zero={lay.zero}: the stage is one FSDP2 unit (within bucket_mb): its unsharded weights from "
                     "forward to the end of backward and its fp32 unsharded gradient")
        return terms, notes
    unit = prm.largest_unit_numel(shape, lay.tp, lay.fsdp_unit_mb, _stage_block_count(shape, lay, pp_index))
    if not lay.reshard_after_forward:
        terms.append(p * w + 4 * unit)
        notes.append("zero=2 (FSDP2, no reshard after forward): the unsharded weights from forward to the end "
                     "of backward, and one FSDP2 unit's fp32 unsharded gradient")
    else:
        terms.append(2 * unit * w + 4 * unit)
        notes.append("zero=3: two gathered FSDP2 units (running + prefetched) and one unit's fp32 unsharded gradient")
    return terms, notes


def _stage_block_count(shape, lay: Layout, pp_index: int) -> int:
    """Blocks of the largest stage module pipeline rank `pp_index` holds (each is sharded apart)."""
    stages = prm.stage_blocks(shape, lay.num_stages)
    return max(len(stages[i]) for i in lay.stage_indices(pp_index))


def _runtime_details(shape, lay: Layout, pp_index: int, states, notes: list[str]):
    """Small bytes the runtime really keeps, found by measuring it (docs/memory-accuracy.md)."""
    if lay.optimizer in ("adam", "adamw") and not lay.needs_master:
        # torch.optim.Adam keeps a 4-byte `step` tensor per parameter tensor; our master-weight
        # optimizer (mixed precision, zero=1, nvme) counts steps in Python.
        n_tensors = _tensor_count(shape, lay.tp, lay.pp, pp_index, lay.chunks)
        states = replace(states, optimizer=states.optimizer + 4 * n_tensors)
    if lay.dtype == "fp16":
        notes.append("fp16: the loss scale is a host float and the overflow check all-reduces one scalar "
                     "(no device bytes kept)")
    return states


def estimate_stage(shape, lay: Layout, pp_index: int, convention: str = "workbench") -> StageMemory:
    """Memory of any rank on pipeline stage `pp_index`. A number as `shape` is a size-only model.
    Two parts: what no checkpointing mode changes (`stage_fixed`) and what the mode sets (`stage_mode`)."""
    fixed = stage_fixed(shape, lay, pp_index, convention)
    a, recomputed, notes = stage_mode(shape, lay, pp_index)
    s = fixed.states
    return StageMemory(int(s.params), int(s.grads), int(s.master), int(s.optimizer), int(a),
                       int(fixed.buffers(recomputed)), int(fixed.host + fixed.disk), (s.note, *notes, *fixed.notes),
                       int(fixed.host), int(fixed.disk))


@dataclass(frozen=True)
class StageFixed:
    """What a stage holds whatever its activation checkpointing: the model states after offload, their
    host and disk bytes, and the buffers the mode does not set (held, then the states' terms)."""

    states: States
    host: float
    disk: float
    held: float
    terms: tuple[float, ...]
    notes: tuple[str, ...]

    def buffers(self, recomputed: float) -> float:
        """The stage's buffers with a mode's `recomputed` bytes (held + recomputed, then each term:
        the same float whichever way the stage is priced)."""
        out = self.held + recomputed
        for t in self.terms:
            out += t
        return out

    def peak(self, activations: float, recomputed: float) -> int:
        """StageMemory.total of the stage with a mode's activations and recomputed bytes."""
        s = self.states
        return (int(s.params) + int(s.grads) + int(s.master) + int(s.optimizer) + int(activations)
                + int(self.buffers(recomputed)))


def stage_fixed(shape, lay: Layout, pp_index: int, convention: str = "workbench") -> StageFixed:
    """The part of `estimate_stage` no checkpointing mode changes (the planner prices it once per group)."""
    w = act.DTYPE_BYTES[lay.dtype]
    if isinstance(shape, (int, float)):  # {params: N}: model states only, spread evenly
        p = float(shape) / (lay.tp * lay.pp)
        shard = p / lay.dp
        held = 0.0
        terms: list[float] = []
        notes: list[str] = []
    else:
        p, shard = _stage_params(shape, lay.tp, lay.pp, pp_index, lay.chunks, lay.dp)
        held = _held_buffers(shape, lay, pp_index, w)
        terms, notes = _state_buffers(shape, lay, p, w, pp_index)
    states = model_states(p, shard, lay, lay.optimizer, convention)
    if not isinstance(shape, (int, float)):
        states = _runtime_details(shape, lay, pp_index, states, notes)
    rng = -(-p // lay.dp) if lay.shards_optimizer_state else p
    states, host, disk = offload(states, lay, rng, lay.optimizer)
    return StageFixed(states, host, disk, held, tuple(terms), tuple(notes))


def stage_mode(shape, mode: Layout, pp_index: int) -> tuple[float, float, list[str]]:
    """The part of `estimate_stage` a checkpointing mode sets: (activations, recomputed buffers, notes).
    It reads neither zero, offload nor dp (the planner prices it once for every such group)."""
    if isinstance(shape, (int, float)):
        return 0.0, 0.0, ["model given by its size (or a factory): model states only, no activations or buffers"]
    recomputed, notes = _recomputed_buffers(shape, mode)
    return _activations(shape, mode, pp_index), recomputed, notes
