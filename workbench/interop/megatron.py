"""Megatron-LM command lines <-> JobSpec: tp/pp/dp, virtual stages, sequence parallel, distributed optimizer
or FSDP, fp16/bf16, batch sizes, optimizer, recompute and the GPT/Llama shape.

Flag names and defaults follow megatron/training/arguments.py and the config dataclasses it turns
into flags (NVIDIA/Megatron-LM; the names relied on are listed in
tests/fixtures/interop/megatron_arg_names.txt with the commit they were read from). The data-parallel
size is what torchrun starts divided by tp x pp, so the launcher line is read and written too.
"""
from __future__ import annotations

import math
import re
import shlex

from workbench.errors import ConfigError
from workbench.interop.common import (
    ADAM_BETAS,
    ADAM_EPS,
    LOSS_SCALE_WINDOW,
    SGD_MOMENTUM,
    Notes,
    batch_split,
    lag_note,
    set_path,
    unexpressed_fields,
)
from workbench.interop.shell import read_script

# Flags that take no value (store_true in Megatron's parser, or torchrun's).
_SWITCHES = {"--bf16", "--fp16", "--deepspeed", "--checkpoint-activations", "--use-rotary-position-embeddings", "--sequence-parallel", "--use-distributed-optimizer", "--use-torch-fsdp2",
             "--use-megatron-fsdp", "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
             "--group-query-attention", "--optimizer-cpu-offload", "--recompute-activations", "--mock-data",
             "--overlap-grad-reduce", "--overlap-param-gather", "--use-flash-attn", "--standalone",
             "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
             "--use-mcore-models", "--no-gradient-accumulation-fusion"}
# torchrun's own flags; only the rank count matters to the job.
_LAUNCHER = {"--nproc_per_node", "--nproc-per-node", "--nnodes", "--node_rank", "--node-rank", "--master_addr",
             "--master-addr", "--master_port", "--master-port", "--rdzv_backend", "--rdzv-backend", "--rdzv_endpoint",
             "--rdzv-endpoint", "--rdzv_id", "--rdzv-id", "--standalone", "--num_gpus", "--num_nodes", "--hostfile"}
_SHARDING = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
_GPUS_PER_NODE = 8  # assumed when the script gives no rank count and the layout needs more
_GPT2_VOCAB = 50257  # --vocab-file/--merge-file name the GPT-2 BPE tokenizer


class Parsed(dict):
    """{flag: value, or True for a switch}, with what the script left open: the program it runs,
    the variables that could not be resolved (name -> why) and assignments under tests that could
    not be evaluated (name -> the test)."""

    program: str = ""
    unresolved: dict[str, str]
    skipped: dict[str, str]


def parse(text: str) -> Parsed:
    """A launch script (or one command line) -> the training command's flags, the script's variables resolved.

    The training command is the one that runs a ``*.py`` program (the one with most flags if several);
    before the program only the launcher's rank counts are kept. Without any program every flag is read.
    """
    try:
        script = read_script(text)
    except (ValueError, IndexError, RecursionError) as e:
        raise ConfigError(f"not a Megatron-LM command line: {e} (unbalanced quotes?).") from None
    chosen, program_at, flags_seen = None, -1, -1
    everything: list[str] = []
    for cmd in script.commands:
        words = _resplit(cmd.words)
        if words[:1] == ["eval"]:
            words = words[1:]
        if not words or words[0] in ("echo", "printf", "cat", "mkdir", "sed", "wget", "ds_ssh", "export"):
            continue
        everything += words
        at = next((i for i, w in enumerate(words) if w.endswith(".py")), -1)
        count = sum(w.startswith("--") for w in words)
        if at >= 0 and count > flags_seen:
            chosen, program_at, flags_seen = (cmd, words), at, count
    if chosen is None:
        words, cmd_unresolved, cmd_skipped, program = everything, {}, {}, ""
    else:
        cmd, words = chosen
        cmd_unresolved, cmd_skipped, program = cmd.unresolved, cmd.skipped, words[program_at].rsplit("/", 1)[-1]
        words = _launcher_flags(words[:program_at]) + _no_redirections(words[program_at:])
    args = Parsed()
    args.program, args.unresolved, args.skipped = program, dict(cmd_unresolved), dict(cmd_skipped)
    for i, tok in enumerate(words):
        if not tok.startswith("--"):
            continue
        flag, sep, value = tok.partition(" ") if " " in tok else tok.partition("=")  # "--flag value" quoted as one
        if not sep:
            nxt = words[i + 1] if i + 1 < len(words) else None
            takes = (flag not in _SWITCHES and nxt is not None and not nxt.startswith("--")
                     and not nxt.endswith((".py", "(", ")")))
            value = nxt if takes else True
        args[flag] = value
    if not any(k not in _LAUNCHER for k in args):
        raise ConfigError("not a Megatron-LM command line: no --flags found (e.g. --tensor-model-parallel-size).")
    return args


