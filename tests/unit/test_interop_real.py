"""Real configs from the engines' public repositories in and out (tests/fixtures/interop/real, issue #30).

Each corpus file is stored verbatim (its git blob id is checked) with its repository, commit and
path in real/sources.yaml. Per file: import, export to the same engine, read both with the engine's
own config classes where they install here (DeepSpeed's DeepSpeedConfig, Accelerate's ClusterConfig;
Megatron-LM and torchtitan do not install on a CPU machine, so their flags and TOML are read as their
parsers would), and compare layout, precision, batch, optimizer and schedule: every fact must be equal
or named in a warning. Then one regression test per defect of the issue, on the config that showed it.
"""
import hashlib
import json
import re
from pathlib import Path
from unittest import mock

import pytest
import tomllib
import yaml

from tests.helpers.environ import keep_environ  # noqa: F401 (autouse)
from workbench.errors import ConfigError
from workbench.interop import export_config, import_config, import_text
from workbench.interop import megatron as meg_mod

REAL = Path(__file__).parent.parent / "fixtures" / "interop" / "real"
SOURCES = yaml.safe_load((REAL / "sources.yaml").read_text())["configs"]
# Programs that are not GPT decoders: refused with the reason.
REFUSED = {"train_bert_340m_distributed.sh": "BERT encoder", "pretrain_bert.sh": "BERT encoder",
           "train_t5_220m_distributed.sh": "T5 encoder-decoder"}
# What the file leaves to the launcher or the training script, given as a user would.
OVERRIDES = {"cifar/ds_config.json": ["train.steps=2000"]}  # WarmupLR: the run's length is the script's




def path_of(suffix: str) -> Path:
    """The one corpus file whose path ends with `suffix`."""
    found = [e["file"] for e in SOURCES if e["file"].endswith("/" + suffix)]
    assert len(found) == 1, (suffix, found)
    return REAL / found[0]


# -- the corpus -----------------------------------------------------------------------------------

def test_corpus_is_verbatim_listed_and_covers_every_engine_old_and_new():
    listed = {e["file"] for e in SOURCES}
    on_disk = {str(p.relative_to(REAL)) for p in REAL.rglob("*") if p.is_file() and p.name != "sources.yaml"}
    assert listed == on_disk
    assert len(SOURCES) >= 40
    for e in SOURCES:
        data = (REAL / e["file"]).read_bytes()
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == e["blob"], e["file"]
        assert re.fullmatch(r"[0-9a-f]{40}", e["commit"]) and "/" in e["repo"] and e["path"]
    formats = {e["format"] for e in SOURCES}
    assert formats == {"deepspeed", "accelerate", "megatron", "torchtitan"}
    # Old and new layouts: torchtitan before/after [parallelism], Megatron string variables and arrays,
    # Accelerate 0.11 and today's, DeepSpeed's cpu_offload era and today's.
    text = {e["file"]: (REAL / e["file"]).read_text() for e in SOURCES}
    assert any("data_parallel_degree" in t for t in text.values()) and any("[parallelism]" in t for t in text.values())
    assert any(re.search(r'^GPT_ARGS="', t, re.M) for t in text.values()) and any("_ARGS=(" in t for t in text.values())
    assert any('"cpu_offload": true' in t for t in text.values())


# -- facts read the engines' way ------------------------------------------------------------------

