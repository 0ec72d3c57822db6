"""DeepSpeed's ds_config.json <-> JobSpec: batch sizes, ZeRO stage and offload, fp16/bf16, clipping, optimizer.

Field names and defaults follow deepspeed/runtime/config.py and zero/config.py (DeepSpeed 0.19).
The data-parallel size is the launcher's world size: a config states it only through
train_batch_size = micro x accumulation x dp.
"""
from __future__ import annotations

import json
import math

from workbench.errors import ConfigError
from workbench.interop.common import (
    ADAM_BETAS,
    ADAM_EPS,
    LOSS_SCALE_WINDOW,
    SGD_MOMENTUM,
    Notes,
    batch_split,
    flatten,
    said,
    scaled,
    set_path,
    unexpressed_fields,
)


def parse(text: str) -> dict:
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"not a DeepSpeed config: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}.") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"a DeepSpeed config is a JSON object, got {type(cfg).__name__}.")
    return cfg


def dump(cfg: dict) -> str:
    return json.dumps(cfg, indent=2) + "\n"


def to_spec(cfg: dict, dp: int | None = None) -> tuple[dict, list[str]]:
    """A ds_config dict -> (raw spec dict, warnings); `dp` is the launcher's data-parallel size if known."""
    notes, flat, raw, used = Notes("deepspeed"), flatten(cfg), {}, set()

    def get(key, default=None):
        """The key's value, DeepSpeed's default when absent, None when 'auto' (the HF Trainer's, named)."""
        used.add(key)
        value = flat.get(key, default)
        if value == "auto":
            if key not in auto:
                notes.unmapped(key, value, "'auto' is filled in by the Hugging Face Trainer at launch; the spec's "
                               "own value stands in")
            auto.add(key)
            return None
        return value

    auto: set[str] = set()

    _batch(get, raw, notes, dp)
    _zero(get, raw, notes)
    _precision(get, raw, notes)
    _optimizer(get, raw, notes, flat)
    clip = get("gradient_clipping", 1.0)  # DeepSpeed 0.19's default (runtime/constants.py) clips at 1.0
    if clip is not None:
        set_path(raw, "train.grad_clip", float(clip))
        if "gradient_clipping" not in flat:
            notes.note("no gradient_clipping: DeepSpeed's default 1.0 applies (train.grad_clip=1.0)")
    _scheduler(get, raw, notes, flat)
    notes.unmapped_rest(flat, used)
    return raw, notes.lines


def _batch(get, raw: dict, notes: Notes, launcher_dp: int | None) -> None:
    """DeepSpeed's own rules (runtime/config.py _configure_train_batch_size): any two of the three give the
    third, one alone takes accumulation 1; dp is the launcher's world size over tp x pp."""
    tb, mb, gas = get("train_batch_size"), get("train_micro_batch_size_per_gpu"), get("gradient_accumulation_steps")
    tb, mb, gas = (int(v) if v is not None else None for v in (tb, mb, gas))
    if tb and mb and gas:
        dp, rest = divmod(tb, mb * gas)
        if rest or not dp:
            raise ConfigError(
                f"DeepSpeed batch sizes disagree: train_batch_size({tb}) must be train_micro_batch_size_per_gpu({mb}) "
                f"x gradient_accumulation_steps({gas}) x the data-parallel size, and {tb} / {mb * gas} is not a whole "
                "number. Fix one of the three.")
        set_path(raw, "layout.dp", dp)
        set_path(raw, "train.global_batch", tb)
        set_path(raw, "train.micro_batch", mb)
        return
    dp = launcher_dp or 1
    if launcher_dp:
        set_path(raw, "layout.dp", launcher_dp)
    elif tb or mb or gas:
        notes.note("the data-parallel size is the launcher's world size and this config does not fix it "
                   "(it needs train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps); "
                   "dp=1 assumed: give it with --set layout.dp=N")
    if tb and not mb:  # DeepSpeed: micro = batch / (accumulation x dp), accumulation 1 when absent
        mb, rest = divmod(tb, (gas or 1) * dp)
        if rest or not mb:
            raise ConfigError(f"DeepSpeed batch sizes disagree: train_batch_size({tb}) / (gradient_accumulation_steps"
                              f"({gas or 1}) x dp({dp})) is not a whole number. Fix the batch, or give the world size "
                              "with --set layout.dp=N.")
    if mb and not tb:
        tb = mb * (gas or 1) * dp
    if not tb and not mb and gas:  # the micro-batch is the script's (or 'auto'): the spec's stands in
        from workbench.spec import TrainSpec

        mb = TrainSpec().micro_batch
        tb = mb * gas * dp
        notes.note(f"train_micro_batch_size_per_gpu is not in this config (the script's DataLoader, or 'auto'); "
                   f"micro_batch={mb} assumed, so global_batch = {mb} x gradient_accumulation_steps({gas}) x dp({dp}) "
                   f"= {tb} (change both with --set)")
    elif not tb and not mb:
        notes.note("no batch size in this config (the training script's, or 'auto'): the spec's default "
                   "global_batch and micro_batch stand in (give them with --set train.global_batch=N)")
        return
    set_path(raw, "train.global_batch", tb)
    set_path(raw, "train.micro_batch", mb)


