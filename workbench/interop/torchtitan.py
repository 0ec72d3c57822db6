"""torchtitan job TOML <-> JobSpec: parallelism degrees, FSDP/DDP, CPU offload, mixed precision, batch sizes,
optimizer, activation checkpointing, llama3 flavors and checkpointing.

Section and field names and their defaults follow torchtitan/config/job_config.py at the last
release that read TOML files (pytorch/torchtitan e347b1e, February 2026; later versions build the
same JobConfig fields from Python). The world size is the launcher's (NGPU), so
data_parallel_shard_degree = -1 ("the rest") leaves dp to --set.
"""
from __future__ import annotations

import math

import tomllib

from workbench.errors import ConfigError
from workbench.interop.common import (
    ADAM_BETAS,
    Notes,
    batch_split,
    flatten,
    lag_note,
    scaled,
    set_path,
    unexpressed_fields,
)
from workbench.parallelism import Parallelism, is_multi_stage

_ROPE_THETA = 500000.0  # every llama3 flavor (model.rope_theta on import)


def _ffn(dim: int, multiplier: float | None = None, multiple_of: int = 256) -> int:
    """torchtitan's llama3 FeedForward width (model.py)."""
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


# torchtitan/models/llama3/__init__.py: llama3_args (vocab_size defaults to 128256).
FLAVORS = {
    "debugmodel": dict(layers=6, hidden=256, heads=16, kv_heads=16, ffn_hidden=_ffn(256), vocab=2048),
    "8B": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=_ffn(4096, 1.3, 1024), vocab=128256),
    "70B": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=_ffn(8192, 1.3, 4096), vocab=128256),
    "405B": dict(layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=_ffn(16384, 1.2, 4096), vocab=128256),
}
# The older layout's llama2 (torchtitan/models/llama/__init__.py at a09cde3, September 2024): rope_theta
# 10000 like ours, the vocabulary of Llama 2's SentencePiece tokenizer (32000).
LLAMA2_FLAVORS = {
    "7B": dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=_ffn(4096), vocab=32000),
    "13B": dict(layers=40, hidden=5120, heads=40, kv_heads=40, ffn_hidden=_ffn(5120), vocab=32000),
    "70B": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=_ffn(8192, 1.3, 4096), vocab=32000),
}
# The older layout (until late 2024) kept the degrees in [training] and [experimental]; same meanings.
_OLD_KEYS = {"training.data_parallel_degree": "parallelism.data_parallel_shard_degree",
             "training.data_parallel_shard_degree": "parallelism.data_parallel_shard_degree",
             "training.data_parallel_replicate_degree": "parallelism.data_parallel_replicate_degree",
             "training.tensor_parallel_degree": "parallelism.tensor_parallel_degree",
             "experimental.pipeline_parallel_degree": "parallelism.pipeline_parallel_degree",
             "experimental.pipeline_parallel_schedule": "parallelism.pipeline_parallel_schedule",
             "training.warmup_steps": "lr_scheduler.warmup_steps",
             "checkpoint.enable_checkpoint": "checkpoint.enable"}
_SCHEDULES = {"GPipe": "gpipe", "1F1B": "1f1b", "Interleaved1F1B": "interleaved-1f1b",
              "InterleavedZeroBubble": "zero-bubble"}
_DTYPES = {"bfloat16": "bf16", "float32": "fp32"}
# Values that switch a feature off: saying them sets nothing.
_NEUTRAL = {"parallelism.context_parallel_degree": 1, "parallelism.expert_parallel_degree": 1,
            "parallelism.expert_tensor_parallel_degree": 1, "training.mixed_precision_reduce": "float32"}
# Sections whose every key is inert while their switch (default off) is off.
_SWITCHED = {"checkpoint": "checkpoint.enable", "compile": "compile.enable", "validation": "validation.enable",
             "profiling": "profiling.enable_profiling", "memory_estimation": "memory_estimation.enable",
             "fault_tolerance": "fault_tolerance.enable", "quantize": "model.converters"}


def parse(text: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"not a torchtitan config: invalid TOML: {e}.") from None


