"""What a layout implies, derived once: `Parallelism.from_spec(spec)`.

The runtime (parallel/apply.py, runtime/loop.py), the memory model, the step-time model, the
planner and validate all read these facts from here, so the prediction and the run agree by
construction (torchtitan's ParallelDims, accelerate's ParallelismConfig). Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

PipelineSchedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"]
PIPELINE_SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)
# Schedules that run `virtual_stages` looped stages per pipeline rank (torch's
# Interleaved1F1B and InterleavedZeroBubble).
MULTI_STAGE_SCHEDULES = ("interleaved-1f1b", "zero-bubble")
# The mesh's axes, outermost first: a rank's number is (pp_index * dp + dp_index) * tp + tp_index.
# tp varies fastest, so a tp group is consecutive ranks (one node, one Ray placement bundle).
MESH_AXES = ("pp", "dp", "tp")


def is_multi_stage(schedule: str) -> bool:
    """True for the schedules that hold several (virtual) stages per pipeline rank."""
    return schedule in MULTI_STAGE_SCHEDULES


def looped_stages(pp_rank: int, pp: int, chunks: int) -> list[int]:
    """The global stage indices pipeline rank `pp_rank` holds: looped placement (r, r + pp, ...),
    the layout torch's Interleaved1F1B and InterleavedZeroBubble expect."""
    return [pp_rank + i * pp for i in range(chunks)]