def _no_redirections(words: list[str]) -> list[str]:
    """`&> log`, `2>&1`, `> out` (left in a command kept in a string and run with eval) are the shell's."""
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif re.fullmatch(r"\d*(>>?|<|&>>?)&?", w):
            skip = True
        elif not re.match(r"\d*(>>?|<|&>>?)\S", w):
            out.append(w)
    return out


def _launcher_flags(words: list[str]) -> list[str]:
    """torchrun's (or deepspeed's) rank counts before the program; srun's and the rest are the cluster's."""
    out: list[str] = []
    for i, w in enumerate(words):
        if w.split("=", 1)[0] in _LAUNCHER:
            out.append(w)
            if "=" not in w and w not in _SWITCHES and i + 1 < len(words) and not words[i + 1].startswith("-"):
                out.append(words[i + 1])
    return out


def _resplit(words: list[str]) -> list[str]:
    """Words that hold a whole command or several flags (``sh -c "$run_cmd"``, ``"--flag value"``) split again."""
    out: list[str] = []
    for w in words:
        if re.search(r"\s", w.strip()) and (w.lstrip().startswith("--") or ".py" in w or " --" in w):
            try:
                out += shlex.split(w)
            except ValueError:
                out += w.split()
        else:
            out.append(w)
    return out


def dump(args: list[str]) -> str:
    lines, line = [], []
    for tok in args:
        if tok.startswith("--") and line and line[0].startswith("--"):
            lines.append(" ".join(line))
            line = []
        line.append(shlex.quote(tok))
        if tok.endswith(".py"):
            lines.append(" ".join(line))
            line = []
    lines.append(" ".join(line))
    return " \\\n    ".join(lines) + "\n"


class _Args:
    """Typed reads of parsed flags that remember what was read and warn on unresolved $VARs."""

    def __init__(self, args: dict, notes: Notes):
        self.args, self.notes, self.used = args, notes, set()

    def get(self, flag: str, default=None, kind=str):
        self.used.add(flag)
        value = self.args.get(flag, default)
        if isinstance(value, str) and "$" in value:
            self.notes.unmapped(flag, value, "a shell expression this import cannot evaluate; Megatron's default used")
            return default
        if value is None or value is True or kind is str:
            return value
        try:
            return kind(float(value)) if kind is int else kind(value)
        except ValueError:
            raise ConfigError(f"Megatron-LM flag {flag} {value!r}: expected a {kind.__name__}.") from None


# Megatron-LM's other model providers: what they train, none of it a decoder-only GPT/Llama.
_NOT_GPT = {"bert": "a BERT encoder (bidirectional attention, masked-LM and sentence-order losses)",
            "t5": "a T5 encoder-decoder (span corruption, separate encoder and decoder stacks)",
            "ict": "an ICT retriever (two BERT encoders)", "mamba": "a Mamba hybrid (state-space layers)",
            "retro": "RETRO (a decoder with chunked cross-attention to retrieved text)",
            "vlm": "a vision-language model", "vision": "a vision transformer"}