def dump(cfg: dict) -> str:
    """A TOML document of sections of scalars and lists (all a torchtitan job config needs)."""
    out = []
    for section, fields in cfg.items():
        if set(fields) != {"#"}:  # a section of only a comment is not written (an empty table means defaults)
            out.append(f"[{section}]")
        out += [f"# [{section}] {value}" if key == "#" else f"{key} = {_toml_value(value)}"
                for key, value in fields.items()]
        out.append("")
    return "\n".join(out)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"TOML has no {value}")
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def to_spec(cfg: dict, dp: int | None = None) -> tuple[dict, list[str]]:
    """A torchtitan job config dict -> (raw spec dict, warnings); `dp` fills data_parallel_shard_degree=-1."""
    notes, flat, raw = Notes("torchtitan"), flatten(cfg), {}
    old_layout = any(k in flat for k in _OLD_KEYS)
    for old, new in _OLD_KEYS.items():
        if old in flat and new not in flat:
            flat[new] = flat.pop(old)
    if flat.get("training.data_parallel_type") == "ddp":  # the older layout's DDP over the dp degree
        flat["parallelism.data_parallel_replicate_degree"] = flat.pop("parallelism.data_parallel_shard_degree", -1)
        flat["parallelism.data_parallel_shard_degree"] = 1
        flat.pop("training.data_parallel_type")
    elif flat.get("training.data_parallel_type") == "fsdp":
        flat.pop("training.data_parallel_type")
    used = {k for k, v in _NEUTRAL.items() if flat.get(k) == v}
    for section, switch in _SWITCHED.items():
        if not flat.get(switch):
            used |= {k for k in flat if k.startswith(section + ".")}

    def get(key, default=None):
        used.add(key)
        return flat.get(key, default)

    pp = _parallelism(get, raw, notes, dp)
    _training(get, raw, notes, pp)
    _optimizer(get, raw, notes)
    _activation_checkpoint(get, raw, notes)
    _model(get, raw, notes, old_layout)
    _checkpoint(get, raw)
    _lr_scheduler(get, raw, notes)
    notes.unmapped_rest(flat, used)
    return raw, notes.lines


def _lr_scheduler(get, raw: dict, notes: Notes) -> None:
    """[lr_scheduler] (torchtitan/components/lr_scheduler.py, linear_warmup_stable_decay) -> train.schedule.

    Theirs: warmup (k / warmup_steps) x lr, stable, then the last decay_ratio x steps (None: all after
    the warmup; 0: none) decay by decay_type from lr to min_lr_factor x lr.
    """
    train = raw["train"]
    steps, warmup = train["steps"], int(get("lr_scheduler.warmup_steps", 200))  # torchtitan's default warms up
    ratio = get("lr_scheduler.decay_ratio")
    kind = get("lr_scheduler.decay_type", "linear")
    factor = float(get("lr_scheduler.min_lr_factor", 0.0))
    train["warmup_steps"] = min(warmup, steps)  # torchtitan clips the warmup to the run
    if ratio is not None and float(ratio) == 0.0:
        train["schedule"] = "constant"
        return _lag(notes, warmup)
    if kind not in ("linear", "cosine"):
        notes.unmapped("lr_scheduler.decay_type", kind, "the spec's decays are linear and cosine; linear used")
        kind = "linear"
    train["min_lr"] = scaled(factor, train["lr"])
    if ratio is None:
        train["schedule"] = kind
    else:
        from workbench.schedule import WSD_DECAY_FRACTION

        train["schedule"] = "wsd"
        if kind != "linear":
            notes.unmapped("lr_scheduler.decay_type", kind, "the spec's wsd decays linearly; mapped as linear")
        if round(steps * float(ratio)) != max(1, round(steps * WSD_DECAY_FRACTION)):
            notes.unmapped("lr_scheduler.decay_ratio", ratio, f"the spec's wsd decays over the last "
                           f"{WSD_DECAY_FRACTION:g} of the steps; mapped as that")
    _lag(notes, 1)


def _lag(notes: Notes, warms_or_decays: int) -> None:
    if warms_or_decays:
        notes.note(lag_note("torchtitan", "0-based steps and ends its decay on a virtual step after the last"))


def _lr_scheduler_out(tr, notes: Notes, expressed: list[str]) -> dict:
    from workbench.schedule import WSD_DECAY_FRACTION

    expressed += ["train.schedule", "train.warmup_steps"]
    out: dict = {"warmup_steps": tr.warmup_steps}
    if tr.schedule == "constant":
        return {**out, "decay_ratio": 0.0}
    out.update(decay_type="cosine" if tr.schedule == "cosine" else "linear", min_lr_factor=tr.min_lr / tr.lr)
    expressed.append("train.min_lr")
    if tr.schedule == "wsd":
        out["decay_ratio"] = WSD_DECAY_FRACTION
        if tr.warmup_steps > tr.steps - max(1, round(WSD_DECAY_FRACTION * tr.steps)):
            notes.unexpressed("train.warmup_steps", tr.warmup_steps, "torchtitan shortens the decay when it "
                              "overlaps the warmup; the spec's wsd shortens the decay the same way but from "
                              "the warmup's end")
    return out


