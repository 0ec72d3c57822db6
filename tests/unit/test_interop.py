"""Configs of DeepSpeed, Accelerate, Megatron-LM and torchtitan in and out (workbench/interop, docs/interop.md).

Round trips both ways, the exports checked by the engines' own config code where it installs on a
CPU machine (DeepSpeed's DeepSpeedConfig, Accelerate's launcher and plugin dataclasses) and by
Megatron-LM's argument names read from its source, and the CLI's warnings and exit codes.
"""
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from tests.helpers.cli import run_cli
from tests.helpers.environ import keep_environ  # noqa: F401 (autouse)
from workbench.errors import ConfigError
from workbench.interop import common, detect_format, export_config, import_config, import_text
from workbench.interop import megatron as meg_mod
from workbench.interop import torchtitan as tt_mod
from workbench.spec import load_spec

FIXTURES = Path(__file__).parent.parent / "fixtures" / "interop"
DEBUG_LLAMA = dict(tt_mod.FLAVORS["debugmodel"], family="llama", seq_len=64, tie_embeddings=False, rope_theta=500000.0)


def spec(layout: dict, dtype: str = "fp32", **sections):
    raw = {"layout": layout, "precision": {"dtype": dtype}, **sections}
    if dtype == "fp16":
        raw["precision"]["initial_loss_scale"] = 4096.0
    return load_spec(raw)


def assert_same_job(a, b):
    """Equal specs; a preset and the explicit shape it resolves to are the same model."""
    da, db = a.to_dict(), b.to_dict()
    ma, mb = da.pop("model"), db.pop("model")
    assert da == db
    if ma != mb:
        assert a.model.shape() == b.model.shape()


def round_trip(original, engine: str):
    text, out_warnings = export_config(original, engine)
    back, in_warnings = import_text(text, engine)
    assert_same_job(original, back)
    return text, out_warnings, in_warnings


# -- ours -> theirs -> ours, for every layout each engine can say ---------------------------------

TRAIN = [{"optimizer": "adamw", "weight_decay": 0.1, "grad_clip": 1.0, "global_batch": 32, "micro_batch": 2},
         {"optimizer": "adam", "lr": 1e-3}, {"optimizer": "sgd", "lr": 0.05, "grad_clip": 0.5}]
DS_LAYOUTS = [{"dp": 1}, {"dp": 2}, {"dp": 2, "zero": 1}, {"dp": 2, "zero": 2}, {"dp": 4, "zero": 3},
              {"dp": 2, "zero": 2, "offload": "cpu"}, {"dp": 2, "zero": 3, "offload": "cpu"}]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("layout", DS_LAYOUTS, ids=str)
def test_deepspeed_round_trip(layout, dtype):
    train = TRAIN[DS_LAYOUTS.index(layout) % len(TRAIN)]
    _, out_w, in_w = round_trip(spec(layout, dtype, train=train), "deepspeed")
    assert not [w for w in in_w if "not mapped" in w]


ACC_LAYOUTS = [{"dp": 1}, {"dp": 2}, {"dp": 2, "zero": 1}, {"dp": 2, "zero": 2}, {"dp": 4, "zero": 3},
               {"dp": 2, "zero": 3, "offload": "cpu", "activation_checkpointing": "full"},
               {"dp": 2, "zero": 2, "offload": "cpu"}, {"dp": 2, "zero": 2, "tp": 2}]