# Flags whose value switches nothing on: saying them sets nothing and is not listed.
_NEUTRAL = {"--context-parallel-size": "1", "--expert-model-parallel-size": "1"}


def _check_program(args: dict) -> None:
    program = getattr(args, "program", "")
    kind = re.fullmatch(r"pretrain_([a-z0-9]+?)(?:_[a-z0-9_]+)?\.py", program)
    if program and kind and kind.group(1) != "gpt":
        what = _NOT_GPT.get(kind.group(1), f"the model of {program}")
        raise ConfigError(f"Megatron-LM's {program} trains {what}, not a GPT/Llama decoder; the spec's models are "
                          "decoder-only transformers (model.family gpt or llama), so importing it would train a "
                          "different model. Import a pretrain_gpt.py script, or give the model as model.factory.")


def _script_notes(args: dict, notes: Notes) -> None:
    """Name each shell variable the command line uses that could not be resolved, and each skipped assignment."""
    for name, why in sorted(getattr(args, "unresolved", {}).items()):
        shown = "a $(...) command substitution" if not name else ("$" + name)
        notes.note(f"{shown} on the command line is not resolved ({why}); flags that take it keep "
                   "Megatron's default and are named below")
    for name, test in sorted(getattr(args, "skipped", {}).items()):
        notes.note(f"${name} is also set inside `if {test}`, a test this import cannot evaluate; "
                   "read without that assignment")


def to_spec(args: dict, dp: int | None = None) -> tuple[dict, list[str]]:
    """Parsed Megatron-LM flags -> (raw spec dict, warnings); `dp` is used if torchrun's line does not fix it."""
    _check_program(args)
    notes = Notes("megatron")
    _script_notes(args, notes)
    a, raw = _Args(args, notes), {}
    _layout(a, raw, notes, dp)
    _precision(a, raw, notes)
    _train(a, raw, notes)
    _schedule(a, raw, notes)
    _recompute(a, raw, notes)
    _model(a, raw, notes)
    if a.get("--save-interval"):
        set_path(raw, "checkpoint.every_steps", a.get("--save-interval", kind=int))
    if isinstance(a.get("--save"), str):  # a placeholder such as `<Specify path>` leaves no value
        set_path(raw, "checkpoint.uri", a.get("--save"))
    used = a.used | {k for k in args if k in _LAUNCHER} | {k for k, v in _NEUTRAL.items() if args.get(k) == v}
    for flag, value in args.items():
        if flag not in used and value is not False:
            why = ("the spec's schedule counts iterations, not samples" if flag.startswith("--lr-") and
                   flag.endswith("-samples") else "")
            notes.unmapped(flag, value, why)
    return raw, notes.lines