def deepspeed_facts(text: str, dp: int) -> dict:
    cfg = json.loads(text)
    try:  # DeepSpeed's own reading, with the launcher's world size
        from deepspeed.runtime import config as ds_config

        with mock.patch.object(ds_config.dist, "get_rank", lambda *a, **k: 0), \
                mock.patch.object(ds_config.dist, "get_world_size", lambda *a, **k: dp):
            ds = ds_config.DeepSpeedConfig(cfg)
        zero = ds.zero_config
        return {"zero": ds.zero_optimization_stage,
                "offload_optimizer": zero.offload_optimizer.device if zero.offload_optimizer else "none",
                "offload_param": zero.offload_param.device if zero.offload_param else "none",
                "fp16": bool(ds.float16_config.enabled), "bf16": bool(ds.bfloat16_config.enabled),
                "batch": (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps),
                "optimizer": _adam_w(ds.optimizer_name, ds.optimizer_params), "lr": (ds.optimizer_params or {}).get("lr"),
                "weight_decay": (ds.optimizer_params or {}).get("weight_decay", 0.0) if ds.optimizer_name else None,
                "scheduler": ds.scheduler_name, "clip": ds.gradient_clipping}
    except Exception:  # 'auto' (the HF Trainer's) or keys DeepSpeed 0.19 no longer takes: read as written
        zero = cfg.get("zero_optimization", {})
        opt = cfg.get("optimizer", {})
        return {"zero": zero.get("stage", 0),
                "offload_optimizer": zero.get("offload_optimizer", {}).get("device",
                                                                          "cpu" if zero.get("cpu_offload") else "none"),
                "offload_param": zero.get("offload_param", {}).get("device",
                                                                  "cpu" if zero.get("cpu_offload_params") else "none"),
                "fp16": cfg.get("fp16", {}).get("enabled", False) is True,
                "bf16": cfg.get("bf16", {}).get("enabled", False) is True,
                "batch": tuple(cfg.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                    "gradient_accumulation_steps")),
                "optimizer": _adam_w(str(opt.get("type")).lower(), opt.get("params")) if opt else None,
                "lr": opt.get("params", {}).get("lr"),
                "weight_decay": opt.get("params", {}).get("weight_decay", 0.0) if opt else None,
                "scheduler": cfg.get("scheduler", {}).get("type"), "clip": cfg.get("gradient_clipping", 1.0)}


def _adam_w(name, params) -> str | None:
    """DeepSpeed builds its "Adam" as AdamW unless adam_w_mode is false (runtime/engine.py, FusedAdam)."""
    if name == "adam" and (params or {}).get("adam_w_mode", True) is True:
        return "adamw"
    return name


def accelerate_facts(text: str, folder: Path | None, tmp_path: Path) -> dict:
    from accelerate.commands.config.config_args import ClusterConfig

    path = tmp_path / "c.yaml"
    path.write_text(text)
    c = ClusterConfig.from_yaml_file(str(path))
    kind = c.distributed_type.value if hasattr(c.distributed_type, "value") else str(c.distributed_type)
    ds = dict(c.deepspeed_config or {})
    precision = c.mixed_precision.value if hasattr(c.mixed_precision, "value") else c.mixed_precision
    if ds.get("deepspeed_config_file") and folder is not None:
        file = json.loads((folder / ds["deepspeed_config_file"]).read_text())
        ds["zero_stage"] = file.get("zero_optimization", {}).get("stage", 0)
        ds["offload_optimizer_device"] = file.get("zero_optimization", {}).get("offload_optimizer", {}).get("device")
        precision = "fp16" if file.get("fp16", {}).get("enabled") is True else (
            "bf16" if file.get("bf16", {}).get("enabled") is True else precision)
    fsdp = c.fsdp_config or {}
    reshard = fsdp.get("fsdp_reshard_after_forward", fsdp.get("fsdp_sharding_strategy", "FULL_SHARD"))
    par = c.parallelism_config or {}
    return {"distributed_type": "DDP" if kind in ("MULTI_GPU", "MULTI_CPU", "NO") else kind,
            "num_processes": c.num_processes, "num_machines": c.num_machines, "use_cpu": bool(c.use_cpu),
            "mixed_precision": str(precision or "no"),
            "zero": (ds.get("zero_stage") if kind == "DEEPSPEED" else
                     (3 if reshard in (True, "FULL_SHARD") else 2) if kind == "FSDP" else 0),
            "offload": bool(fsdp.get("fsdp_offload_params")) or ds.get("offload_optimizer_device") not in (None, "none"),
            "activation_checkpointing": bool(fsdp.get("fsdp_activation_checkpointing")),
            "tp": par.get("parallelism_config_tp_size", 1), "cp": par.get("parallelism_config_cp_size", 1)}