# Clipping is said only by the DeepSpeed plugin (ZeRO >= 1, no activation checkpointing, no tp).
ACC_CASES = [(lay, clip) for lay in ACC_LAYOUTS for clip in (0.0, 1.0)
             if not clip or (lay.get("zero", 0) >= 1 and "activation_checkpointing" not in lay and "tp" not in lay)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("layout,clip", ACC_CASES, ids=str)
def test_accelerate_round_trip(layout, dtype, clip):
    # Accelerate's fp16 scaler starts at torch's 2**16, so the spec keeps that default here.
    raw = {"layout": layout, "precision": {"dtype": dtype}, "train": {"grad_clip": clip}}
    round_trip(load_spec(raw), "accelerate")


def test_accelerate_round_trip_over_machines():
    round_trip(spec({"dp": 4}, resources={"nodes": 2}), "accelerate")


MEG_LAYOUTS = [{"dp": 2}, {"dp": 2, "zero": 1}, {"dp": 2, "zero": 2}, {"dp": 2, "zero": 3},
               {"tp": 2, "sequence_parallel": True}, {"pp": 2}, {"pp": 2, "pp_schedule": "interleaved-1f1b"},
               {"dp": 2, "tp": 2, "pp": 2}, {"dp": 2, "activation_checkpointing": "full"},
               {"dp": 2, "activation_checkpointing": "selective"}]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("layout", MEG_LAYOUTS, ids=str)
def test_megatron_round_trip(layout, dtype):
    train = {**TRAIN[MEG_LAYOUTS.index(layout) % 3], "seed": 7}
    if train["optimizer"] == "adam":
        train["optimizer"] = "adamw"  # Megatron's adam is AdamW (checked below)
    model = {"preset": "llama-7b"} if layout.get("activation_checkpointing") else {"preset": "gpt-tiny"}
    _, out_w, in_w = round_trip(spec(layout, dtype, train=train, model=model,
                                     checkpoint={"every_steps": 5, "uri": "/ckpt/run"}), "megatron")
    assert not out_w and not [w for w in in_w if "not mapped" in w]


def test_megatron_round_trip_over_nodes():
    round_trip(spec({"dp": 2, "tp": 2, "pp": 2}, resources={"nodes": 2}), "megatron")


TT_LAYOUTS = [{"dp": 1}, {"dp": 2}, {"dp": 2, "zero": 2}, {"dp": 2, "zero": 3, "offload": "cpu"},
              {"tp": 2, "sequence_parallel": True}, {"pp": 2}, {"pp": 2, "pp_schedule": "gpipe"},
              {"pp": 2, "pp_schedule": "interleaved-1f1b", "virtual_stages": 3},
              {"pp": 2, "pp_schedule": "zero-bubble", "virtual_stages": 3},
              {"dp": 2, "activation_checkpointing": "full"},
              {"dp": 2, "zero": 3, "activation_checkpointing": "full", "checkpoint_every": 3}]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", TT_LAYOUTS, ids=str)
def test_torchtitan_round_trip(layout, dtype):
    train = {**TRAIN[TT_LAYOUTS.index(layout) % 2], "seed": 3}
    text, out_w, in_w = round_trip(spec(layout, dtype, train=train, model=DEBUG_LLAMA,
                                        checkpoint={"every_steps": 5, "uri": "./ckpt/x", "keep": 2}), "torchtitan")
    assert not out_w and not [w for w in in_w if "not mapped" in w]
    assert tomllib.loads(text)["model"] == {"name": "llama3", "flavor": "debugmodel"}


def test_llama3_flavor_widths_match_torchtitans_formula():
    assert [tt_mod.FLAVORS[f]["ffn_hidden"] for f in ("debugmodel", "8B", "70B", "405B")] == [768, 14336, 28672, 53248]


# Learning-rate schedules (workbench/schedule.py) each engine can say, with warmup and min_lr.
SCHEDULES = [{"schedule": "constant", "warmup_steps": 10}, {"schedule": "linear", "warmup_steps": 10},
             {"schedule": "linear", "warmup_steps": 10, "min_lr": 1e-4}, {"schedule": "cosine", "warmup_steps": 10, "min_lr": 1e-4},
             {"schedule": "cosine", "min_lr": 3e-5}, {"schedule": "wsd", "warmup_steps": 10, "min_lr": 1e-5},
             {"schedule": "linear"}, {"schedule": "wsd"}]
CAN_SAY = {"deepspeed": lambda t: t["schedule"] != "wsd" and t.get("warmup_steps", 0) >= 2
           and (t["schedule"] != "linear" or not t.get("min_lr")),
           "megatron": lambda t: True, "torchtitan": lambda t: True}


@pytest.mark.parametrize("engine", list(CAN_SAY))
@pytest.mark.parametrize("sched", SCHEDULES, ids=str)
def test_schedule_round_trip(engine, sched):
    train = {"lr": 1e-3, "optimizer": "adamw", **sched}
    if engine != "deepspeed" or sched["schedule"] != "constant":  # DeepSpeed says the length only by a decay's end
        train["steps"] = 100
    model = DEBUG_LLAMA if engine == "torchtitan" else {"preset": "gpt-tiny"}  # DeepSpeed's export has no model
    original = spec({"dp": 2}, "bf16", train=train, model=model)
    text, out_w = export_config(original, engine)
    if not CAN_SAY[engine](sched):  # the nearest is written and the difference named
        assert any(w.startswith("spec train.") for w in out_w), out_w
        return
    assert not [w for w in out_w if w.startswith("spec train.")], out_w
    back, in_w = import_text(text, engine)
    if engine == "deepspeed":
        assert back.train == original.train
    else:
        assert_same_job(original, back)
    assert not [w for w in in_w if "not mapped" in w], in_w


@pytest.mark.parametrize("params,expect,warned", [
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 20, "warmup_type": "linear", "warmup_max_lr": 1e-3}},
     ("constant", 20, 0.0, 1000), []),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 20, "warmup_min_lr": 1e-5}}, ("constant", 20, 0.0, 1000),
     ["scheduler.params.warmup_type", "scheduler.params.warmup_min_lr"]),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 300, "warmup_num_steps": 30, "warmup_type": "linear",
                                           "cos_min_ratio": 0.1}}, ("cosine", 30, 1e-4, 300), []),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 300, "warmup_min_ratio": 0.1, "warmup_type": "linear",
                                           "warmup_num_steps": 30}}, ("cosine", 30, 1e-7, 300), ["scheduler.params.warmup_min_ratio"]),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4}}, ("constant", 0, 0.0, 1000),
     ["scheduler.type", "scheduler.params.cycle_min_lr"]),
])
def test_deepspeed_schedulers(params, expect, warned):
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "scheduler": params}
    s, warnings = import_text(json.dumps(cfg), "deepspeed", overrides=["train.steps=1000"]
                              if params["type"] == "WarmupLR" or params["type"] == "OneCycle" else None)
    assert (s.train.schedule, s.train.warmup_steps, s.train.min_lr, s.train.steps) == expect
    assert sorted(re.findall(r"key '([^']+)'", " ".join(w for w in warnings if "not mapped" in w))) == sorted(warned)
    if not warned:  # theirs -> ours -> theirs keeps the scheduler
        back = json.loads(export_config(s, "deepspeed")[0])["scheduler"]
        assert back["type"] == params["type"]
        assert {k: back["params"][k] for k in params["params"]} == pytest.approx(params["params"])