def _zero(get, raw: dict, notes: Notes) -> None:
    set_path(raw, "layout.zero", get("zero_optimization.stage", 0) or 0)
    opt_dev = get("zero_optimization.offload_optimizer.device", "none") or "none"
    param_dev = get("zero_optimization.offload_param.device", "none") or "none"
    # DeepSpeed's older keys (still read by zero/config.py, deprecated): cpu_offload is offload_optimizer
    # to the CPU, cpu_offload_params offload_param to the CPU.
    if get("zero_optimization.cpu_offload") and opt_dev == "none":
        opt_dev = "cpu"
    if get("zero_optimization.cpu_offload_params") and param_dev == "none":
        param_dev = "cpu"
    device = opt_dev if opt_dev != "none" else param_dev
    if device != "none":
        set_path(raw, "layout.offload", device)
        if param_dev not in ("none", device) or opt_dev not in ("none", device):
            notes.note(f"offload_optimizer.device={opt_dev!r} and offload_param.device={param_dev!r} differ; "
                       f"layout.offload={device!r} puts both where the optimizer state goes")
    paths = {get("zero_optimization.offload_optimizer.nvme_path"), get("zero_optimization.offload_param.nvme_path")} - {None}
    if device == "nvme" and paths:
        set_path(raw, "layout.nvme_path", sorted(paths)[0])
        if len(paths) > 1:
            notes.note(f"two nvme paths {sorted(paths)}; layout.nvme_path={sorted(paths)[0]!r} holds both")


def _precision(get, raw: dict, notes: Notes) -> None:
    fp16, bf16 = get("fp16.enabled", False), get("bf16.enabled", False) or get("bfloat16.enabled", False)
    if fp16 and bf16:
        raise ConfigError("DeepSpeed config enables both fp16 and bf16; keep one (set the other's \"enabled\": false).")
    if bf16:
        set_path(raw, "precision.dtype", "bf16")
    if not fp16:
        return
    set_path(raw, "precision.dtype", "fp16")
    if get("fp16.loss_scale", 0):
        notes.unmapped("fp16.loss_scale", get("fp16.loss_scale"), "a static loss scale; the spec's fp16 scale is dynamic")
    set_path(raw, "precision.initial_loss_scale", float(2 ** get("fp16.initial_scale_power", 16)))
    for key, default, ours in (("loss_scale_window", 1000, LOSS_SCALE_WINDOW), ("hysteresis", 2, 1)):
        value = get(f"fp16.{key}", default)
        if value != ours:
            notes.unmapped(f"fp16.{key}", value, f"the spec's dynamic loss scaler uses {key}={ours}")


def _optimizer(get, raw: dict, notes: Notes, flat: dict) -> None:
    kind = get("optimizer.type")
    if kind is None:
        notes.note("no optimizer block: DeepSpeed uses the optimizer the training script builds; the spec's "
                   "default (adamw, lr 3e-4, no weight decay) stands in, and an export writes no optimizer block unless the spec states one (set train.* with --set)")
        return
    name = {"adam": "adamw" if get("optimizer.params.adam_w_mode", True) else "adam",
            "adamw": "adamw", "sgd": "sgd"}.get(str(kind).lower())
    for key in ("lr", "weight_decay"):  # the same meaning under every optimizer
        if get(f"optimizer.params.{key}") is not None:
            set_path(raw, f"train.{key}", float(flat[f"optimizer.params.{key}"]))
    if name is None:
        notes.unmapped("optimizer.type", kind, "the spec's optimizers are adamw, adam and sgd; adamw used with "
                       "this lr and weight decay")
        return
    set_path(raw, "train.optimizer", name)
    if name == "sgd":
        checks = (("momentum", 0.0, SGD_MOMENTUM),)  # torch.optim.SGD's default momentum is 0
    else:
        checks = (("betas", list(ADAM_BETAS), list(ADAM_BETAS)), ("eps", ADAM_EPS, ADAM_EPS))
    for key, default, ours in checks:
        value = get(f"optimizer.params.{key}", default)
        if value != ours:
            notes.unmapped(f"optimizer.params.{key}", value, f"the spec's {name} uses {key}={ours}")


_SCHEDULERS = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}