def megatron_facts(text: str) -> dict:
    a = meg_mod.parse(text)
    gb = float(a.get("--global-batch-size", 0))
    iters = a.get("--train-iters") or (round(float(a["--train-samples"]) / gb) if "--train-samples" in a else None)
    return {"tp": a.get("--tensor-model-parallel-size", "1"), "pp": a.get("--pipeline-model-parallel-size", "1"),
            "precision": "bf16" if a.get("--bf16") else "fp16" if a.get("--fp16") else "fp32",
            "zero": bool(a.get("--use-distributed-optimizer")) or a.get("--zero-stage", "0") not in ("0",),
            "micro": a.get("--micro-batch-size"), "global": a.get("--global-batch-size"),
            "steps": int(iters) if iters else None, "lr": float(a["--lr"]) if "--lr" in a else None,
            "weight_decay": float(a.get("--weight-decay", 0.01)), "clip": float(a.get("--clip-grad", 1.0)),
            "schedule": a.get("--lr-decay-style", "linear"), "min_lr": float(a.get("--min-lr", 0.0)),
            "layers": a.get("--num-layers"), "hidden": a.get("--hidden-size"), "heads": a.get("--num-attention-heads")}


_TT_OLD = {"training.data_parallel_degree": "parallelism.data_parallel_shard_degree",
           "training.tensor_parallel_degree": "parallelism.tensor_parallel_degree",
           "experimental.pipeline_parallel_degree": "parallelism.pipeline_parallel_degree",
           "training.warmup_steps": "lr_scheduler.warmup_steps"}  # torchtitan's older layout (a09cde3)


def torchtitan_facts(text: str) -> dict:
    cfg = tomllib.loads(text)
    flat = {f"{s}.{k}": v for s, fields in cfg.items() if isinstance(fields, dict) for k, v in fields.items()}
    for old, new in _TT_OLD.items():
        flat.setdefault(new, flat.get(old))
    return {"shard": flat.get("parallelism.data_parallel_shard_degree", -1) or -1,
            "replicate": flat.get("parallelism.data_parallel_replicate_degree", 1),
            "tp": flat.get("parallelism.tensor_parallel_degree", 1), "pp": flat.get("parallelism.pipeline_parallel_degree", 1),
            "precision": flat.get("training.mixed_precision_param", "bfloat16"),
            "local_batch": flat.get("training.local_batch_size", flat.get("training.batch_size", 8)),
            "steps": flat.get("training.steps", 10000), "lr": flat.get("optimizer.lr", 8e-4),
            "weight_decay": flat.get("optimizer.weight_decay", 0.1), "clip": flat.get("training.max_norm", 1.0),
            "warmup": flat.get("lr_scheduler.warmup_steps", 200), "decay_ratio": flat.get("lr_scheduler.decay_ratio"),
            "model": (flat.get("model.name", "llama3"), flat.get("model.flavor", "debugmodel"))}


# Words a warning about each fact contains (the engine's key or the spec's field).
NAMES = {"zero": ["stage", "zero", "distributed-optimizer"], "offload_optimizer": ["offload"], "offload_param": ["offload"],
         "fp16": ["fp16", "precision"], "bf16": ["bf16", "precision"], "precision": ["precision", "fp16", "bf16", "fp8"],
         "batch": ["batch", "gradient_accumulation_steps"], "optimizer": ["optimizer"], "lr": ["lr"],
         "weight_decay": ["weight_decay", "weight decay"], "scheduler": ["scheduler"], "clip": ["clip"],
         "distributed_type": ["distributed_type", "zero", "plugin"], "num_processes": ["num_processes", "dp", "cp_size"],
         "num_machines": ["machines", "nodes"], "use_cpu": ["use_cpu", "resources.gpu"],
         "mixed_precision": ["mixed_precision", "precision", "fp8"], "activation_checkpointing": ["checkpoint"],
         "tp": ["tp", "tensor"], "cp": ["cp_size", "context"], "pp": ["pp", "pipeline"],
         "micro": ["micro"], "global": ["global"], "steps": ["steps", "samples", "train-iters"],
         "schedule": ["decay", "schedule"], "min_lr": ["min-lr", "min_lr"], "layers": ["model"], "hidden": ["model"],
         "heads": ["model"], "shard": ["data_parallel_shard_degree", "dp"], "replicate": ["replicate", "HSDP"],
         "local_batch": ["batch"], "warmup": ["warmup"], "decay_ratio": ["decay_ratio", "wsd"],
         "model": ["model"]}