def _parallelism(get, raw: dict, notes: Notes, launcher_dp: int | None) -> int:
    replicate = int(get("parallelism.data_parallel_replicate_degree", 1))
    shard = int(get("parallelism.data_parallel_shard_degree", -1))
    tp, pp = int(get("parallelism.tensor_parallel_degree", 1)), int(get("parallelism.pipeline_parallel_degree", 1))
    if shard == -1 and launcher_dp:
        shard = max(launcher_dp // replicate, 1)
    elif shard == -1:
        notes.note("data_parallel_shard_degree=-1 takes the ranks the launcher (NGPU) leaves; the file does not "
                   "say how many: dp=1 assumed, give it with --set layout.dp=N")
    dp = replicate * max(shard, 1)
    sharded = shard != 1
    if replicate > 1 and shard > 1:
        notes.note(f"HSDP (replicate {replicate} x shard {shard}) becomes plain sharding over dp={dp}")
    lay = {"dp": dp, "tp": tp, "pp": pp, "zero": 0}
    reshard = get("parallelism.fsdp_reshard_after_forward", "default")
    if sharded:
        lay["zero"] = 2 if reshard == "never" else 3
    if tp > 1:
        lay["sequence_parallel"] = bool(get("parallelism.enable_sequence_parallel", True))  # torchtitan's TP always is
    if pp > 1:
        name = get("parallelism.pipeline_parallel_schedule", "1F1B")
        if name not in _SCHEDULES:
            notes.unmapped("parallelism.pipeline_parallel_schedule", name,
                           f"the spec's schedules are {', '.join(_SCHEDULES)}; 1F1B used")
        lay["pp_schedule"] = _SCHEDULES.get(name, "1f1b")
        per_stage = get("parallelism.pipeline_parallel_layers_per_stage")
        if is_multi_stage(lay["pp_schedule"]):
            layers = FLAVORS.get(get("model.flavor", "debugmodel"), {}).get("layers")
            lay["virtual_stages"] = layers // (pp * per_stage) if per_stage and layers else 2
    if pp == 1:  # a pipeline's settings without a pipeline switch nothing on
        for key in ("schedule", "layers_per_stage", "microbatch_size"):
            get(f"parallelism.pipeline_parallel_{key}")
    if get("training.enable_cpu_offload"):
        lay["offload"] = "cpu"
    raw["layout"] = lay
    return pp


def _training(get, raw: dict, notes: Notes, pp: int) -> None:
    dp = raw["layout"]["dp"]
    local = int(get("training.local_batch_size", get("training.batch_size", 8)))  # batch_size: the older name
    micro = int(get("parallelism.pipeline_parallel_microbatch_size", 1)) if pp > 1 else local
    global_batch = int(get("training.global_batch_size", -1))
    set_path(raw, "train.micro_batch", micro)
    set_path(raw, "train.global_batch", global_batch if global_batch > 0 else local * dp)
    set_path(raw, "train.steps", int(get("training.steps", 10000)))
    set_path(raw, "train.grad_clip", float(get("training.max_norm", 1.0)))
    seed = get("debug.seed", get("training.seed"))
    if seed is not None:
        set_path(raw, "train.seed", int(seed))
    if get("training.dtype", "float32") != "float32":
        notes.unmapped("training.dtype", get("training.dtype"),
                       "training in that dtype keeps no fp32 master; the spec's bf16 keeps fp32 master weights")
    dtype = get("training.mixed_precision_param", "bfloat16")
    if dtype not in _DTYPES:
        notes.unmapped("training.mixed_precision_param", dtype, "the spec's precisions are fp32, fp16 and bf16")
    set_path(raw, "precision.dtype", _DTYPES.get(dtype, "bf16"))


def _optimizer(get, raw: dict, notes: Notes) -> None:
    name = get("optimizer.name", "AdamW")
    if name not in ("AdamW", "Adam"):
        notes.unmapped("optimizer.name", name, "the spec's optimizers are adamw, adam and sgd")
    set_path(raw, "train.optimizer", "adam" if name == "Adam" else "adamw")
    set_path(raw, "train.lr", float(get("optimizer.lr", 8e-4)))
    set_path(raw, "train.weight_decay", float(get("optimizer.weight_decay", 0.1)))
    for key, default, ours in (("beta1", 0.9, ADAM_BETAS[0]), ("beta2", 0.95, ADAM_BETAS[1]), ("eps", 1e-8, 1e-8)):
        value = get(f"optimizer.{key}", default)
        if value != ours:
            notes.unmapped(f"optimizer.{key}", value, f"the spec's {name} uses {key}={ours} "
                           "(torchtitan's default applies when the key is absent)")


def _activation_checkpoint(get, raw: dict, notes: Notes) -> None:
    mode = get("activation_checkpoint.mode", "selective")
    option = str(get("activation_checkpoint.selective_ac_option", "2"))
    if mode == "full":
        raw["layout"]["activation_checkpointing"] = "full"
    elif mode == "selective" and option.isdigit():  # torchtitan's layer-selective: every k-th block
        raw["layout"].update(activation_checkpointing="full", checkpoint_every=int(option))
    elif mode != "none":
        notes.unmapped(f"activation_checkpoint.{'mode' if mode != 'selective' else 'selective_ac_option'}",
                       mode if mode != "selective" else option,
                       "op-level and memory-budget checkpointing have no counterpart (the spec's selective "
                       "recomputes the attention core, Korthikanti et al.); none used")


def _model(get, raw: dict, notes: Notes, old_layout: bool = False) -> None:
    name, flavor = get("model.name", "llama3"), get("model.flavor", "debugmodel")
    seq = int(get("training.seq_len", 2048))
    # The older llama3 debugmodel had 8 layers and the test tokenizer's vocabulary: only the big flavors match.
    known = ({f: d for f, d in FLAVORS.items() if f != "debugmodel" or not old_layout} if name == "llama3"
             else LLAMA2_FLAVORS if name == "llama2" else {})
    if flavor not in known:
        older = " (this older layout's debugmodel is another shape)" if old_layout and name == "llama3" else ""
        notes.unmapped("model.flavor", f"{name}/{flavor}", f"no shape is known here for it (llama3 "
                       f"{', '.join(FLAVORS)}; llama2 {', '.join(LLAMA2_FLAVORS)}{older}): the spec keeps its default "
                       "model, a different model (set model.* with --set)")
        return
    raw["model"] = {"family": "llama", **known[flavor], "seq_len": seq, "tie_embeddings": False}
    if name == "llama3":
        raw["model"]["rope_theta"] = _ROPE_THETA


def _checkpoint(get, raw: dict) -> None:
    dump_folder = get("job.dump_folder", "./outputs")
    if not get("checkpoint.enable", False):
        return
    folder = get("checkpoint.folder", "checkpoint")
    uri = folder if dump_folder in ("", ".", "./") or folder.startswith("/") else f"{dump_folder.rstrip('/')}/{folder}"
    raw["checkpoint"] = {"every_steps": int(get("checkpoint.interval", 500)), "uri": uri,
                         "keep": int(get("checkpoint.keep_latest_k", 10)),
                         "async_save": get("checkpoint.async_mode", "disabled") != "disabled"}


def from_spec(spec) -> tuple[dict, list[str]]:
    """A validated JobSpec -> (torchtitan job config as sections of fields, warnings)."""
    notes, lay, tr = Notes("torchtitan"), spec.layout, spec.train
    micro, _ = batch_split(spec)
    expressed = ["layout.dp", "layout.tp", "layout.pp", "layout.zero", "train.global_batch", "train.micro_batch",
                 "train.steps", "train.grad_clip", "train.seed", "train.lr", "train.weight_decay", "precision.dtype"]
    par = Parallelism.from_spec(spec)
    fsdp = par.fsdp or lay.zero >= 2  # ZeRO 2/3 on one rank is still FSDP's layout: -1 keeps it sharded
    parallelism = {"data_parallel_replicate_degree": 1 if fsdp else lay.dp,
                   "data_parallel_shard_degree": (lay.dp if lay.dp > 1 else -1) if fsdp else 1,
                   "fsdp_reshard_after_forward": "never" if fsdp and lay.zero == 2 else "default",
                   "tensor_parallel_degree": lay.tp, "pipeline_parallel_degree": lay.pp}
    if lay.zero == 1:
        notes.unexpressed("layout.zero", 1, "torchtitan shards all of parameters, gradients and optimizer state "
                          "(FSDP) or none (DDP); exported as DDP")
    if lay.tp > 1 and lay.sequence_parallel:
        expressed.append("layout.sequence_parallel")
    elif lay.tp > 1:
        notes.unexpressed("layout.sequence_parallel", False, "torchtitan's tensor parallel always shards the "
                          "norms along the sequence")
    training = {"local_batch_size": micro if lay.pp == 1 else tr.global_batch // lay.dp,
                "global_batch_size": tr.global_batch, "max_norm": tr.grad_clip, "steps": tr.steps, "enable_cpu_offload": lay.offload == "cpu",
                "mixed_precision_param": "float32" if spec.precision.dtype == "fp32" else "bfloat16"}
    if not (spec.model.params or spec.model.factory):
        training["seq_len"] = spec.model.shape().seq_len
    if spec.precision.dtype == "fp16":
        notes.unexpressed("precision.dtype", "fp16", "torchtitan's mixed precision is bf16 only; exported as bfloat16")
    if lay.offload == "cpu":
        expressed.append("layout.offload")
    if lay.pp > 1:
        _pipeline_out(spec, parallelism, expressed, micro)
    model = _model_out(spec, notes, expressed)
    cfg = {"job": {"dump_folder": "."}, "model": model or {"#": "no [model] fields: the spec's model matches no "
                                                                   "torchtitan flavour; torchtitan would build its default "
                                                                   "(llama3 debugmodel): set name and flavor"},
           "optimizer": {"name": "Adam" if tr.optimizer == "adam" else "AdamW", "lr": tr.lr, "beta1": ADAM_BETAS[0],
                         "beta2": ADAM_BETAS[1], "eps": 1e-8, "weight_decay": tr.weight_decay},
           "lr_scheduler": _lr_scheduler_out(tr, notes, expressed),
           "training": training, "parallelism": parallelism,
           "activation_checkpoint": _ac_out(lay, expressed), "debug": {"seed": tr.seed}}
    if tr.optimizer == "sgd":
        notes.unexpressed("train.optimizer", "sgd", "torchtitan builds Adam and AdamW only; exported as AdamW")
    else:
        expressed.append("train.optimizer")
    if spec.checkpoint.every_steps:
        cfg["checkpoint"] = {"enable": True, "folder": spec.checkpoint.uri or "checkpoint",
                             "interval": spec.checkpoint.every_steps, "keep_latest_k": spec.checkpoint.keep,
                             "async_mode": "async" if spec.checkpoint.async_save else "disabled"}
        expressed += ["checkpoint.every_steps", "checkpoint.uri", "checkpoint.keep", "checkpoint.async_save"]
    unexpressed_fields(spec, expressed, notes, {
        "layout.offload": "torchtitan offloads to the CPU (FSDP2), not to files",
        "layout.pp_schedule": "torchtitan's schedules here are GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble",
        "data": "torchtitan reads training.dataset; the spec's synthetic/text sources have no counterpart",
        "resources": "the world size is the launcher's (NGPU)"})
    return cfg, notes.lines


def _pipeline_out(spec, parallelism: dict, expressed: list[str], micro: int) -> None:
    lay = spec.layout
    name = {v: k for k, v in _SCHEDULES.items()}[lay.pp_schedule]
    parallelism.update(pipeline_parallel_schedule=name, pipeline_parallel_microbatch_size=micro)
    expressed.append("layout.pp_schedule")
    if is_multi_stage(lay.pp_schedule) and not spec.model.params:
        layers = spec.model.shape().layers
        if layers % (lay.pp * lay.virtual_stages) == 0:
            parallelism["pipeline_parallel_layers_per_stage"] = layers // (lay.pp * lay.virtual_stages)
            expressed.append("layout.virtual_stages")


def _ac_out(lay, expressed: list[str]) -> dict:
    expressed.append("layout.activation_checkpointing")
    if lay.activation_checkpointing == "full" and lay.checkpoint_every > 1:
        expressed.append("layout.checkpoint_every")
        return {"mode": "selective", "selective_ac_option": str(lay.checkpoint_every)}
    if lay.activation_checkpointing == "selective":  # attention core only: torchtitan's op-level mode is not that
        expressed.remove("layout.activation_checkpointing")
        return {"mode": "none"}
    return {"mode": lay.activation_checkpointing}


def _model_out(spec, notes: Notes, expressed: list[str]) -> dict:
    if spec.model.params or spec.model.factory:
        return {}
    shape = spec.model.shape()
    mine = dict(layers=shape.layers, hidden=shape.hidden, heads=shape.heads, kv_heads=shape.kv_heads,
                ffn_hidden=shape.ffn_hidden, vocab=shape.vocab)
    flavor = next((name for name, dims in FLAVORS.items() if dims == mine), None)
    if shape.family != "llama" or flavor is None or shape.tie_embeddings:
        notes.unexpressed("model", spec.model.preset or shape.family, "torchtitan selects a model by name and "
                          f"flavor; no llama3 flavor ({', '.join(FLAVORS)}) has this shape")
        return {}
    if shape.rope_theta != _ROPE_THETA:
        notes.unexpressed("model.rope_theta", shape.rope_theta, f"torchtitan's llama3 flavors use rope_theta="
                          f"{_ROPE_THETA:g}; the {flavor} flavor would train another model")
        return {}
    expressed.append("model")
    return {"name": "llama3", "flavor": flavor}