@pytest.mark.parametrize("flags,expect,warned", [
    ("--lr-decay-style WSD --lr-wsd-decay-style linear --lr-wsd-decay-iters 40 --min-lr 1e-5 --lr-warmup-iters 10",
     ("wsd", 10, 1e-5), []),
    ("--lr-decay-style WSD --lr-wsd-decay-iters 50", ("wsd", 0, 0.0), ["--lr-wsd-decay-style", "--lr-wsd-decay-iters"]),
    ("--lr-warmup-iters 5", ("linear", 5, 0.0), []),  # Megatron's default style is linear
    ("--lr-decay-style inverse-square-root", ("constant", 0, 0.0), ["--lr-decay-style"]),
    ("--lr-decay-style cosine --lr-decay-iters 150 --lr-warmup-init 1e-6 --lr-warmup-iters 5", ("cosine", 5, 0.0),
     ["--lr-decay-iters", "--lr-warmup-init"]),
])
def test_megatron_schedules(flags, expect, warned):
    s, warnings = import_text(f"pretrain_gpt.py --micro-batch-size 1 --train-iters 200 --lr 1e-3 {flags}", "megatron")
    assert (s.train.schedule, s.train.warmup_steps, s.train.min_lr) == expect
    assert sorted(re.findall(r"key '([^']+)'", " ".join(w for w in warnings if "not mapped" in w))) == sorted(warned)


@pytest.mark.parametrize("section,expect,warned", [
    ("warmup_steps = 0\ndecay_ratio = 0.0", ("constant", 0, 0.0), []),
    ("warmup_steps = 5\ndecay_type = \"cosine\"\nmin_lr_factor = 0.1", ("cosine", 5, 1e-4), []),
    ("warmup_steps = 5\ndecay_ratio = 0.2", ("wsd", 5, 0.0), []),
    ("warmup_steps = 5\ndecay_ratio = 0.5\ndecay_type = \"sqrt\"", ("wsd", 5, 0.0),
     ["lr_scheduler.decay_ratio", "lr_scheduler.decay_type"]),
])
def test_torchtitan_schedules(section, expect, warned):
    s, warnings = import_text(f"[training]\nsteps = 100\n[optimizer]\nlr = 1e-3\nbeta2 = 0.999\n[lr_scheduler]\n{section}\n",
                              "torchtitan")
    assert (s.train.schedule, s.train.warmup_steps, s.train.min_lr) == expect
    assert sorted(set(re.findall(r"key '([^']+)'", " ".join(w for w in warnings if "not mapped" in w)))) == sorted(warned)
    if not warned:
        back = tomllib.loads(export_config(s, "torchtitan")[0])["lr_scheduler"]
        original = tomllib.loads(f"[s]\n{section}\n")["s"]
        assert {k: back[k] for k in original} == pytest.approx(original)


# -- what cannot be said is named, never dropped ------------------------------------------------

def test_exports_name_what_the_engine_cannot_express():
    s = spec({"dp": 2, "pp": 2, "zero": 1, "offload": "nvme"}, train={"optimizer": "sgd"})
    _, w = export_config(s, "deepspeed")
    assert any(x.startswith("spec layout.pp = 2 not exported") for x in w)
    assert any(x.startswith("spec layout.offload = 'nvme' not exported") for x in w)
    _, w = export_config(s, "torchtitan")
    assert any(x.startswith("spec layout.zero = 1 not exported") for x in w)
    assert any(x.startswith("spec train.optimizer = 'sgd' not exported") for x in w)
    assert any(x.startswith("spec model = 'gpt-tiny' not exported") for x in w)
    _, w = export_config(spec({"dp": 2, "tp": 2}), "accelerate")  # Accelerate's ParallelismConfig refuses DDP + tp
    assert any(x.startswith("spec layout.tp = 2 not exported") for x in w)
    _, w = export_config(spec({"dp": 2, "activation_checkpointing": "full", "checkpoint_every": 2}), "megatron")
    assert any(x.startswith("spec layout.activation_checkpointing = 'full' not exported") for x in w)
    _, w = export_config(spec({"dp": 2, "activation_checkpointing": "selective"}), "torchtitan")
    assert any(x.startswith("spec layout.activation_checkpointing = 'selective' not exported") for x in w)