def _layout(a: _Args, raw: dict, notes: Notes, launcher_dp: int | None) -> None:
    tp, pp = a.get("--tensor-model-parallel-size", 1, int), a.get("--pipeline-model-parallel-size", 1, int)
    nodes = a.get("--nnodes", 1, int)
    procs = a.get("--nproc_per_node", None, int) or a.get("--nproc-per-node", None, int)
    dp = launcher_dp or 1
    if procs and (nodes * procs) % (tp * pp) == 0:
        dp = nodes * procs // (tp * pp)
        if nodes > 1:
            set_path(raw, "resources.nodes", nodes)
            set_path(raw, "resources.gpus_per_node", procs)
    else:
        if not launcher_dp:
            started = (f"torchrun starts {nodes} x {procs} ranks, not a multiple of" if procs
                       else "no torchrun rank count;")
            notes.note(f"{started} tp({tp}) x pp({pp}); dp=1 assumed: give it with --set layout.dp=N "
                       "(and resources.nodes / gpus_per_node)")
        if not procs and dp * tp * pp > _GPUS_PER_NODE:  # nodes of 8 GPUs rather than one node of them all
            procs = _GPUS_PER_NODE
            notes.note(f"the script does not say how many GPUs a node has; {_GPUS_PER_NODE} assumed: "
                       f"resources.gpus_per_node={procs} (change with --set resources.gpus_per_node=N)")
        if procs:  # the script's GPUs per node stay what a node has; the nodes are what the layout needs
            need = -(-dp * tp * pp // procs)
            set_path(raw, "resources.gpus_per_node", procs)
            set_path(raw, "resources.nodes", need)
            if need != nodes:
                notes.note(f"dp({dp}) x tp({tp}) x pp({pp}) = {dp * tp * pp} ranks on nodes of {procs} GPUs "
                           f"(--nproc-per-node): resources.nodes={need} (the script says --nnodes {nodes})")
    set_path(raw, "layout", {"dp": dp, "tp": tp, "pp": pp})
    virtual = a.get("--virtual-pipeline-model-parallel-size", None, int)
    per_stage = a.get("--num-layers-per-virtual-pipeline-stage", None, int)
    layers = a.get("--num-layers", None, int)
    if per_stage and layers:
        virtual = layers // (pp * per_stage)
    if virtual and virtual > 1:
        raw["layout"].update(pp_schedule="interleaved-1f1b", virtual_stages=virtual)
    if a.get("--sequence-parallel") and tp > 1:  # Megatron turns it off itself when tp is 1
        raw["layout"]["sequence_parallel"] = True
    if a.get("--deepspeed") and a.get("--zero-stage") is not None:  # Megatron-DeepSpeed: DeepSpeed's ZeRO stage
        raw["layout"]["zero"] = a.get("--zero-stage", kind=int)
    if a.get("--deepspeed_config"):
        notes.unmapped("--deepspeed_config", a.get("--deepspeed_config"), "the DeepSpeed config is a file of its own: import it with "
                       "--format deepspeed (batch, precision and ZeRO there must agree with these flags)")
    if a.get("--use-torch-fsdp2"):
        raw["layout"]["zero"] = 3
    elif a.get("--use-megatron-fsdp"):
        strategy = a.get("--data-parallel-sharding-strategy", "optim_grads_params")
        raw["layout"]["zero"] = _SHARDING.get(strategy, 3)
    elif a.get("--use-distributed-optimizer"):
        raw["layout"]["zero"] = 1
    if a.get("--optimizer-cpu-offload"):
        notes.unmapped("--optimizer-cpu-offload", True, "Megatron keeps the optimizer step on the CPU beside a "
                       "distributed optimizer (zero=1); offload here is FSDP2's (zero 2/3) or nvme files (any zero)")


def _precision(a: _Args, raw: dict, notes: Notes) -> None:
    if a.get("--bf16") and a.get("--fp16"):
        raise ConfigError("Megatron-LM command line has both --bf16 and --fp16; keep one.")
    if a.get("--bf16"):
        set_path(raw, "precision.dtype", "bf16")
    if not a.get("--fp16"):
        return
    set_path(raw, "precision.dtype", "fp16")
    set_path(raw, "precision.initial_loss_scale", a.get("--initial-loss-scale", 2.0**32, float))
    if a.get("--loss-scale"):
        notes.unmapped("--loss-scale", a.get("--loss-scale"), "a static loss scale; the spec's fp16 scale is dynamic")
    for flag, default, ours in (("--loss-scale-window", 1000, LOSS_SCALE_WINDOW), ("--hysteresis", 2, 1)):
        value = a.get(flag, default, int)
        if value != ours:
            notes.unmapped(flag, value, f"the spec's dynamic loss scaler uses {flag[2:]}={ours} (Megatron's default "
                           f"applies when the flag is absent)")


def _train(a: _Args, raw: dict, notes: Notes) -> None:
    micro = a.get("--micro-batch-size", None, int)
    if micro:
        set_path(raw, "train.micro_batch", micro)
        set_path(raw, "train.global_batch", a.get("--global-batch-size", micro * raw["layout"]["dp"], int))
    if a.get("--train-iters"):
        set_path(raw, "train.steps", a.get("--train-iters", kind=int))
    elif a.get("--train-samples") and raw.get("train", {}).get("global_batch"):
        steps = _samples_to_iters(a, "--train-samples", raw, notes)
        if steps:
            set_path(raw, "train.steps", steps)
    optimizer = a.get("--optimizer", "adam")
    name = {"adam": "adamw", "sgd": "sgd"}.get(optimizer)  # Megatron's adam decouples weight decay (AdamW)
    if name is None:
        notes.unmapped("--optimizer", optimizer, "the spec's optimizers are adamw, adam and sgd")
    else:
        set_path(raw, "train.optimizer", name)
    if a.get("--lr") is not None:
        set_path(raw, "train.lr", a.get("--lr", kind=float))
    set_path(raw, "train.weight_decay", a.get("--weight-decay", 0.01, float))
    set_path(raw, "train.grad_clip", a.get("--clip-grad", 1.0, float))
    set_path(raw, "train.seed", a.get("--seed", 1234, int))
    checks = ((("--sgd-momentum", SGD_MOMENTUM, SGD_MOMENTUM),) if name == "sgd" else
              (("--adam-beta1", 0.9, ADAM_BETAS[0]), ("--adam-beta2", 0.999, ADAM_BETAS[1]), ("--adam-eps", 1e-8, ADAM_EPS)))
    for flag, default, ours in checks:
        value = a.get(flag, default, float)
        if value != ours:
            notes.unmapped(flag, value, f"the spec's {name} uses {ours}")


_STYLES = {"constant": "constant", "linear": "linear", "cosine": "cosine", "WSD": "wsd"}


def _schedule(a: _Args, raw: dict, notes: Notes) -> None:
    """--lr-decay-style and its iterations (OptimizerParamScheduler, megatron/core/optimizer_param_scheduler.py).

    Theirs: warmup init_lr + (lr - init_lr) x n / warmup; then constant, or linear / cosine from lr to
    --min-lr over (warmup, --lr-decay-iters], or WSD: lr until the last --lr-wsd-decay-iters of the
    decay iterations, then --lr-wsd-decay-style to --min-lr. The same formulas as workbench/schedule.py.
    """
    style = a.get("--lr-decay-style", "linear")  # Megatron's default decays linearly
    steps = raw.get("train", {}).get("steps")
    if style not in _STYLES:
        notes.unmapped("--lr-decay-style", style, "the spec's schedules are constant, linear, cosine and WSD; "
                       "constant used")
        style = "constant"
    train = raw.setdefault("train", {})
    train["schedule"] = _STYLES[style]
    decay_iters = a.get("--lr-decay-iters", None, int)
    warmup = a.get("--lr-warmup-iters", 0, int)
    if decay_iters is None and a.get("--lr-decay-samples"):
        decay_iters = _samples_to_iters(a, "--lr-decay-samples", raw, notes)
    if not warmup and a.get("--lr-warmup-samples"):
        warmup = _samples_to_iters(a, "--lr-warmup-samples", raw, notes) or 0
    fraction = a.get("--lr-warmup-fraction", None, float)
    if fraction is not None:  # Megatron: warmup = fraction x decay iterations
        span = decay_iters or steps
        if span:
            warmup = round(fraction * span)
            if warmup != fraction * span:
                notes.note(f"--lr-warmup-fraction {fraction} x {span} iterations = {fraction * span}; "
                           f"warmup_steps={warmup}")
        else:
            notes.unmapped("--lr-warmup-fraction", fraction, "no --train-iters or --lr-decay-iters to scale")
    train["warmup_steps"] = warmup
    train["min_lr"] = a.get("--min-lr", 0.0, float)
    init = a.get("--lr-warmup-init", 0.0, float)
    if init and warmup:
        notes.unmapped("--lr-warmup-init", init, "the spec's warmup starts from 0")
    if style != "constant" and decay_iters is not None and decay_iters != steps:
        notes.unmapped("--lr-decay-iters", decay_iters, f"the spec's schedule decays until train.steps({steps}); "
                       "mapped as that")
    if style == "WSD":
        wsd_style = a.get("--lr-wsd-decay-style", "exponential")
        if wsd_style != "linear":
            notes.unmapped("--lr-wsd-decay-style", wsd_style, "the spec's wsd decays linearly; mapped as linear")
        wsd_iters, ours = a.get("--lr-wsd-decay-iters", None, int), _wsd_iters(steps or 0)
        if wsd_iters != ours:
            notes.unmapped("--lr-wsd-decay-iters", wsd_iters, f"the spec's wsd decays over the last 20% of the "
                           f"steps ({ours}); mapped as that")
    if warmup or style != "constant":
        notes.note(lag_note("Megatron", "the count of iterations already taken"))


def _samples_to_iters(a: _Args, flag: str, raw: dict, notes: Notes) -> int | None:
    """Megatron counts these in samples, one global batch per iteration: samples / global batch iterations."""
    samples, batch = a.get(flag, None, int), raw.get("train", {}).get("global_batch")
    if not samples or not batch:
        return None
    iters = max(1, round(samples / batch))
    exact = "" if samples % batch == 0 else f" (rounded from {samples / batch:g})"
    ramp = (" --rampup-batch-size makes the early iterations smaller, so Megatron takes more of them;"
            if a.get("--rampup-batch-size") else "")
    notes.note(f"{flag} {samples} / global batch {batch} = {iters} iterations{exact};{ramp} the spec counts "
               "iterations")
    return iters


def _wsd_iters(steps: int) -> int:
    from workbench.schedule import WSD_DECAY_FRACTION

    return max(1, round(WSD_DECAY_FRACTION * steps))


def _schedule_out(spec, notes: Notes) -> list[str]:
    tr = spec.train
    style = {v: k for k, v in _STYLES.items()}[tr.schedule]
    out = ["--lr-decay-style", style]
    if tr.warmup_steps:
        out += ["--lr-warmup-iters", str(tr.warmup_steps)]
    if tr.schedule != "constant":
        out += ["--min-lr", repr(tr.min_lr), "--lr-decay-iters", str(tr.steps)]
    if tr.schedule == "wsd":
        decay = _wsd_iters(tr.steps)
        out += ["--lr-wsd-decay-style", "linear", "--lr-wsd-decay-iters", str(decay)]
        if tr.warmup_steps > tr.steps - decay:
            notes.unexpressed("train.warmup_steps", tr.warmup_steps, f"the spec's wsd starts its decay after the "
                              f"warmup, Megatron's at iteration {tr.steps - decay}, inside it")
    return out


def _recompute(a: _Args, raw: dict, notes: Notes) -> None:
    granularity = a.get("--recompute-granularity")
    if a.get("--recompute-activations") or granularity == "selective":  # the attention core, as ours
        set_path(raw, "layout.activation_checkpointing", "selective")
        return
    # Older Megatron-LM (and Megatron-DeepSpeed): --checkpoint-activations is --activations-checkpoint-method
    # uniform, each unit --activations-checkpoint-num-layers (1) blocks: the full recompute of today.
    old_method = a.get("--activations-checkpoint-method") or ("uniform" if a.get("--checkpoint-activations") else None)
    if granularity != "full" and old_method is None:
        return
    set_path(raw, "layout.activation_checkpointing", "full")
    if granularity == "full":
        method, count = a.get("--recompute-method", "uniform"), a.get("--recompute-num-layers", 1, int)
    else:
        method, count = old_method, a.get("--activations-checkpoint-num-layers", 1, int)
    if (method, count) != ("uniform", 1):
        notes.unmapped("--recompute-method", f"{method} x {count}", "the spec's full recompute checkpoints every "
                       "block on its own or every k-th block (layout.checkpoint_every); mapped to every block")


def _model(a: _Args, raw: dict, notes: Notes) -> None:
    layers, hidden, heads = (a.get(f, None, int) for f in ("--num-layers", "--hidden-size", "--num-attention-heads"))
    if not (layers and hidden and heads):
        notes.note("--num-layers, --hidden-size and --num-attention-heads are not all given; the spec keeps its "
                   "default model (set model.* with --set)")
        return
    norm = a.get("--normalization")
    rope = a.get("--position-embedding-type") == "rope" or bool(a.get("--use-rotary-position-embeddings"))
    llama_flags = {"--swiglu": a.get("--swiglu"), "--normalization": str(norm).lower() == "rmsnorm",
                   "--position-embedding-type": rope, "--disable-bias-linear": a.get("--disable-bias-linear")}
    llama = any(llama_flags.values())
    if llama and not all(llama_flags.values()):
        missing = [f for f, on in llama_flags.items() if not on]
        notes.note(f"a Llama-style model without {', '.join(missing)}: the spec's llama family has SwiGLU, "
                   "RMSNorm, rotary positions and no biases")
    seq = a.get("--seq-length", None, int)
    model = {"family": "llama" if llama else "gpt", "layers": layers, "hidden": hidden, "heads": heads,
             "vocab": _vocab(a, raw["layout"]["tp"], notes),
             "tie_embeddings": not a.get("--untie-embeddings-and-output-weights")}
    if a.get("--group-query-attention"):
        model["kv_heads"] = a.get("--num-query-groups", 1, int)
    elif a.get("--num-key-value-heads"):  # Megatron-DeepSpeed's name
        model["kv_heads"] = a.get("--num-key-value-heads", kind=int)
    _experts(a, notes)
    if a.get("--ffn-hidden-size"):
        model["ffn_hidden"] = a.get("--ffn-hidden-size", kind=int)
    if seq:
        model["seq_len"] = seq
        positions = a.get("--max-position-embeddings", seq, int)
        if positions != seq and not llama:
            notes.unmapped("--max-position-embeddings", positions, f"the spec's gpt learns seq_len({seq}) positions")
    raw["model"] = model


def _experts(a: _Args, notes: Notes) -> None:
    experts = a.get("--num-experts")
    if isinstance(experts, str) and "$" not in experts:
        count = max(int(float(x)) for x in experts.split())  # Megatron-DeepSpeed takes one count per layer group
        if count > 1:
            topk = a.get("--moe-router-topk")
            notes.note(f"--num-experts {experts}: the script trains a mixture-of-experts model ({count} experts "
                       f"per MoE layer{f', top-{topk} routing' if topk else ''}); the spec has no experts, "
                       "so the imported job is a DIFFERENT, dense model with one MLP per block, fewer parameters "
                       "and other results. The --moe-* flags below are not mapped")


def _vocab(a: _Args, tp: int, notes: Notes) -> int:
    """The padded vocabulary Megatron builds (vocab_size_with_padding in megatron/core/tokenizers)."""
    vocab = a.get("--vocab-size", None, int)
    if vocab is None:
        vocab = _GPT2_VOCAB
        notes.note(f"no --vocab-size: the tokenizer's vocabulary is not in the command line; GPT-2 BPE "
                   f"({_GPT2_VOCAB} ids) assumed")
    multiple = a.get("--make-vocab-size-divisible-by", 128, int) * tp
    return int(math.ceil(vocab / multiple) * multiple)


def from_spec(spec) -> tuple[list[str], list[str]]:
    """A validated JobSpec -> (torchrun command line as a list of tokens, warnings)."""
    notes, lay, tr, res = Notes("megatron"), spec.layout, spec.train, spec.resources
    micro, _ = batch_split(spec)
    out = ["torchrun", "--nnodes", str(res.nodes), "--nproc-per-node", str(lay.world_size // res.nodes), "pretrain_gpt.py",
           "--tensor-model-parallel-size", str(lay.tp), "--pipeline-model-parallel-size", str(lay.pp)]
    expressed = ["layout.dp", "layout.tp", "layout.pp", "layout.zero", "layout.sequence_parallel", "resources",
                 "train", "precision", "checkpoint.every_steps", "checkpoint.uri"]
    if lay.pp > 1 and lay.pp_schedule == "interleaved-1f1b":
        out += ["--virtual-pipeline-model-parallel-size", str(lay.virtual_stages)]
        expressed += ["layout.pp_schedule", "layout.virtual_stages"]
    elif lay.pp_schedule == "1f1b":
        expressed.append("layout.pp_schedule")
    if lay.sequence_parallel:
        out.append("--sequence-parallel")
    out += {0: [], 1: ["--use-distributed-optimizer"], 3: ["--use-torch-fsdp2"],
            2: ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"]}[lay.zero]
    out += ["--micro-batch-size", str(micro), "--global-batch-size", str(tr.global_batch),
            "--train-iters", str(tr.steps), "--lr", repr(tr.lr), "--weight-decay", repr(tr.weight_decay),
            "--clip-grad", repr(tr.grad_clip), "--seed", str(tr.seed)] + _schedule_out(spec, notes)
    if tr.optimizer == "sgd":
        out += ["--optimizer", "sgd", "--sgd-momentum", repr(SGD_MOMENTUM)]
    else:
        if tr.optimizer == "adam" and tr.weight_decay:
            notes.unexpressed("train.optimizer", "adam", "Megatron's adam decouples weight decay (AdamW); "
                              "exported as that")
        out += ["--optimizer", "adam", "--adam-beta1", repr(ADAM_BETAS[0]), "--adam-beta2", repr(ADAM_BETAS[1]),
                "--adam-eps", repr(ADAM_EPS)]
    if spec.precision.dtype == "bf16":
        out.append("--bf16")
    elif spec.precision.dtype == "fp16":
        out += ["--fp16", "--initial-loss-scale", repr(spec.precision.initial_loss_scale),
                "--loss-scale-window", str(LOSS_SCALE_WINDOW), "--hysteresis", "1"]
    if lay.activation_checkpointing == "full" and lay.checkpoint_every == 1:
        out += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
        expressed.append("layout.activation_checkpointing")
    elif lay.activation_checkpointing == "selective":
        out += ["--recompute-granularity", "selective"]
        expressed.append("layout.activation_checkpointing")
    out += _model_out(spec, notes, expressed)
    if spec.checkpoint.every_steps:
        out += ["--save-interval", str(spec.checkpoint.every_steps)]
    if spec.checkpoint.uri:
        out += ["--save", spec.checkpoint.uri]
    unexpressed_fields(spec, expressed, notes, {
        "layout.offload": "Megatron's --optimizer-cpu-offload is a CPU optimizer beside a distributed optimizer, "
                          "not FSDP2 offload or nvme files",
        "layout.pp_schedule": "Megatron runs 1F1B, or interleaved 1F1B with virtual stages",
        "layout.activation_checkpointing": "Megatron's full recompute has no every-k-th-block form",
        "data": "Megatron reads --data-path; the spec's synthetic/text sources have no counterpart"})
    return out, notes.lines


def _model_out(spec, notes: Notes, expressed: list[str]) -> list[str]:
    if spec.model.factory or spec.model.params:
        notes.unexpressed("model", spec.model.factory or spec.model.params, "Megatron builds GPT/Llama shapes only")
        return []
    shape, tp = spec.model.shape(), spec.layout.tp
    expressed.append("model")
    out = ["--num-layers", str(shape.layers), "--hidden-size", str(shape.hidden),
           "--num-attention-heads", str(shape.heads), "--ffn-hidden-size", str(shape.ffn_hidden),
           "--seq-length", str(shape.seq_len), "--max-position-embeddings", str(shape.seq_len),
           "--vocab-size", str(shape.vocab), "--make-vocab-size-divisible-by", "1"]
    if shape.vocab % tp:
        notes.note(f"model.vocab({shape.vocab}) is not a multiple of tp({tp}); Megatron pads it to "
                   f"{-(-shape.vocab // tp) * tp}")
    if shape.kv_heads != shape.heads:
        out += ["--group-query-attention", "--num-query-groups", str(shape.kv_heads)]
    if shape.family == "llama":
        out += ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear"]
    if not shape.tie_embeddings:
        out.append("--untie-embeddings-and-output-weights")
    return out