def same(a, b) -> bool:
    try:
        return a == b or float(a) == float(b)
    except (TypeError, ValueError):
        return False


@pytest.mark.parametrize("entry", SOURCES, ids=lambda e: e["file"])
def test_semantic_round_trip(entry, tmp_path):
    """Import, export to the same engine, read both the engine's way: equal, or the difference named."""
    path, fmt = REAL / entry["file"], entry["format"]
    if path.name in REFUSED:
        with pytest.raises(ConfigError, match=f"trains a {REFUSED[path.name]}.*not a GPT/Llama decoder"):
            import_config(path, fmt)
        return
    overrides = next((o for k, o in OVERRIDES.items() if entry["file"].endswith(k)), None)
    s, in_w = import_config(path, fmt, overrides=overrides)
    text, out_w = export_config(s, fmt)
    warnings = in_w + out_w
    if fmt == "deepspeed":
        theirs, ours = deepspeed_facts(path.read_text(), s.layout.dp), deepspeed_facts(text, s.layout.dp)
    elif fmt == "accelerate":
        theirs, ours = accelerate_facts(path.read_text(), path.parent, tmp_path), accelerate_facts(text, None, tmp_path)
    elif fmt == "megatron":
        theirs, ours = megatron_facts(path.read_text()), megatron_facts(text)
    else:
        theirs, ours = torchtitan_facts(path.read_text()), torchtitan_facts(text)
    for fact, value in theirs.items():
        if not same(value, ours[fact]):
            assert any(word in w for word in NAMES[fact] for w in warnings), (fact, value, ours[fact], warnings)


# -- one regression per defect of issue #30 -------------------------------------------------------

@pytest.mark.parametrize("name,expect", [
    # Megatron-LM's older examples: flags in GPT_ARGS="..." and options="..." (sh -c "$run_cmd").
    ("pretrain_gpt_distributed_with_mp.sh", (2, 2, 2, True, "fp16", 4, 16, 1.5e-4, 24, 1024)),
    ("pretrain_gpt3_175B.sh", (1, 8, 16, False, "fp16", 1, 1536, 6e-5, 96, 12288)),
    # Megatron-DeepSpeed: megatron_options="..." grown by "${megatron_options} ..." inside if blocks.
    ("ds_pretrain_gpt_125M.sh", (1, 2, 2, False, "fp16", 2, 256, 6e-4, 12, 768)),
])
def test_megatron_flags_in_string_variables_are_read(name, expect):
    s, warnings = import_config(path_of(name))
    lay, tr, shape = s.layout, s.train, s.model.shape()
    assert (lay.dp, lay.tp, lay.pp, lay.sequence_parallel, s.precision.dtype, tr.micro_batch, tr.global_batch,
            tr.lr, shape.layers, shape.hidden) == expect
    if name == "ds_pretrain_gpt_125M.sh":  # `if [ "${activation_checkpoint}" = "true" ]` appends --checkpoint-activations
        assert lay.activation_checkpointing == "full" and lay.zero == 1
        # num_gpus=$(($(ds_ssh nvidia-smi ...)-2)) is a command's output: named, never guessed
        assert any(w.startswith("megatron: $num_gpus on the command line is not resolved (the output of a command)")
                   for w in warnings)