# -- theirs -> ours -> theirs keeps every mapped key ----------------------------------------------

def test_deepspeed_zero3_offload_bf16_config_round_trip():
    original = json.loads((FIXTURES / "ds_zero3_offload_bf16.json").read_text())
    s, warnings = import_config(FIXTURES / "ds_zero3_offload_bf16.json")
    assert (s.layout.dp, s.layout.zero, s.layout.offload, s.precision.dtype) == (8, 3, "cpu", "bf16")
    assert (s.train.global_batch, s.train.micro_batch, s.train.lr, s.train.weight_decay) == (256, 4, 2e-4, 0.1)
    # WarmupDecayLR maps (linear decay to warmup_min_lr at total_num_steps); its default log warmup is named.
    assert (s.train.schedule, s.train.warmup_steps, s.train.min_lr, s.train.steps) == ("linear", 500, 0.0, 10000)
    assert not any("'scheduler.type'" in w for w in warnings)
    for key in ("scheduler.params.warmup_type", "steps_per_print", "zero_optimization.overlap_comm",
                "zero_optimization.offload_param.pin_memory"):
        assert sum(f"'{key}'" in w for w in warnings) == 1, key
    back = json.loads(export_config(s, "deepspeed")[0])
    assert back["scheduler"] == {"type": "WarmupDecayLR",
                                 "params": {**original["scheduler"]["params"], "warmup_type": "linear"}}
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping", "bf16", "optimizer"):
        assert back[key] == original[key], key
    zero = original["zero_optimization"]
    assert back["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": zero["offload_optimizer"]["device"]},
                                         "offload_param": {"device": zero["offload_param"]["device"]}}


@pytest.mark.parametrize("name", ["accelerate_fsdp.yaml", "accelerate_deepspeed.yaml"])
def test_accelerate_configs_round_trip(name):
    original = yaml.safe_load((FIXTURES / name).read_text())
    s, warnings = import_config(FIXTURES / name, overrides=["resources.gpu=a100-80gb"])  # use_cpu: false
    back = yaml.safe_load(export_config(s, "accelerate")[0])
    for key in ("distributed_type", "mixed_precision", "num_machines", "num_processes", "use_cpu"):
        assert back[key] == original[key], key
    if name == "accelerate_fsdp.yaml":
        assert (s.layout.dp, s.layout.zero, s.layout.activation_checkpointing, s.resources.nodes) == (16, 3, "full", 2)
        for key in ("fsdp_version", "fsdp_reshard_after_forward", "fsdp_offload_params", "fsdp_activation_checkpointing",
                    "fsdp_auto_wrap_policy", "fsdp_state_dict_type"):
            assert back["fsdp_config"][key] == original["fsdp_config"][key], key
        assert any("'fsdp_config.fsdp_transformer_layer_cls_to_wrap'" in w for w in warnings)
        assert any("'main_process_ip'" in w for w in warnings)
    else:  # ZeRO-2 with the optimizer offloaded to the CPU is FSDP2's offload here
        assert (s.layout.zero, s.layout.offload, s.train.grad_clip, s.precision.dtype) == (2, "cpu", 1.0, "fp16")
        assert back["deepspeed_config"] == original["deepspeed_config"]


@pytest.mark.parametrize("fsdp,zero,warned", [
    ({"fsdp_version": 1, "fsdp_sharding_strategy": "FULL_SHARD"}, 3, False),
    ({"fsdp_version": 1, "fsdp_reshard_after_forward": "SHARD_GRAD_OP"}, 2, False),
    ({"fsdp_version": 1, "fsdp_sharding_strategy": "HYBRID_SHARD"}, 3, True),
    ({"fsdp_version": 2, "fsdp_reshard_after_forward": False}, 2, False),
])
def test_accelerate_fsdp1_and_fsdp2_sharding_names(fsdp, zero, warned):
    cfg = {"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": fsdp}
    s, warnings = import_text(yaml.safe_dump(cfg), "accelerate")
    assert s.layout.zero == zero
    assert any("hybrid sharding" in w for w in warnings) == warned