def num_micro_batches(global_batch: int, dp: int, micro_batch: int) -> int:
    """Micro-batches per dp rank per step: global_batch // (dp x micro_batch), at least 1 (a split
    validate refuses, e.g. under `plan`'s layout-free load, still counts one)."""
    return max(1, global_batch // (dp * micro_batch))


@dataclass(frozen=True)
class Parallelism:
    """The knobs of a layout and precision, and every fact they imply (as properties).

    Build it with `from_spec`: one per rank, which the training loop runs on; the memory model's
    `Layout` extends it with the optimizer and the device kind. Facts hold for layouts `validate`
    accepts (e.g. zero>0 needs dp>=2).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    offload: str = "none"  # none | cpu (FSDP2 CPUOffloadPolicy) | nvme (master + moments in files)
    activation_checkpointing: str = "none"  # none | full | selective
    checkpoint_every: int = 1  # activation checkpointing (full): every k-th block recomputed; no checkpoint save
    pp_schedule: str = "1f1b"
    virtual_stages: int = 2
    sequence_parallel: bool = False
    dtype: str = "fp32"  # precision.dtype: the compute dtype
    bucket_mb: float = 25.0
    nvme_path: str = "/tmp/workbench-offload"
    micro_batch: int = 1  # train.micro_batch: sequences per forward/backward
    num_micro: int = 1  # micro-batches per dp rank per step (gradient accumulation; the pipeline's count)

    @classmethod
    def from_spec(cls, spec) -> Parallelism:
        """The parallelism of a JobSpec's layout, precision and batch split."""
        lay, t = spec.layout, spec.train
        return cls(dp=lay.dp, tp=lay.tp, pp=lay.pp, zero=lay.zero, offload=lay.offload,
                   activation_checkpointing=lay.activation_checkpointing, checkpoint_every=lay.checkpoint_every,
                   pp_schedule=lay.pp_schedule, virtual_stages=lay.virtual_stages,
                   sequence_parallel=lay.sequence_parallel, dtype=spec.precision.dtype, bucket_mb=lay.bucket_mb,
                   nvme_path=lay.nvme_path, micro_batch=t.micro_batch,
                   num_micro=num_micro_batches(t.global_batch, lay.dp, t.micro_batch))

    # Degrees, ranks and stages.
    @property
    def world_size(self) -> int:
        """Ranks the layout runs on, dp x tp x pp: the one definition (LayoutSpec.world_size and
        JobSpec.world_size read it; a RankContext's is the process group's, equal once the mesh is built)."""
        return self.dp * self.tp * self.pp

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The degrees in MESH_AXES order: the DeviceMesh's shape (parallel/mesh.py)."""
        return tuple(getattr(self, axis) for axis in MESH_AXES)

    def stride(self, axis: str) -> int:
        """Ranks between neighbours along mesh `axis` (tp 1, dp tp, pp dp x tp)."""
        shape = self.mesh_shape
        out = 1
        for size in shape[MESH_AXES.index(axis) + 1:]:
            out *= size
        return out

    def rank_of(self, **coords: int) -> int:
        """The global rank at mesh coordinates, e.g. rank_of(pp=1, dp=0, tp=1); axes left out are 0."""
        return sum(coords.get(axis, 0) * self.stride(axis) for axis in MESH_AXES)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: dp x micro_batch x num_micro."""
        return self.dp * self.micro_batch * self.num_micro

    @property
    def multi_stage(self) -> bool:
        """Each pipeline rank holds `virtual_stages` stages (interleaved-1f1b, zero-bubble)."""
        return self.pp > 1 and is_multi_stage(self.pp_schedule)

    @property
    def chunks(self) -> int:
        """Stage modules per pipeline rank."""
        return self.virtual_stages if self.multi_stage else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks

    def stage_indices(self, pp_rank: int) -> list[int]:
        """The global indices of the stages pipeline rank `pp_rank` holds."""
        return looped_stages(pp_rank, self.pp, self.chunks)

    # Data parallel: who shards what, and who reduces the gradients.
    @property
    def fsdp(self) -> bool:
        """FSDP2 `fully_shard` over the dp axis (zero 2 and 3)."""
        return self.zero >= 2

    @property
    def sp_backward_rows(self) -> bool:
        """Sequence parallel carries full rows through backward too, on gloo (parallel/sequence_parallel.py
        BackwardRows: 4 collectives per block and micro-batch, as plain TP, not 6): each region's calls
        reach their backward whole, so not across a pipeline's stages, a recompute, or FSDP's
        resharded norms."""
        return (self.tp > 1 and self.sequence_parallel and self.pp == 1 and self.activation_checkpointing == "none"
                and not self.fsdp)

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2 frees each block's gathered weights after its forward (zero 3), or keeps them
        until backward is done (zero 2)."""
        return self.zero == 3

    @property
    def keeps_gathered(self) -> bool:
        """zero 2 with pp = 1 keeps the gathered weights from one micro-batch's backward to the next
        one's forward (they cannot change before the step): only a step's first micro-batch gathers
        them (parallel/apply.py `_keep_gathered`). Not under torch's pipeline schedules, which drive
        FSDP2 themselves, nor with offload=nvme, whose hooks move the shards."""
        return self.fsdp and not self.reshard_after_forward and self.pp == 1 and self.offload != "nvme"

    @property
    def fsdp_unit_mb(self) -> float | None:
        """zero 2/3: consecutive blocks share one FSDP2 unit (one all-gather, one reduce-scatter)
        up to `bucket_mb` MiB of fp32 gradient, as DDP's buckets and DeepSpeed's bucket sizes group
        small tensors; a larger block is a unit alone. None (one block per unit) with offload=nvme,
        whose file prefetch runs block by block."""
        return self.bucket_mb if self.fsdp and self.offload != "nvme" else None

    @property
    def shards_optimizer_state(self) -> bool:
        """Optimizer state split over dp (zero >= 1)."""
        return self.zero >= 1

    @property
    def grad_sync(self) -> str:
        """How dp gradients are averaged: none (dp=1), fsdp (its reduce-scatter), ddp (the
        wrapper, dp only) or all-reduce (ours after the last backward, with tp or pp)."""
        if self.dp == 1:
            return "none"
        if self.fsdp:
            return "fsdp"
        return "ddp" if self.tp == 1 and self.pp == 1 else "all-reduce"

    # Precision: where the fp32 master lives.
    @property
    def mixed(self) -> bool:
        """Low-precision compute (bf16/fp16) with fp32 master weights."""
        return self.dtype != "fp32"

    @property
    def params_are_master(self) -> bool:
        """FSDP2 with a MixedPrecisionPolicy: the sharded fp32 parameters are the master."""
        return self.fsdp and self.mixed

    @property
    def needs_master(self) -> bool:
        """Our MasterOptimizer keeps an fp32 master apart from the parameters: mixed precision,
        zero=1 (the sharded range it steps) or offload=nvme (master and moments in files), unless
        FSDP2 owns the parameters (zero 2/3). Otherwise a torch optimizer steps the parameters."""
        return not self.fsdp and (self.mixed or self.zero == 1 or self.offload == "nvme")

    @property
    def master_sharded(self) -> bool:
        """The master (ours) holds a flat 1/dp range per rank (zero=1)."""
        return self.needs_master and self.zero == 1 and self.dp > 1

    @property
    def param_dtype(self) -> str:
        """dtype of the parameters the model keeps: fp32 under FSDP2 (it casts per block) or
        without mixed precision, else the low dtype (the master is apart)."""
        return "fp32" if self.fsdp or not self.mixed else self.dtype

    @property
    def compute_dtype(self) -> str:
        return self.dtype

    # Where things live.
    @property
    def offload_to(self) -> str | None:
        """None, "host memory" (cpu: every model state) or "files" (nvme: the fp32 master and the moments;
        at zero 2/3 FSDP2's fp32 shards, which are the parameters or their master: parallel/offload.py)."""
        return {"none": None, "cpu": "host memory", "nvme": "files"}[self.offload]

    @property
    def init_on_host(self) -> bool:
        """Parameters are materialized in host memory (FSDP2's CPUOffloadPolicy wants them there)."""
        return self.fsdp and self.offload == "cpu"

    @property
    def loss_parallel(self) -> bool:
        """The head's logits are vocab-sharded (tp > 1): the loss runs under loss_parallel."""
        return self.tp > 1

    @property
    def checkpointing(self) -> bool:
        return self.activation_checkpointing != "none"

    def facts(self) -> dict:
        """Every derived fact (each property above) by name: for notes, tests and the notebook."""
        return {name: getattr(self, name) for name, v in vars(Parallelism).items() if isinstance(v, property)}