def test_megatron_names_each_unresolved_variable_and_skipped_assignment():
    _, warnings = import_config(path_of("train_mixtral_8x7b_distributed.sh"))
    for var in ("$CHECKPOINT_PATH", "$DATA_PATH", "$TOKENIZER_MODEL"):
        assert sum(w.startswith(f"megatron: {var} on the command line is not resolved (the script's arguments)")
                   for w in warnings) == 1, var
    assert any("$LOGGING_ARGS is also set inside `if [ -n \"${WANDB_API_KEY}\" ]`" in w for w in warnings)
    args = meg_mod.parse('X=4\nif [ "$X" -gt 2 ]; then A="--bf16"; else A="--fp16"; fi\n'
                         'B="--lr $((X * 2))e-4"\nB="$B --seed ${SEED:-7}"\ntorchrun pretrain_gpt.py $A $B $UNSET')
    assert args == {"--bf16": True, "--lr": "8e-4", "--seed": "7"}
    assert args.unresolved == {"UNSET": "not set in the script (the environment's)"}


@pytest.mark.parametrize("name", ["train_bert_340m_distributed.sh", "pretrain_bert.sh", "train_t5_220m_distributed.sh"])
def test_megatron_refuses_models_that_are_not_gpt(name):
    with pytest.raises(ConfigError, match=r"pretrain_(bert|t5)\.py trains a .* not a GPT/Llama decoder.*pretrain_gpt\.py"):
        import_config(path_of(name))


def test_megatron_moe_says_plainly_it_becomes_a_different_model():
    _, warnings = import_config(path_of("train_mixtral_8x7b_distributed.sh"))
    assert any("--num-experts 8: the script trains a mixture-of-experts model (8 experts per MoE layer, top-2 "
               "routing)" in w and "a DIFFERENT, dense model" in w for w in warnings)


@pytest.mark.parametrize("name", ["train_gpt3_175b_distributed.sh", "pretrain_gpt3_175B.sh"])
def test_megatron_gpt3_175b_is_16_nodes_of_8_not_one_node_of_128(name):
    s, warnings = import_config(path_of(name))
    assert (s.resources.nodes, s.resources.gpus_per_node, s.layout.world_size) == (16, 8, 128)
    assert any("resources.nodes=16" in w or "gpus_per_node=8" in w for w in warnings)


def test_megatron_samples_become_iterations():
    s, warnings = import_config(path_of("pretrain_gpt3_175B.sh"))  # --train-samples 146484375, batch 1536
    assert (s.train.steps, s.train.warmup_steps) == (round(146484375 / 1536), round(183105 / 1536))
    assert any("--rampup-batch-size makes the early iterations smaller" in w for w in warnings)


def test_accelerate_export_is_not_a_cpu_config():
    s, warnings = import_config(path_of("multi_gpu.yaml"))
    back = yaml.safe_load(export_config(s, "accelerate")[0])
    assert back["distributed_type"] == "MULTI_GPU" and "use_cpu" not in back
    s = import_text(path_of("multi_gpu.yaml").read_text(), "accelerate", overrides=["resources.gpu=cpu"])[0]
    back = yaml.safe_load(export_config(s, "accelerate")[0])  # a spec that says cpu gets a CPU config
    assert (back["distributed_type"], back["use_cpu"]) == ("MULTI_CPU", True)


@pytest.mark.parametrize("name,zero,dtype", [("deepspeed.yaml", 1, "fp16"), ("sp-alst.accelerate-config.yml", 3, "bf16")])
def test_accelerate_reads_the_deepspeed_config_file_beside_the_yaml(name, zero, dtype, tmp_path):
    s, warnings = import_config(path_of(name))
    assert (s.layout.zero, s.precision.dtype) == (zero, dtype)
    lone = tmp_path / name  # the same YAML without its ds_config beside it: named as missing, nothing invented
    lone.write_text(path_of(name).read_text())
    s, warnings = import_config(lone)
    assert s.layout.zero == 0 and s.precision.dtype == "fp32"
    assert any("'deepspeed_config.deepspeed_config_file'" in w and "not readable here" in w for w in warnings)