def test_megatron_gpt3_command_line_keeps_the_tie_under_pp_and_maps_with_overrides():
    path = FIXTURES / "megatron_gpt3_175b.sh"  # NVIDIA/Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh
    tied, _ = import_config(path)  # Megatron ties embedding and head; pp=16 keeps the tie (parallel/tied.py)
    assert tied.model.shape().tie_embeddings and tied.layout.pp == 16
    s, warnings = import_config(path, overrides=["resources.nodes=16", "resources.gpus_per_node=8"])
    assert (s.layout.tp, s.layout.pp, s.train.micro_batch, s.train.global_batch) == (8, 16, 1, 1536)
    assert (s.precision.dtype, s.precision.initial_loss_scale, s.train.weight_decay) == ("fp16", 2.0**32, 0.1)
    shape = s.model.shape()
    assert (shape.layers, shape.hidden, shape.heads, shape.seq_len, shape.vocab) == (96, 12288, 96, 2048, 51200)
    # cosine to --min-lr after 0.001 x 430000 warmup iterations; decaying over 430000 of 500000 iterations is named.
    assert (s.train.schedule, s.train.min_lr, s.train.warmup_steps) == ("cosine", 6e-6, 430)
    assert not any(f"'{flag}'" in w for w in warnings for flag in ("--lr-decay-style", "--min-lr", "--lr-warmup-fraction"))
    for flag in ("--lr-decay-iters", "--adam-beta2", "--loss-scale-window", "--data-path", "--attention-backend"):
        assert sum(f"'{flag}'" in w for w in warnings) == 1, flag
    back = meg_mod.parse(export_config(s, "megatron")[0])
    original = meg_mod.parse(path.read_text())
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size",
                 "--global-batch-size", "--train-iters", "--num-layers", "--hidden-size", "--num-attention-heads",
                 "--seq-length", "--max-position-embeddings", "--fp16", "--save-interval", "--lr-decay-style",
                 "--min-lr"):
        assert back[flag] == original[flag] or float(back[flag]) == float(original[flag]), flag
    assert back["--lr-warmup-iters"] == "430" and back["--lr-decay-iters"] == "500000"
    assert float(back["--lr"]) == 6e-5 and float(back["--weight-decay"]) == 0.1 and float(back["--clip-grad"]) == 1.0


def test_megatron_llama3_8b_script_with_quoted_flags():
    path = FIXTURES / "megatron_llama3_8b.sh"  # NVIDIA/Megatron-LM examples/llama/train_llama3_8b_h100_fp8.sh
    s, warnings = import_config(path)
    shape = s.model.shape()
    assert (shape.family, shape.layers, shape.kv_heads, shape.ffn_hidden, shape.vocab) == ("llama", 32, 8, 14336, 128256)
    assert (s.layout.dp, s.layout.zero, s.layout.sequence_parallel, s.precision.dtype) == (8, 1, False, "bf16")
    assert any("'--fp8-format' = 'hybrid'" in w for w in warnings)


def test_torchtitan_llama3_8b_toml_round_trip():
    path = FIXTURES / "torchtitan_llama3_8b.toml"  # pytorch/torchtitan e347b1e, models/llama3/train_configs
    s, warnings = import_config(path, overrides=["layout.dp=64"])
    assert (s.layout.dp, s.layout.zero, s.precision.dtype, s.train.micro_batch, s.train.global_batch) == (64, 3, "bf16", 1, 64)
    assert s.model.shape().ffn_hidden == 14336 and s.model.shape().seq_len == 8192
    assert any("'activation_checkpoint.selective_ac_option' = 'op'" in w for w in warnings)
    assert any("'optimizer.beta2' = 0.95" in w for w in warnings)  # torchtitan's default, ours is 0.999
    assert not any("'checkpoint." in w for w in warnings)  # checkpointing is off: its keys are inert
    # [lr_scheduler] warmup_steps = 200 and torchtitan's defaults: linear decay to 0 after the warmup.
    assert (s.train.schedule, s.train.warmup_steps, s.train.min_lr) == ("linear", 200, 0.0)
    assert not any("'lr_scheduler" in w for w in warnings)
    back = tomllib.loads(export_config(s, "torchtitan")[0])
    original = tomllib.loads(path.read_text())
    for section, key in (("model", "name"), ("model", "flavor"), ("optimizer", "lr"), ("optimizer", "eps"),
                         ("training", "local_batch_size"), ("training", "seq_len"), ("training", "max_norm"),
                         ("training", "steps"), ("parallelism", "tensor_parallel_degree"),
                         ("parallelism", "pipeline_parallel_degree"), ("parallelism", "data_parallel_replicate_degree"),
                         ("lr_scheduler", "warmup_steps")):
        assert back[section][key] == original[section][key], (section, key)
    assert back["parallelism"]["data_parallel_shard_degree"] == 64


# -- the engines' own validation ------------------------------------------------------------------