def _scheduler(get, raw: dict, notes: Notes, flat: dict) -> None:
    """DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR (runtime/lr_schedules.py) -> train.schedule.

    Theirs: warmup gamma = i / warmup_num_steps (warmup_type linear) from warmup_min_lr (WarmupCosineLR:
    warmup_min_ratio x lr) to the peak; WarmupLR then holds, WarmupDecayLR decays linearly back to
    warmup_min_lr at total_num_steps, WarmupCosineLR decays by cosine to cos_min_ratio x lr.
    """
    kind = get("scheduler.type")
    if kind is None:
        return
    if kind not in _SCHEDULERS:
        notes.unmapped("scheduler.type", kind, "the spec's schedules are DeepSpeed's WarmupLR, WarmupDecayLR and "
                       "WarmupCosineLR; the learning rate stays constant")
        return
    schedule = _SCHEDULERS[kind]
    p = "scheduler.params."
    warmup = get(p + "warmup_num_steps", 1000)
    set_path(raw, "train.schedule", schedule)
    if warmup is not None:
        set_path(raw, "train.warmup_steps", max(2, int(warmup)))  # DeepSpeed warms up at least 2 steps
        if warmup < 2:
            notes.note(f"scheduler.params.warmup_num_steps={warmup}: DeepSpeed uses max(2, it); warmup_steps=2")
    wtype = get(p + "warmup_type", "log")
    if wtype != "linear":
        notes.unmapped(p + "warmup_type", wtype, "the spec's warmup rises linearly; mapped to linear warmup")
    if schedule == "cosine":
        from workbench.spec import TrainSpec

        lr = raw.get("train", {}).get("lr", TrainSpec().lr)  # WarmupCosineLR scales the optimizer's lr
        start = get(p + "warmup_min_ratio", 0.0) or 0.0
        if start:
            notes.unmapped(p + "warmup_min_ratio", start, "the spec's warmup starts from 0; mapped as 0")
        set_path(raw, "train.min_lr", scaled(float(get(p + "cos_min_ratio", 0.0001) or 0.0), lr))
    else:
        peak = get(p + "warmup_max_lr", 0.001 if schedule == "linear" else None)  # their defaults
        if peak is not None:
            optimizer_lr = raw.get("train", {}).get("lr")
            if optimizer_lr is not None and float(peak) != optimizer_lr:
                notes.note(f"scheduler.params.warmup_max_lr={peak} overrides optimizer.params.lr={optimizer_lr} "
                           "as the peak: train.lr takes it")
            set_path(raw, "train.lr", float(peak))
        start = float(get(p + "warmup_min_lr", 0.0) or 0.0)
        if schedule == "linear":
            set_path(raw, "train.min_lr", start)
        if start:
            notes.unmapped(p + "warmup_min_lr", start, "DeepSpeed's warmup starts from it; the spec's starts from "
                           "0" + (" (it is kept as train.min_lr, where the decay ends)" if schedule == "linear" else ""))
    total = get(p + "total_num_steps")
    if flat.get(p + "total_num_steps") == "auto":
        pass  # named as 'auto'
    elif schedule != "constant" and total is not None:
        set_path(raw, "train.steps", int(total))  # the decay ends there: the run's length
    elif schedule != "constant":
        notes.note(f"{kind} without scheduler.params.total_num_steps: the decay ends at train.steps (--set it)")
    else:
        notes.note("WarmupLR holds the rate until the training script stops: the run's length is not in this "
                   "config; give it with --set train.steps=N")
    if schedule == "cosine":  # WarmupLR and WarmupDecayLR at iteration k are ours at step k; this one is not
        notes.note("WarmupCosineLR's decay runs one iteration ahead of the spec's cosine (it counts the first "
                   "decay iteration as 1 and reaches cos_min_ratio at total_num_steps - 1)")


def _scheduler_out(tr, notes: Notes, expressed: list[str]) -> dict | None:
    if tr.schedule == "constant" and not tr.warmup_steps:
        expressed += ["train.schedule", "train.warmup_steps", "train.min_lr"]
        return None
    if tr.schedule == "wsd":
        notes.unexpressed("train.schedule", "wsd", "DeepSpeed's schedulers have no stable-then-decay form; "
                          "no scheduler written (constant learning rate)")
        return None
    params: dict = {"warmup_num_steps": tr.warmup_steps, "warmup_type": "linear"}
    if tr.warmup_steps < 2:
        notes.unexpressed("train.warmup_steps", tr.warmup_steps, "DeepSpeed warms up at least 2 steps "
                          "(max(2, warmup_num_steps))")
    else:
        expressed.append("train.warmup_steps")
    expressed.append("train.schedule")
    if tr.schedule == "cosine":
        params.update(total_num_steps=tr.steps, warmup_min_ratio=0.0, cos_min_ratio=tr.min_lr / tr.lr)
        expressed += ["train.steps", "train.min_lr"]
        return {"type": "WarmupCosineLR", "params": params}
    params.update(warmup_min_lr=0.0, warmup_max_lr=tr.lr)
    if tr.schedule == "constant":
        return {"type": "WarmupLR", "params": params}
    params["total_num_steps"] = tr.steps
    expressed.append("train.steps")
    if tr.min_lr:
        notes.unexpressed("train.min_lr", tr.min_lr, "WarmupDecayLR decays to warmup_min_lr, where its warmup also "
                          "starts; written as 0")
    return {"type": "WarmupDecayLR", "params": params}


