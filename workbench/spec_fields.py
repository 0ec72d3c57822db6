"""The fields of a job spec: its pydantic sections, each field with its bound and description.

Below `validate` (which reads these types) and `spec` (which loads, overrides and validates a
spec, and re-exports every class here): nothing in this module validates across fields.
"""
from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from workbench.parallelism import Parallelism, PipelineSchedule
from workbench.schedule import LrSchedule
from workbench.spec_input import (
    MAX_BATCH,
    MAX_FFN,
    MAX_LAYERS,
    MAX_PARAMS,
    MAX_PP,
    MAX_RANKS,
    MAX_SEED,
    MAX_SEQ,
    MAX_STEPS,
    MAX_VOCAB,
    MAX_WIDTH,
)

if TYPE_CHECKING:
    from workbench.shapes import ModelShape


class _Section(BaseModel):
    """Base of every spec section: unknown keys are errors, values are re-validated on set."""

    # Infinity and NaN are never a setting (an lr of .inf validates, then every step is NaN).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value, info: ValidationInfo):
        """true/false is not a count or a rate (pydantic would read true as 1, `yes` as 1 nodes)."""
        if isinstance(value, bool) and info.field_name and _numeric_only(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, got {str(value).lower()} (a boolean)")
        return value

    def _repr_html_(self) -> str:
        return _html_table(self.model_dump(exclude_defaults=False))


def _numeric_only(annotation) -> bool:
    """The annotation takes ints or floats (or None) and nothing else."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (annotation,)
    return any(a in (int, float) for a in args) and all(a in (int, float, type(None)) for a in args)


class RopeScalingSpec(_Section):
    """Llama 3.1-style rotary frequency scaling (transformers' rope_type "llama3")."""

    factor: float = Field(8.0, gt=0, le=1024, description="Long wavelengths are divided by this (Llama 3.1: 8, 3.2: 32).")
    low_freq_factor: float = Field(1.0, gt=0, le=1024, description="Wavelengths above original_max_position_embeddings / this are scaled fully.")
    high_freq_factor: float = Field(4.0, gt=0, le=1024, description="Wavelengths below original_max_position_embeddings / this are kept.")
    original_max_position_embeddings: int = Field(8192, gt=0, le=MAX_SEQ, description="The context the unscaled model was trained for.")


class ModelSpec(_Section):
    """What to train: a preset, an explicit shape, a bare size (planning only) or a factory.

    Fields given next to a preset override the preset's values, e.g.
    ``{preset: gpt-tiny, layers: 8}``.
    """

    preset: str | None = Field(None, description="Named model shape, e.g. gpt-tiny, gpt2-124m, llama-7b.")
    family: Literal["gpt", "llama"] | None = Field(
        None, description="gpt: LayerNorm, GELU 4h MLP, learned positions, tied head. "
        "llama: RMSNorm, SwiGLU MLP, rotary positions, untied head, no biases.")
    layers: int | None = Field(None, gt=0, le=MAX_LAYERS, description="Number of transformer blocks.")
    hidden: int | None = Field(None, gt=0, le=MAX_WIDTH, description="Model width (d_model).")
    heads: int | None = Field(None, gt=0, le=MAX_WIDTH, description="Attention heads.")
    kv_heads: int | None = Field(None, gt=0, le=MAX_WIDTH, description="Key/value heads (grouped-query attention); default = heads.")
    ffn_hidden: int | None = Field(None, gt=0, le=MAX_FFN, description="MLP inner width; default 4*hidden (gpt).")
    vocab: int | None = Field(None, gt=0, le=MAX_VOCAB, description="Vocabulary size.")
    seq_len: int | None = Field(None, gt=0, le=MAX_SEQ, description="Sequence length (tokens per sample).")
    tie_embeddings: bool | None = Field(None, description="Share the embedding and output head weights.")
    rope_theta: float | None = Field(None, gt=1, le=1e12, description="llama: rotary base (default 10000; Llama 3: 500000).")
    rope_scaling: RopeScalingSpec | None = Field(None, description="llama: Llama 3.1-style rotary frequency scaling.")
    norm_eps: float | None = Field(None, gt=0, lt=1, description="Epsilon of the LayerNorms (gpt) / RMSNorms (llama); default 1e-5.")
    qkv_bias: bool | None = Field(None, description="Bias on the q, k, v projections (gpt: always; Qwen2: true; llama default false).")
    out_bias: bool | None = Field(None, description="Bias on the attention output projection (gpt: always; llama default false).")
    mlp_bias: bool | None = Field(None, description="Bias on the MLP's linears (gpt: always; llama default false).")
    pad_vocab_to: int | None = Field(None, gt=0, le=1 << 16, description="Round the embedding and head rows up to a multiple of this (e.g. 64, or a multiple of tp); the padded logits are masked out of the softmax, so the loss is unchanged.")
    max_positions: int | None = Field(None, gt=0, le=MAX_SEQ, description="gpt: learned position rows (default seq_len); llama: the context the model was made for (recorded on export).")
    sliding_window: int | None = Field(None, gt=0, le=MAX_SEQ, description="llama: the model's attention window (Mistral v0.1: 4096); seq_len may not exceed it (the attention here is full causal).")
    init: Literal["random", "hf", "checkpoint"] = Field("random", description="Initial weights: random (seeded by train.seed); hf: a local transformers folder (model.path: config.json + safetensors, the shape comes from config.json); checkpoint: a workbench checkpoint or a state_dict file (.safetensors, or .pt read as data) of this model.")
    path: str | None = Field(None, max_length=4096, description="init=hf: the transformers folder; init=checkpoint: a checkpoint.uri, step directory or state_dict file.")
    params: float | None = Field(None, gt=0, le=MAX_PARAMS, description="A size alone (e.g. 7.5e9): planning of model states only, nothing to run. Beside a factory: the size planning uses without running it.")
    factory: str | None = Field(None, description="'pkg.module:function' returning an nn.Module (forward(tokens) -> logits).")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed to the factory.")
    trust_factory: bool = Field(False, description="Let planning (validate, memory, plan, the notebook) import and call model.factory to count its parameters; a factory is code (workbench/factory.py). Without it, planning uses model.params. The caller's opt-in: --trust-factory, --set, or a spec built in Python; ignored in a spec file.")

    def shape(self) -> ModelShape:
        """The resolved architecture (preset + overrides). Raises ConfigError if incomplete."""
        from workbench.shapes import resolve_shape

        return resolve_shape(self)


class DataSpec(_Section):
    """Where the tokens come from. Batches depend only on seed, step and global_batch."""

    source: Literal["synthetic", "text", "tokens"] = Field("synthetic", description="synthetic: a seeded, learnable token stream; text: a local file through a byte-level tokenizer; tokens: shards from `workbench data prepare`, read by memmap.")
    path: str | None = Field(None, description="Text file for source=text (default: the small public-domain text shipped with workbench); the shards' directory or fsspec URI for source=tokens.")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of the data order; the same seed gives the same batches under every layout.")
    tokenizer: str | None = Field(None, description="source=tokens: a tokenizer.json to decode with (sample, export); default: the one saved with the shards.")
    val_fraction: float = Field(0.0, ge=0, lt=1, description="The last fraction of the text / token stream held out for evaluation (train.eval_every); of the examples, for fine-tuning shards.")
    packing: bool = Field(False, description="Fine-tuning shards (chat/instruct, with a loss mask): false puts one example per sequence (truncated to seq_len + 1 tokens, padded, the padding masked out: no token attends across examples); true cuts seq_len + 1 windows from the stream of examples, as for text (fuller rows, but an example attends to the ones before it in its window). Only masked tokens never train either way.")


class TrainSpec(_Section):
    """The optimization loop."""

    steps: int = Field(20, gt=0, le=MAX_STEPS, description="Optimizer steps.")
    global_batch: int = Field(16, gt=0, le=MAX_BATCH, description="Sequences per optimizer step, over all data-parallel ranks.")
    micro_batch: int = Field(4, gt=0, le=MAX_BATCH, description="Sequences per forward/backward on one rank.")
    optimizer: Literal["adamw", "adam", "sgd"] = Field("adamw", description="Optimizer.")
    lr: float = Field(3.0e-4, gt=0, description="Peak learning rate (the schedule scales it).")
    schedule: LrSchedule = Field("constant", description="Learning-rate schedule after warmup: constant, cosine or linear decay to min_lr, or warmup-stable-decay (wsd: the last 20% of steps decay linearly).")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="Steps of linear warmup from lr/warmup_steps to lr.")
    min_lr: float = Field(0.0, ge=0, description="Learning rate at the end of a decaying schedule.")
    eval_every: int = Field(0, ge=0, le=MAX_STEPS, description="Evaluate the held-out loss every N steps (and after the last); 0 disables.")
    eval_batches: int = Field(4, gt=0, le=MAX_BATCH, description="Held-out global batches per evaluation.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay (adamw) or L2 (adam, sgd).")
    grad_clip: float = Field(0.0, ge=0, description="Clip the global gradient norm to this value; 0 disables.")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of the weight initialization.")


class LayoutSpec(_Section):
    """How the job is split across GPUs: world size = dp x tp x pp."""

    dp: int = Field(1, gt=0, le=MAX_RANKS, description="Data-parallel degree.")
    tp: int = Field(1, gt=0, le=MAX_RANKS, description="Tensor-parallel degree (within a node).")
    pp: int = Field(1, gt=0, le=MAX_PP, description="Pipeline-parallel degree (stages).")
    zero: Literal[0, 1, 2, 3] = Field(0, description="ZeRO stage: 0 DDP, 1 optimizer state, 2 + gradients, 3 + parameters (FSDP).")
    pp_schedule: PipelineSchedule = Field("1f1b", description="Pipeline schedule when pp > 1.")
    virtual_stages: int = Field(2, gt=0, le=MAX_PP, description="Stages per pipeline rank for interleaved schedules.")
    activation_checkpointing: Literal["none", "full", "selective"] = Field("none", description="Recompute activations in backward: none; full: whole blocks (every checkpoint_every-th block); selective: the attention core only (Korthikanti et al. 2022).")
    checkpoint_every: int = Field(1, gt=0, le=MAX_LAYERS, description="k for full activation checkpointing: recompute every k-th block of each stage (1 = every block).")
    offload: Literal["none", "cpu", "nvme"] = Field("none", description="Where optimizer state (and master weights) live: on the device, in CPU memory or in files.")
    nvme_path: str = Field("/tmp/workbench-offload", description="Directory for offload=nvme.")
    sequence_parallel: bool = Field(False, description="Shard the residual stream, norms and the column-parallel linears' saved inputs along the sequence between TP regions (Megatron-style).")
    bucket_mb: float = Field(25.0, gt=0, le=1 << 20, description="Gradient bucket size in MiB: DDP's buckets (zero 0/1); "
                             "at zero 2/3, consecutive blocks share one FSDP2 unit up to this much fp32 gradient.")

    @property
    def world_size(self) -> int:
        """Ranks the layout runs on (dp x tp x pp): Parallelism.world_size, its one definition."""
        return Parallelism(dp=self.dp, tp=self.tp, pp=self.pp).world_size


class PrecisionSpec(_Section):
    """Numerics of the forward/backward; fp16/bf16 keep fp32 master weights."""

    dtype: Literal["fp32", "fp16", "bf16"] = Field("fp32", description="Compute dtype.")
    initial_loss_scale: float = Field(2.0**16, gt=0, le=2.0**64, description="fp16 only: starting dynamic loss scale.")


class ResourcesSpec(_Section):
    """The machines the job asks for."""

    gpu: str = Field("cpu", description="Accelerator type: cpu, a100-40gb, a100-80gb, h100-80gb, h200, l4, a10g, v100-16gb, v100-32gb, t4, tpu-v5e, tpu-v5p.")
    gpus_per_node: int = Field(1, gt=0, le=MAX_RANKS, description="Devices (or CPU worker processes) per node; default: the layout's world size / nodes.")
    nodes: int = Field(1, gt=0, le=MAX_RANKS, description="Number of nodes.")

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.nodes


class CheckpointSpec(_Section):
    """When and where to write checkpoints."""

    every_steps: int = Field(0, ge=0, le=MAX_STEPS, description="Save every N optimizer steps; 0 disables step-based saving.")
    every_minutes: float = Field(0.0, ge=0, description="Also save when this many minutes passed since the last save; 0 disables.")
    uri: str | None = Field(None, description="Local path or s3:// gs:// az:// URI. Clouds default to <bucket>/workbench/<name>/checkpoints/.")
    keep: int = Field(3, gt=0, le=1 << 20, description="Complete checkpoints to keep.")
    async_save: bool = Field(False, description="Write in the background so training does not wait on storage.")


class TrackingSpec(_Section):
    """Experiment trackers that receive the same step, eval and memory numbers (from rank 0)."""

    tensorboard: str | None = Field(None, description="Directory for TensorBoard event files.")
    mlflow: str | None = Field(None, description="MLflow tracking URI, e.g. file:./mlruns or http://host:5000.")


class RaySection(_Section):
    address: str = Field("http://127.0.0.1:8265", description="Ray dashboard (Jobs API) address.")


class SageMakerSection(_Section):
    role: str | None = Field(None, description="IAM role ARN the training job assumes.")
    region: str = Field("us-east-1", description="AWS region.")
    bucket: str | None = Field(None, description="S3 bucket for code, checkpoints and output.")
    image: str | None = Field(None, description="Training image URI; default: the PyTorch training image for our torch version.")
    instance_type: str | None = Field(None, description="Override the instance type derived from resources.")


class VertexSection(_Section):
    project: str | None = Field(None, description="GCP project id.")
    region: str = Field("us-central1", description="GCP region.")
    bucket: str | None = Field(None, description="gs:// bucket for staging, output and checkpoints.")
    image: str | None = Field(None, description="Container image; default: Vertex's PyTorch training image.")
    machine_type: str | None = Field(None, description="Override the machine type derived from resources.")
    service_account: str | None = Field(None, description="Service account the job runs as.")


class AzureMLSection(_Section):
    subscription_id: str | None = Field(None, description="Azure subscription id.")
    resource_group: str | None = Field(None, description="Resource group of the workspace.")
    workspace: str | None = Field(None, description="Azure ML workspace name.")
    compute: str | None = Field(None, description="Compute cluster name.")
    image: str | None = Field(None, description="Environment image; default: a curated ACPT PyTorch environment.")
    environment: str | None = Field(None, description="Registered environment 'name:version' or 'azureml:...'; overrides image.")


class BackendSpec(_Section):
    """Where the job runs."""

    name: Literal["local", "ray", "sagemaker", "vertex", "azureml"] = Field("local", description="local (embedded Ray), ray (existing cluster), sagemaker, vertex, azureml.")
    spot: bool = Field(False, description="Use spot/preemptible capacity (needs checkpointing).")
    max_runtime_s: int = Field(86400, gt=0, description="Clouds: hard stop after this many seconds of running.")
    max_wait_s: int = Field(172800, gt=0, description="Clouds with spot: total time including waiting for capacity.")
    max_failures: int = Field(0, ge=0, description="Restart the worker group this many times after a worker dies, from the last checkpoint.")
    include: list[str] = Field(default_factory=list, description="Remote backends: project files or folders (globs relative to the directory you dispatch from) to ship in the code bundle, besides the workbench packages, the spec, requirements.txt, model.factory's module and data.path.")
    secrets_allowlist: list[str] = Field(default_factory=list, description="Remote backends: bundle paths (relative to the directory you dispatch from, e.g. 'conf/test_keys.py') that ship although they look like credentials, by name or content: the scanner's false positives (backends/secrets.py).")
    elastic: bool = Field(False, description="Ray: when lost nodes leave too few for the layout, continue from the last checkpoint at a smaller dp with more gradient accumulation (same global batch, same loss curve) instead of waiting for capacity.")
    ray: RaySection = Field(default_factory=RaySection)
    sagemaker: SageMakerSection = Field(default_factory=SageMakerSection)
    vertex: VertexSection = Field(default_factory=VertexSection)
    azureml: AzureMLSection = Field(default_factory=AzureMLSection)


class JobFields(_Section):
    """The fields of a whole training job; spec.JobSpec adds `replace`, which validates. Build a
    JobSpec with `load_spec`; it validates itself there."""

    name: str = Field("job", min_length=1, description="Job name (used in paths and cloud job names).")
    model: ModelSpec = Field(default_factory=lambda: ModelSpec(preset="gpt-tiny"))
    data: DataSpec = Field(default_factory=DataSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    layout: LayoutSpec = Field(default_factory=LayoutSpec)
    precision: PrecisionSpec = Field(default_factory=PrecisionSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    backend: BackendSpec = Field(default_factory=BackendSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)

    # -- serialization -------------------------------------------------------------------
    def to_dict(self) -> dict:
        return self.model_dump(mode="json", exclude_none=True)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())

    @property
    def world_size(self) -> int:
        """Ranks the job runs on: the layout's (Parallelism.world_size)."""
        return self.layout.world_size

    def __repr__(self) -> str:
        lay = self.layout
        m = self.model
        model = m.preset or m.factory or (f"{m.params:.3g} params" if m.params else None) or \
            (f"{m.init}:{m.path}" if m.init != "random" else m.family)
        return (
            f"JobSpec({self.name!r}: model={model}, dp={lay.dp} tp={lay.tp} pp={lay.pp} zero={lay.zero}, "
            f"{self.precision.dtype}, steps={self.train.steps}, global_batch={self.train.global_batch}, "
            f"micro_batch={self.train.micro_batch}, {self.resources.nodes}x{self.resources.gpus_per_node} "
            f"{self.resources.gpu}, backend={self.backend.name})"
        )

    __str__ = __repr__

    def _repr_html_(self) -> str:
        return f"<b>{self.name}</b>" + _html_table(self.to_dict())


def _html_table(d: dict) -> str:
    rows = []
    for key, value in d.items():
        cell = _html_table(value) if isinstance(value, dict) and value else f"<code>{value!r}</code>"
        rows.append(f"<tr><th style='text-align:left;vertical-align:top'>{key}</th><td style='text-align:left'>{cell}</td></tr>")
    return "<table>" + "".join(rows) + "</table>"