@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("layout", DS_LAYOUTS, ids=str)
def test_deepspeed_parses_the_export(layout, dtype, monkeypatch):
    from deepspeed.runtime import config as ds_config

    s = spec(layout, dtype, train={"global_batch": 32, "micro_batch": 2, "grad_clip": 1.0, "optimizer": "adamw"})
    cfg = json.loads(export_config(s, "deepspeed")[0])
    # DeepSpeed reads the data-parallel world size from its launcher's process group.
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: s.layout.dp)
    ds = ds_config.DeepSpeedConfig(cfg)
    assert (ds.train_batch_size, ds.gradient_accumulation_steps, ds.zero_optimization_stage) == (32, 32 // (2 * s.layout.dp), s.layout.zero)
    assert ds.gradient_clipping == 1.0 and ds.optimizer_name == "adamw"
    offload = ds.zero_config.offload_optimizer
    assert (offload.device if offload else "none") == s.layout.offload
    if dtype == "fp16":
        assert ds.float16_config.enabled and ds.float16_config.initial_scale_power == 12


@pytest.mark.parametrize("sched,min_lr", [("constant", 0.0), ("linear", 0.0), ("cosine", 1e-4)])
def test_deepspeeds_schedulers_run_the_exported_curve(sched, min_lr):
    """DeepSpeed's own scheduler, built from the export, gives our rate at iteration k = step k."""
    import torch
    from deepspeed.runtime import lr_schedules

    from workbench.schedule import lr_curve

    s = load_spec({"train": {"lr": 1e-3, "steps": 40, "schedule": sched, "warmup_steps": 8, "min_lr": min_lr}})
    cfg = json.loads(export_config(s, "deepspeed")[0])["scheduler"]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=s.train.lr)
    scheduler = getattr(lr_schedules, cfg["type"])(opt, **cfg["params"])
    theirs = []
    for k in range(1, 41):
        scheduler.step(k)
        theirs.append(opt.param_groups[0]["lr"])
    ours = lr_curve(s.train)
    if sched == "cosine":  # the same warmup ramp; the decay one iteration ahead (named in a note on import)
        assert theirs[:7] == pytest.approx(ours[:7]) and theirs[7:-1] == pytest.approx(ours[8:])
    else:
        assert theirs == pytest.approx(ours, abs=1e-12)


@pytest.mark.parametrize("layout", ACC_LAYOUTS, ids=str)
def test_accelerate_launcher_reads_the_export(layout, tmp_path, monkeypatch):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    s = spec(layout, "bf16", train={"grad_clip": 1.0})
    path = tmp_path / "accelerate.yaml"
    path.write_text(export_config(s, "accelerate")[0])
    cluster = ClusterConfig.from_yaml_file(str(path))  # unknown top-level keys raise here
    assert cluster.num_processes == s.layout.dp * s.layout.tp
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "train.py"]))
    if s.layout.tp > 1:
        from accelerate.parallelism_config import ParallelismConfig

        sizes = {k.removeprefix("parallelism_config_"): v for k, v in cluster.parallelism_config.items()}
        assert ParallelismConfig(**sizes).tp_size == s.layout.tp
    if cluster.distributed_type.value == "FSDP":
        from accelerate.utils import FullyShardedDataParallelPlugin

        for key, value in prepare_multi_gpu_env(args).items():
            monkeypatch.setenv(key, value)
        plugin = FullyShardedDataParallelPlugin()
        assert plugin.fsdp_version == 2 and plugin.reshard_after_forward == (s.layout.zero == 3)
        assert bool(plugin.cpu_offload.__class__.__name__ == "CPUOffloadPolicy") == (s.layout.offload == "cpu")
    if cluster.distributed_type.value == "DEEPSPEED":
        from accelerate.utils import DeepSpeedPlugin

        ds = cluster.deepspeed_config
        plugin = DeepSpeedPlugin(zero_stage=ds["zero_stage"], gradient_accumulation_steps=ds["gradient_accumulation_steps"],
                                 gradient_clipping=ds["gradient_clipping"], offload_optimizer_device=ds["offload_optimizer_device"],
                                 offload_param_device=ds["offload_param_device"], zero3_init_flag=ds["zero3_init_flag"])
        assert plugin.deepspeed_config["zero_optimization"]["stage"] == s.layout.zero


def test_megatron_flags_are_megatrons():
    """Every flag written or read is in Megatron-LM's parser (names read from its source, cited in the file)."""
    names = {line.strip() for line in (FIXTURES / "megatron_arg_names.txt").read_text().splitlines()
             if line.startswith("--")}
    old_names = {line.strip() for line in (FIXTURES / "megatron_old_arg_names.txt").read_text().splitlines()
                 if line.startswith("--")}
    written = set()
    for layout in MEG_LAYOUTS:
        for dtype in ("bf16", "fp16"):
            args = export_config(spec(layout, dtype, checkpoint={"every_steps": 5, "uri": "/c"}), "megatron")[0]
            written |= {k for k in meg_mod.parse(args) if k not in meg_mod._LAUNCHER}
    written |= {k for k in meg_mod.parse(export_config(spec({"dp": 2}, train={"optimizer": "sgd"}), "megatron")[0])}
    assert written - meg_mod._LAUNCHER <= names, sorted(written - names)
    read = set(re.findall(r'"(--[a-z0-9_]+(?:-[a-z0-9_]+)*)"', inspect.getsource(meg_mod))) - meg_mod._LAUNCHER - meg_mod._SWITCHES
    assert read <= names | old_names, sorted(read - names - old_names)  # older names are only read, never written