def from_spec(spec) -> tuple[dict, list[str]]:
    """A validated JobSpec -> (ds_config dict, warnings)."""
    notes, lay, tr = Notes("deepspeed"), spec.layout, spec.train
    micro, accum = batch_split(spec)
    zero: dict = {"stage": lay.zero}
    if lay.offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
        if lay.zero == 3:
            zero["offload_param"] = {"device": "cpu"}
        else:
            notes.note("layout.offload=cpu also keeps parameters on the host; DeepSpeed offloads parameters "
                       "only with ZeRO-3, so under ZeRO-2 only the optimizer state goes to the CPU")
    elif lay.offload == "nvme" and lay.zero == 3:  # ZeRO-Infinity: parameters and optimizer state in files
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": lay.nvme_path}
        zero["offload_param"] = {"device": "nvme", "nvme_path": lay.nvme_path}
    cfg = {
        "train_batch_size": tr.global_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": tr.grad_clip,
        "zero_optimization": zero,
    }
    if not (said(spec, "train.global_batch") or said(spec, "train.micro_batch")):
        notes.note(f"the spec does not set its batch sizes; DeepSpeed needs them: its defaults are written "
                   f"(train_batch_size {tr.global_batch}, micro {micro}, accumulation {accum}): assumed values")
    expressed = ["train.global_batch", "train.micro_batch", "layout.dp", "train.grad_clip", "layout.zero", "precision"]
    if any(said(spec, f"train.{k}") for k in ("optimizer", "lr", "weight_decay")):
        cfg["optimizer"] = _optimizer_out(tr)
        expressed += ["train.optimizer", "train.lr", "train.weight_decay"]
    else:  # an optimizer block replaces the training script's optimizer: never invented
        notes.note("the spec does not set train.optimizer, lr or weight_decay: no optimizer block is written, so "
                   "DeepSpeed uses the optimizer the training script builds")
    scheduler = _scheduler_out(tr, notes, expressed)
    if scheduler:
        cfg["scheduler"] = scheduler
    if spec.precision.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif spec.precision.dtype == "fp16":
        cfg["fp16"] = _fp16_out(spec.precision.initial_loss_scale, notes)
    if lay.offload == "cpu" or lay.offload == "nvme" and lay.zero == 3:
        expressed += ["layout.offload", "layout.nvme_path"]
    unexpressed_fields(spec, expressed, notes, {
        "layout.offload": "DeepSpeed streams optimizer state and parameters to NVMe only under ZeRO-3 "
                          "(ZeRO-Infinity); use zero=3 with offload=nvme",
        "layout.nvme_path": "DeepSpeed streams optimizer state to NVMe only under ZeRO-3",
        "layout.tp": "tensor parallelism comes from Megatron-DeepSpeed's mpu, not from ds_config",
        "layout.pp": "pipelines are a PipelineModule in the training script, not ds_config",
        "layout.activation_checkpointing": "DeepSpeed checkpoints activations where the model code calls it",
        "model": "a DeepSpeed config does not describe the model",
        "resources": "the hosts come from the launcher's hostfile",
    })
    return cfg, notes.lines


def _optimizer_out(tr) -> dict:
    params: dict = {"lr": tr.lr, "weight_decay": tr.weight_decay}
    if tr.optimizer == "sgd":
        return {"type": "SGD", "params": {**params, "momentum": SGD_MOMENTUM}}
    params.update(betas=list(ADAM_BETAS), eps=ADAM_EPS)
    if tr.optimizer == "adam":  # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false
        return {"type": "Adam", "params": {**params, "adam_w_mode": False}}
    return {"type": "AdamW", "params": params}


def _fp16_out(initial_scale: float, notes: Notes) -> dict:
    power = math.log2(initial_scale)
    if power != round(power):
        notes.unexpressed("precision.initial_loss_scale", initial_scale,
                          f"DeepSpeed takes a power of two (initial_scale_power); exported as 2**{round(power)}")
    return {"enabled": True, "loss_scale": 0, "initial_scale_power": int(round(power)),
            "loss_scale_window": LOSS_SCALE_WINDOW, "hysteresis": 1}
