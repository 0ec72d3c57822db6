"""Accelerate's default_config.yaml <-> JobSpec: processes, machines, FSDP or DeepSpeed plugin, mixed precision.

Key names follow accelerate/commands/config/config_args.py (ClusterConfig) and the fsdp_config,
deepspeed_config and parallelism_config keys `accelerate launch` reads (Accelerate 1.15). Batch
sizes, the optimizer and clipping (outside the DeepSpeed plugin) live in the training script.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from workbench.errors import ConfigError
from workbench.interop.common import Notes, batch_split, flatten, said, set_path, unexpressed_fields
from workbench.parallelism import Parallelism
from workbench.spec import TrainSpec

# Launcher details of one machine that change nothing about the job at these values.
_NEUTRAL = {"compute_environment": "LOCAL_MACHINE", "machine_rank": 0, "main_training_function": "main",
            "rdzv_backend": "static", "same_network": True, "downcast_bf16": "no", "gpu_ids": "all",
            "fsdp_config.fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_config.fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",  # ours: a block per unit above bucket_mb
            "parallelism_config.parallelism_config_cp_size": 1,  # context parallelism off
            "deepspeed_config.zero3_init_flag": False}
_DTYPES = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}
_FSDP1 = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0}
_SCRIPT = "the training script sets it (Accelerate's config has no field for it)"


def parse(text: str) -> dict:
    from workbench.spec_input import parse_yaml

    try:  # the spec's bounded loader: alias bombs and deep nesting are refused before they are built
        cfg = parse_yaml(text, "not an Accelerate config")
    except ConfigError as e:
        raise ConfigError(str(e).replace(": not valid YAML:", ": invalid YAML:", 1)) from None
    if not isinstance(cfg, dict) or "distributed_type" not in cfg:
        raise ConfigError("not an Accelerate config: expected a YAML mapping with distributed_type "
                          "(as `accelerate config` writes it).")
    return cfg


def dump(cfg: dict) -> str:
    return yaml.safe_dump(cfg, sort_keys=False)


def to_spec(cfg: dict, dp: int | None = None, base: Path | None = None) -> tuple[dict, list[str]]:
    """An Accelerate config dict -> (raw spec dict, warnings); `dp` is the launcher's if the file leaves it.

    `base` is the folder of the YAML: a ``deepspeed_config_file`` is read from there (relative paths are
    the YAML's, as `accelerate launch` run beside it reads them).
    """
    notes, flat, raw = Notes("accelerate"), flatten(cfg), {}
    used = {k for k, v in _NEUTRAL.items() if flat.get(k) == v}

    def get(key, default=None):
        used.add(key)
        return flat.get(key, default)

    kind = get("distributed_type", "NO")
    dtype = _DTYPES.get(str(get("mixed_precision", "no")).lower())
    if dtype is None:
        notes.unmapped("mixed_precision", flat["mixed_precision"], "the spec's precisions are fp32, fp16 and bf16")
    elif dtype != "fp32":
        set_path(raw, "precision.dtype", dtype)
    if get("use_cpu"):
        set_path(raw, "resources.gpu", "cpu")
    elif kind not in ("NO", "MULTI_CPU"):
        notes.note("the job runs on the GPUs Accelerate finds, of a type the file does not name: resources.gpu is "
                   "left unset (an export writes no use_cpu unless the spec states a device); set it with --set resources.gpu=NAME (e.g. h100-80gb)")
    dp = _world(get, raw, notes, dp)
    if kind == "FSDP":
        _fsdp(get, raw, notes)
    elif kind == "DEEPSPEED" and get("deepspeed_config.deepspeed_config_file"):
        _deepspeed_file(get, raw, notes, dp, base)
    elif kind == "DEEPSPEED":
        _deepspeed(get, raw, notes, dp)
    elif kind not in ("NO", "MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA",
                      "MULTI_MUSA", "MULTI_HPU"):
        notes.unmapped("distributed_type", kind, "the spec runs DDP, ZeRO 1-3/FSDP, tp and pp")
    if "global_batch" not in raw.get("train", {}):
        _fit_batch(raw, dp, notes)
    notes.unmapped_rest(flat, used)
    return raw, notes.lines


def _fit_batch(raw: dict, dp: int, notes: Notes) -> None:
    """The batch sizes are the script's: keep the spec's defaults when they fit dp, else one micro-batch per rank."""
    micro, global_batch = TrainSpec().micro_batch, TrainSpec().global_batch
    if global_batch % (micro * dp):
        set_path(raw, "train.global_batch", micro * dp)
        notes.note(f"the batch sizes are the training script's; global_batch = micro_batch({micro}) x dp({dp}) "
                   f"= {micro * dp} assumed (change with --set train.global_batch=N)")


def _world(get, raw: dict, notes: Notes, launcher_dp: int | None) -> int:
    """Machines, processes and the tp/dp split of them; returns dp."""
    machines, procs = int(get("num_machines", 1)), int(get("num_processes", 1))
    tp = int(get("parallelism_config.parallelism_config_tp_size", 1))
    cp = int(get("parallelism_config.parallelism_config_cp_size", 1))
    if cp > 1:  # the processes are dp x tp x cp; the spec has no context parallelism
        notes.unmapped("parallelism_config.parallelism_config_cp_size", cp,
                       f"context parallelism splits each sequence over {cp} ranks; the spec has none, so those ranks "
                       f"are not part of the imported job (dp = num_processes / (tp x cp)): a different layout")
        tp *= cp
    replicate = int(get("parallelism_config.parallelism_config_dp_replicate_size", 1))
    shard = int(get("parallelism_config.parallelism_config_dp_shard_size", 1))
    if procs < 1:
        if not launcher_dp:
            notes.note(f"num_processes={procs} leaves the world size to the launcher; dp=1 assumed: "
                       "give it with --set layout.dp=N")
        return launcher_dp or 1
    if procs % tp or procs % machines:
        raise ConfigError(f"Accelerate config: num_processes({procs}) must be a multiple of num_machines({machines}) "
                          f"and of parallelism_config_tp_size({tp}). Fix num_processes.")
    dp = procs // tp
    if replicate * shard not in (1, dp):
        raise ConfigError(f"Accelerate config: dp_replicate_size({replicate}) x dp_shard_size({shard}) must be "
                          f"num_processes({procs}) / tp_size({tp}) = {dp}. Fix the parallelism_config sizes.")
    if replicate > 1 and shard > 1:
        notes.note(f"hybrid sharding (replicate {replicate} x shard {shard}) becomes plain sharding over dp={dp}")
    tp //= cp
    set_path(raw, "layout.dp", dp)
    set_path(raw, "layout.tp", tp)
    if machines > 1:
        set_path(raw, "resources.nodes", machines)
        set_path(raw, "resources.gpus_per_node", procs // machines // cp)
    return dp


def _fsdp(get, raw: dict, notes: Notes) -> None:
    version = int(get("fsdp_config.fsdp_version", 1))
    reshard = get("fsdp_config.fsdp_reshard_after_forward", get("fsdp_config.fsdp_sharding_strategy",
                                                                  True if version == 2 else "FULL_SHARD"))
    if isinstance(reshard, bool):
        zero = 3 if reshard else 2
    else:
        name = str(reshard).upper().split(".")[-1]
        zero = _FSDP1.get(name, 3)
        if name not in _FSDP1:
            notes.unmapped("fsdp_config.fsdp_reshard_after_forward", reshard,
                           "hybrid sharding has no counterpart; mapped to full sharding (zero=3) over all dp ranks")
    set_path(raw, "layout.zero", zero)
    if get("fsdp_config.fsdp_offload_params"):
        set_path(raw, "layout.offload", "cpu")
    if get("fsdp_config.fsdp_activation_checkpointing"):
        set_path(raw, "layout.activation_checkpointing", "full")


def _deepspeed_file(get, raw: dict, notes: Notes, dp: int, base: Path | None) -> None:
    """deepspeed_config_file: Accelerate hands that ds_config to DeepSpeed whole (the inline keys are then not
    read), so the stage, precision, batch, clipping, optimizer and schedule are the file's."""
    from workbench.interop import deepspeed as ds

    name = str(get("deepspeed_config.deepspeed_config_file"))
    path = (base / name) if base is not None and not Path(name).is_absolute() else Path(name)
    from workbench.interop import read_config

    try:
        text = read_config(path)
    except ConfigError as e:
        where = f"{e}" if base is not None else "imported from text, no folder to read it from"
        notes.unmapped("deepspeed_config.deepspeed_config_file", name,
                       f"the ZeRO stage, precision, batch and optimizer live in that file, which is not readable "
                       f"here ({where}); nothing of it is assumed (the spec's defaults stand in): import it with "
                       "--format deepspeed, or keep it beside the YAML")
        return
    sub, lines = ds.to_spec(ds.parse(text), dp)
    for section, fields in sub.items():
        for key, value in fields.items():
            if section == "layout" and key == "dp":
                continue  # the launcher's processes decide dp; the file's batch sizes are checked by load_spec
            if section == "precision" and "dtype" in raw.get("precision", {}) and key == "dtype":
                if raw["precision"]["dtype"] != value:
                    notes.note(f"mixed_precision gives {raw['precision']['dtype']}, {name} gives {value}: "
                               "DeepSpeed takes the file's")
            set_path(raw, f"{section}.{key}", value)
    for line in lines:
        notes.lines.append(f"{line} (in {name})" if line.startswith("deepspeed") else line)
    for key in ("zero_stage", "offload_optimizer_device", "offload_param_device", "gradient_accumulation_steps",
                "gradient_clipping"):
        if get(f"deepspeed_config.{key}") not in (None, "none"):
            notes.unmapped(f"deepspeed_config.{key}", get(f"deepspeed_config.{key}"),
                           f"Accelerate does not read it beside deepspeed_config_file; {name}'s value is used")


def _deepspeed(get, raw: dict, notes: Notes, dp: int) -> None:
    set_path(raw, "layout.zero", int(get("deepspeed_config.zero_stage", 2)))
    opt_dev = get("deepspeed_config.offload_optimizer_device", "none") or "none"
    param_dev = get("deepspeed_config.offload_param_device", "none") or "none"
    device = opt_dev if opt_dev != "none" else param_dev
    if device != "none":
        set_path(raw, "layout.offload", device)
        path = get("deepspeed_config.offload_optimizer_nvme_path") or get("deepspeed_config.offload_param_nvme_path")
        if device == "nvme" and path:
            set_path(raw, "layout.nvme_path", path)
    accum = get("deepspeed_config.gradient_accumulation_steps")
    if accum:
        micro = TrainSpec().micro_batch
        set_path(raw, "train.global_batch", micro * int(accum) * dp)
        notes.note(f"gradient_accumulation_steps={accum}: the micro-batch size is the script's DataLoader's; "
                   f"micro_batch={micro} assumed, so global_batch={micro * int(accum) * dp} "
                   "(change both with --set)")
    if get("deepspeed_config.gradient_clipping"):
        set_path(raw, "train.grad_clip", float(get("deepspeed_config.gradient_clipping")))


def from_spec(spec) -> tuple[dict, list[str]]:
    """A validated JobSpec -> (Accelerate config dict, warnings)."""
    notes, lay, res, par = Notes("accelerate"), spec.layout, spec.resources, Parallelism.from_spec(spec)
    cfg: dict = {"compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": "NO",
                 "downcast_bf16": "no", "machine_rank": 0, "main_training_function": "main",
                 "mixed_precision": {"fp32": "no"}.get(spec.precision.dtype, spec.precision.dtype),
                 "num_machines": res.nodes, "num_processes": lay.world_size, "rdzv_backend": "static",
                 "same_network": True}
    cpu = res.gpu == "cpu" and said(spec, "resources.gpu")
    if said(spec, "resources.gpu"):
        cfg["use_cpu"] = cpu
    else:  # the spec's default device is no statement about the job: Accelerate uses the GPUs it finds
        notes.note("the spec does not set resources.gpu: use_cpu is not written, so Accelerate runs on the GPUs "
                   "it finds (--set resources.gpu=cpu for a CPU config)")
    expressed = ["precision.dtype", "layout.dp", "layout.zero", "resources.nodes", "resources.gpus_per_node",
                 "resources.gpu"]
    # ZeRO 2/3 go through the plugin that says more of the spec: FSDP2 holds activation checkpointing
    # and tp, DeepSpeed's holds gradient clipping and accumulation.
    deepspeed = lay.zero == 1 or lay.offload == "nvme" or (
        lay.zero >= 2 and spec.train.grad_clip > 0 and lay.activation_checkpointing == "none" and lay.tp == 1)
    if deepspeed:
        cfg["distributed_type"] = "DEEPSPEED"
        cfg["deepspeed_config"] = _deepspeed_out(spec, notes)
        exported_offload = lay.offload == "cpu" or lay.offload == "nvme" and lay.zero == 3
        expressed += ["train.global_batch", "train.grad_clip"] + (["layout.offload"] if exported_offload else [])
    elif par.fsdp:
        cfg["distributed_type"] = "FSDP"
        cfg["fsdp_config"] = {"fsdp_version": 2, "fsdp_reshard_after_forward": par.reshard_after_forward,
                              "fsdp_offload_params": lay.offload == "cpu",
                              "fsdp_activation_checkpointing": lay.activation_checkpointing == "full",
                              "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_state_dict_type": "SHARDED_STATE_DICT"}
        expressed += ["layout.offload"] + (["layout.activation_checkpointing"] if lay.activation_checkpointing == "full" else [])
    elif cfg["num_processes"] > 1:
        cfg["distributed_type"] = "MULTI_CPU" if cpu else "MULTI_GPU"
    if lay.zero >= 1:  # the spec says the stage, not the engine: name the plugin chosen for it
        other = "FSDP plugin (FSDP2)" if deepspeed else "DeepSpeed plugin (ZeRO)"
        notes.note(f"layout.zero={lay.zero} is written with the {'DeepSpeed plugin' if deepspeed else 'FSDP plugin'}, "
                   f"the one that says more of this spec; the {other} shards the same state")
    if lay.tp > 1 and cfg["distributed_type"] == "FSDP":  # Accelerate composes tp with FSDP only
        cfg["parallelism_config"] = {"parallelism_config_dp_replicate_size": 1, "parallelism_config_dp_shard_size": lay.dp,
                                     "parallelism_config_tp_size": lay.tp}
        expressed.append("layout.tp")
    if spec.precision.initial_loss_scale == 2.0**16:  # torch's GradScaler default, which Accelerate uses
        expressed.append("precision.initial_loss_scale")
    unexpressed_fields(spec, expressed, notes, {
        "layout.pp": "Accelerate's config has no pipeline stages",
        "layout.tp": "Accelerate composes tensor parallelism with FSDP only (zero 2/3)",
        "layout.activation_checkpointing": "Accelerate checkpoints activations only through its FSDP plugin (full)",
        "layout.sequence_parallel": "Accelerate's sp_size is context (Ulysses) parallelism, not tp's sequence parallel",
        "train": _SCRIPT, "model": "an Accelerate config does not describe the model", "data": _SCRIPT,
        "checkpoint": _SCRIPT, "precision.initial_loss_scale": "Accelerate's fp16 GradScaler starts at 2**16"})
    return cfg, notes.lines


def _deepspeed_out(spec, notes: Notes) -> dict:
    lay = spec.layout
    micro, accum = batch_split(spec)
    if micro != 4:
        notes.unexpressed("train.micro_batch", micro, "the script's DataLoader sets it")
    out = {"zero_stage": lay.zero, "gradient_accumulation_steps": accum, "gradient_clipping": spec.train.grad_clip,
           "offload_optimizer_device": "cpu" if lay.offload == "cpu" else "none",
           "offload_param_device": "cpu" if lay.offload == "cpu" and lay.zero == 3 else "none", "zero3_init_flag": False}
    if lay.offload == "nvme" and lay.zero == 3:  # ZeRO-Infinity: parameters and optimizer state in files
        out.update(offload_optimizer_device="nvme", offload_param_device="nvme",
                   offload_optimizer_nvme_path=lay.nvme_path, offload_param_nvme_path=lay.nvme_path)
    if lay.offload == "cpu" and lay.zero == 2:
        notes.note("layout.offload=cpu also keeps parameters on the host; DeepSpeed offloads parameters only with "
                   "ZeRO-3, so under ZeRO-2 only the optimizer state goes to the CPU")
    elif lay.offload == "nvme" and lay.zero != 3:
        notes.unexpressed("layout.offload", "nvme", "DeepSpeed streams optimizer state and parameters to NVMe only "
                          "under ZeRO-3; use zero=3 with offload=nvme")
    if spec.precision.dtype == "fp16":
        notes.note("fp16 under the DeepSpeed plugin uses DeepSpeed's loss scaler (window 1000, hysteresis 2)")
    return out