# -- formats, parsing, constants ------------------------------------------------------------------

@pytest.mark.parametrize("name,engine", [("ds_zero3_offload_bf16.json", "deepspeed"), ("accelerate_fsdp.yaml", "accelerate"),
                                         ("megatron_gpt3_175b.sh", "megatron"), ("torchtitan_llama3_8b.toml", "torchtitan")])
def test_format_is_detected_from_the_content(name, engine):
    assert detect_format((FIXTURES / name).read_text()) == engine


def test_unknown_format_asks_for_format():
    with pytest.raises(ConfigError, match="--format"):
        detect_format("just words")


def test_toml_writer_round_trips_through_tomllib():
    cfg = {"a": {"s": 'quote " and \\ slash', "i": 3, "f": 1e-8, "b": True, "l": ["x", "y"], "neg": -2.5}}
    assert tomllib.loads(tt_mod.dump(cfg)) == cfg


def test_megatron_parser_reads_bash_arrays_and_simple_variables():
    args = meg_mod.parse("GPUS=4\nA=(\n  --micro-batch-size 2 # two\n  --bf16\n)\n"
                         "torchrun --nproc_per_node $GPUS pretrain_gpt.py ${A[@]} --lr=1e-4 --seq-length 128 \\\n --swiglu")
    assert args == {"--micro-batch-size": "2", "--bf16": True, "--nproc_per_node": "4", "--lr": "1e-4",
                    "--seq-length": "128", "--swiglu": True}
    # Megatron-LM's llama examples quote each flag with its value, and arrays may end on a switch.
    args = meg_mod.parse('ARGS=(\n  "--num-layers 32"\n  "--tokenizer-type NullTokenizer"\n  --no-rope-fusion\n)\n'
                         "torchrun pretrain_gpt.py ${ARGS[@]}")
    assert args == {"--num-layers": "32", "--tokenizer-type": "NullTokenizer", "--no-rope-fusion": True}


def test_warnings_never_show_secret_values():
    _, warnings = import_text("torchrun pretrain_gpt.py --micro-batch-size 2 --wandb-api-key s3cr3t "
                              "--hf-token hf_abc", "megatron")
    assert any("'--wandb-api-key' = '<redacted>'" in w for w in warnings)
    assert not any("s3cr3t" in w or "hf_abc" in w for w in warnings)


def test_a_refusal_carries_the_assumptions_that_led_to_it():
    # No world size on the command line: dp=1 is assumed, and the batch sizes then disagree.
    with pytest.raises(ConfigError, match="(?s)refuses: .*global_batch.*note: .*--set layout.dp=N"):
        import_text("pretrain_gpt.py --micro-batch-size 4 --global-batch-size 6", "megatron")


def test_a_job_that_cannot_run_as_imported_says_why():
    # No world size in the file: dp=1 is assumed, and ZeRO-3 on one rank can be planned, not run.
    s, warnings = import_text("[parallelism]\ndata_parallel_shard_degree = -1\n", "torchtitan")
    assert s.layout.zero == 3
    assert any(w.startswith("torchtitan: the imported job can be planned but not run") and "single rank" in w
               for w in warnings)


def test_batch_sizes_that_disagree_are_a_config_error():
    with pytest.raises(ConfigError, match="train_batch_size\\(30\\)"):
        import_text('{"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}')


def test_constants_match_the_runtime():
    from workbench.parallel import step
    from workbench.parallel.precision import DynamicLossScaler

    assert (common.ADAM_BETAS, common.ADAM_EPS, common.SGD_MOMENTUM) == (step.BETAS, step.EPS, step.SGD_MOMENTUM)
    params = inspect.signature(DynamicLossScaler).parameters
    assert params["growth_interval"].default == common.LOSS_SCALE_WINDOW
    assert (params["growth_factor"].default, params["backoff_factor"].default) == (2.0, 0.5)