def test_deepspeed_cpu_offload_the_older_key_is_offload():
    s, warnings = import_config(path_of("ds_zero-offload_config.json"))
    assert (s.layout.zero, s.layout.offload) == (2, "cpu")
    assert not any("cpu_offload" in w for w in warnings)
    back = json.loads(export_config(s, "deepspeed")[0])
    assert back["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}


def test_torchtitan_shard_degree_minus_one_stays_sharded():
    s, _ = import_config(path_of("qwen3_32b.toml"))
    cfg = tomllib.loads(export_config(s, "torchtitan")[0])
    assert cfg["parallelism"]["data_parallel_shard_degree"] == -1
    back = import_text(export_config(s, "torchtitan")[0], "torchtitan")[0]
    assert (back.layout.zero, back.layout.dp) == (s.layout.zero, s.layout.dp) == (3, 1)
    s64 = import_config(path_of("qwen3_32b.toml"), overrides=["layout.dp=64"])[0]
    assert tomllib.loads(export_config(s64, "torchtitan")[0])["parallelism"]["data_parallel_shard_degree"] == 64


@pytest.mark.parametrize("name", ["qwen3_32b.toml", "deepseek_v3_16b.toml"])
def test_torchtitan_model_without_a_flavour_gets_no_empty_section(name):
    s, warnings = import_config(path_of(name))
    assert any("'model.flavor'" in w and "a different model" in w for w in warnings)
    text, out_w = export_config(s, "torchtitan")
    assert "model" not in tomllib.loads(text) and "# [model] no [model] fields" in text
    assert any(w.startswith("spec model = ") for w in out_w)


def test_torchtitan_older_layout_and_llama2_flavours():
    s, warnings = import_config(path_of("train_configs/llama2_7b.toml"), overrides=["layout.dp=8"])
    shape = s.model.shape()
    assert (shape.layers, shape.hidden, shape.ffn_hidden, shape.vocab) == (32, 4096, 11008, 32000)
    assert (s.layout.dp, s.layout.zero, s.train.warmup_steps, s.train.micro_batch) == (8, 3, 200, 8)
    assert not any("data_parallel_degree" in w or "warmup_steps" in w for w in warnings)


def test_deepspeed_exports_invent_no_optimizer_and_keep_the_batch():
    original = json.loads(path_of("sp-alst.ds-config.json").read_text())  # no optimizer block, gas 1
    s, _ = import_config(path_of("sp-alst.ds-config.json"), overrides=["layout.dp=4"])
    back, warnings = export_config(s, "deepspeed")
    back = json.loads(back)
    assert "optimizer" not in original and "optimizer" not in back
    assert back["gradient_accumulation_steps"] == original["gradient_accumulation_steps"] == 1
    assert any("no optimizer block is written" in w for w in warnings)
    original = json.loads(path_of("ds_zero-offload_config.json").read_text())  # micro 12 x accumulation 5
    back = json.loads(export_config(import_config(path_of("ds_zero-offload_config.json"))[0], "deepspeed")[0])
    assert (back["train_micro_batch_size_per_gpu"], back["gradient_accumulation_steps"]) == (12, 5)
    assert back["optimizer"]["params"]["lr"] == original["optimizer"]["params"]["lr"]


def test_deepspeed_warmup_without_run_length_asks_for_train_steps():
    with pytest.raises(ConfigError, match=r"warms the learning rate up over 1000 steps.*--set train\.steps=N"):
        import_config(path_of("cifar/ds_config.json"))


def test_deepspeed_lamb_keeps_its_learning_rate():
    s, warnings = import_config(path_of("deepspeed_bsz64k_lamb_config_seq128.json"))
    assert (s.train.lr, s.train.weight_decay) == (11e-3, 0.01)
    assert any("'optimizer.type' = 'Lamb'" in w for w in warnings)
    assert not any("'optimizer.params.lr'" in w for w in warnings)


def test_accelerate_cp_size_one_is_neutral_and_more_is_named():
    _, warnings = import_config(path_of("tp_hsdp.yaml"))
    assert not any("cp_size" in w for w in warnings)
    s, warnings = import_config(path_of("cp.yaml"))
    assert s.layout.dp == 1 and any("'parallelism_config.parallelism_config_cp_size' = 8" in w for w in warnings)