def test_interop_imports_no_torch():
    code = ("import sys, workbench.interop as i, workbench.interop.deepspeed, workbench.interop.accelerate, "
            "workbench.interop.megatron, workbench.interop.torchtitan; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# -- the CLI --------------------------------------------------------------------------------------

cli = run_cli  # `workbench ARGS` in this process (tests/helpers/cli.py)


def test_cli_import_writes_a_spec_and_names_each_unmapped_key(tmp_path):
    out = tmp_path / "job.yaml"
    proc = cli("import", FIXTURES / "ds_zero3_offload_bf16.json", "-o", out)
    assert proc.returncode == 0, proc.stderr
    s = load_spec(out)
    assert (s.name, s.layout.zero, s.layout.dp) == ("ds-zero3-offload-bf16", 3, 8)
    lines = proc.stderr.splitlines()
    assert all(line.startswith("warning: ") for line in lines)
    assert sum("'zero_optimization.stage3_max_live_parameters'" in line for line in lines) == 1


def test_cli_export_config_prints_the_engines_config():
    proc = cli("export-config", "examples/quickstart.yaml", "--to", "torchtitan", "--set", "layout.zero=3")
    assert proc.returncode == 0, proc.stderr
    cfg = tomllib.loads(proc.stdout)
    assert cfg["parallelism"]["data_parallel_shard_degree"] == 2
    assert "warning: spec model = 'gpt-tiny' not exported" in proc.stderr


@pytest.mark.parametrize("content,message", [
    ('{"train_batch_size": ', "invalid JSON"),
    ("[parallelism\nx=", "invalid TOML"),
    ("distributed_type: [FSDP", "invalid YAML"),
    ('torchrun pretrain_gpt.py --lr "1e-4', "unbalanced quotes"),
])
def test_cli_import_refuses_ill_formed_input_with_exit_2(tmp_path, content, message):
    path = tmp_path / "bad.cfg"
    path.write_text(content)
    fmt = {"{": "deepspeed", "[": "torchtitan", "d": "accelerate", "t": "megatron"}[content[0]]
    proc = cli("import", path, "--format", fmt)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("engine,content", [
    ("deepspeed", '{"train_batch_size": "many", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}'),
    ("accelerate", "distributed_type: FSDP\nnum_processes: eight\n"),
    ("megatron", "torchrun pretrain_gpt.py --tensor-model-parallel-size two"),
    ("torchtitan", "[parallelism]\ntensor_parallel_degree = \"two\"\n"),
    ("deepspeed", '{"zero_optimization": {"stage": "three"}}'),
])
def test_values_of_the_wrong_type_are_a_config_error(engine, content):
    with pytest.raises(ConfigError, match="(wrong type|expected a int|refuses)"):
        import_text(content, engine)


def test_cli_import_of_a_missing_file_exits_2(tmp_path):
    proc = cli("import", tmp_path / "nope.json")
    assert proc.returncode == 2 and "cannot read config" in proc.stderr


def test_megatron_script_arithmetic_is_bash_64_bit_and_bounded(tmp_path):
    """`$((2**2**2**2**3))` hung the importer (found from outside): bash wraps at 64 bits, and so do we."""
    from workbench.interop.shell import _arith

    assert [_arith(e) for e in ("2**2**2**2**3", "-7/2", "-7%2", "2**63", "9223372036854775807+1", "(1+2)*3")] == \
        [1, -3, -1, -2**63, -2**63, 9]
    script = tmp_path / "a.sh"
    script.write_text("GPUS=$((2**2**2**2**3))\nNL=$(( (4+4) * 3 ))\n"
                      "torchrun --nproc_per_node $GPUS pretrain_gpt.py --num-layers $NL --hidden-size 64 "
                      "--num-attention-heads 4 --seq-length 64 --max-position-embeddings 64\n")
    spec, _ = import_config(str(script), "megatron")
    assert spec.model.layers == 24


def test_zero3_nvme_is_zero_infinity_in_deepspeed_and_accelerate(tmp_path):
    """offload=nvme at zero 3 (#37) is DeepSpeed's ZeRO-Infinity: parameters and optimizer state to
    NVMe, read back by DeepSpeed's own config class and imported as the same layout."""
    from tests.unit.test_interop_real import deepspeed_facts

    s = spec({"dp": 2, "zero": 3, "offload": "nvme", "nvme_path": "/local_nvme/wb"}, dtype="bf16")
    text, w = export_config(s, "deepspeed")
    assert not any("layout.offload" in x for x in w), w
    facts = deepspeed_facts(text, 2)
    assert (facts["zero"], facts["offload_optimizer"], facts["offload_param"]) == (3, "nvme", "nvme")
    back, _ = import_text(text, "deepspeed")
    assert (back.layout.zero, back.layout.offload, back.layout.nvme_path) == (3, "nvme", "/local_nvme/wb")
    acc, w = export_config(s, "accelerate")
    assert not any("layout.offload" in x for x in w), w
    ds = yaml.safe_load(acc)["deepspeed_config"]
    assert (ds["offload_optimizer_device"], ds["offload_param_device"], ds["offload_param_nvme_path"]) == \
        ("nvme", "nvme", "/local_nvme/wb")
