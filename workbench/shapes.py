"""Model shapes and presets: the GPT/llama architecture as numbers, with exact parameter counts.

Torch-free (no allocation), so planning, validation and the memory model never import torch;
`workbench.models` builds the nn.Module from a ModelShape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel

from workbench.errors import ConfigError, did_you_mean


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rotary frequency scaling ("llama3" rope type): long wavelengths divided by
    `factor`, short ones kept, those between blended (transformers' _compute_llama3_parameters)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelShape:
    """The architecture as numbers. Fields after tie_embeddings default to the family's own
    conventions (None = the family default, filled in __post_init__)."""

    family: str  # "gpt" | "llama"
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int  # the tokenizer's vocabulary: token ids are < vocab
    seq_len: int  # the training context
    tie_embeddings: bool
    rope_theta: float = 10000.0  # llama: rotary base
    rope_scaling: RopeScaling | None = None  # llama: Llama 3.1 frequency scaling
    norm_eps: float = 1e-5  # LayerNorm (gpt) / RMSNorm (llama) epsilon
    qkv_bias: bool | None = None  # bias on q, k, v (gpt: always; Qwen2: yes)
    out_bias: bool | None = None  # bias on the attention output projection (gpt: always)
    mlp_bias: bool | None = None  # bias on the MLP's linears (gpt: always)
    pad_vocab_to: int = 1  # embedding/head rows rounded up to a multiple of this (logits masked)
    max_positions: int | None = None  # gpt: learned position rows; llama: the context the model was made for
    sliding_window: int | None = None  # Mistral v0.1: attention window (seq_len may not exceed it)

    def __post_init__(self):
        gpt = self.family == "gpt"
        for name in ("qkv_bias", "out_bias", "mlp_bias"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, gpt)
        if self.max_positions is None:
            object.__setattr__(self, "max_positions", self.seq_len)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and the head: vocab rounded up to a multiple of pad_vocab_to."""
        return -(-self.vocab // self.pad_vocab_to) * self.pad_vocab_to

    def num_params(self) -> int:
        """Exact parameter count, computed from the shape (no allocation)."""
        return self.embedding_params() + self.layers * self.block_params() + self.final_params()

    def embedding_params(self) -> int:
        pos = (self.max_positions or self.seq_len) * self.hidden if self.family == "gpt" else 0
        return self.padded_vocab * self.hidden + pos

    def block_params(self) -> int:
        h, f, kv = self.hidden, self.ffn_hidden, self.kv_dim
        attn = 2 * h * h + 2 * h * kv + (h + 2 * kv if self.qkv_bias else 0) + (h if self.out_bias else 0)
        if self.family == "gpt":
            mlp = 2 * h * f + (f + h if self.mlp_bias else 0)
            norms = 2 * 2 * h  # two LayerNorms with bias
        else:
            mlp = 3 * h * f + (2 * f + h if self.mlp_bias else 0)
            norms = 2 * h  # two RMSNorms
        return attn + mlp + norms

    def final_params(self) -> int:
        norm = 2 * self.hidden if self.family == "gpt" else self.hidden
        head = 0 if self.tie_embeddings else self.padded_vocab * self.hidden
        return norm + head


def _gpt(layers, hidden, heads, vocab=50257, seq_len=1024, tie=True):
    return dict(family="gpt", layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq_len=seq_len, tie_embeddings=tie)


def _llama(layers, hidden, heads, ffn, kv_heads=None, vocab=32000, seq_len=4096, tie=False, **extra):
    return dict(family="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads or heads,
                ffn_hidden=ffn, vocab=vocab, seq_len=seq_len, tie_embeddings=tie, **extra)


# Llama 3.1 / 3.2 rope scaling as in their config.json files.
_L31 = RopeScaling(8.0, 1.0, 4.0, 8192)
_L32 = RopeScaling(32.0, 1.0, 4.0, 8192)
_LLAMA3 = dict(vocab=128256, seq_len=8192, rope_theta=500000.0)
_LLAMA31 = dict(_LLAMA3, rope_scaling=_L31, max_positions=131072)
_LLAMA32 = dict(_LLAMA3, rope_scaling=_L32, max_positions=131072, tie=True)
# Qwen2 / 2.5: bias on q, k, v only, RMSNorm eps 1e-6, rotary base 1e6 (the released config.json files).
_QWEN2 = dict(qkv_bias=True, norm_eps=1e-6, rope_theta=1000000.0, seq_len=4096)

PRESETS: dict[str, dict] = {
    # Trains in seconds on CPU; byte-level vocabulary so the text source fits it. Untied so
    # every pipeline layout can run it.
    "gpt-tiny": _gpt(4, 64, 4, vocab=256, seq_len=64, tie=False),
    # A larger CPU-feasible model for memory-accuracy runs and benchmarks.
    "gpt-mini": _gpt(6, 256, 8, vocab=256, seq_len=128, tie=False),
    # A Llama-3-style model (GQA, rotary base 500,000) that trains in seconds on CPU.
    "llama-tiny": _llama(4, 64, 4, 192, kv_heads=2, vocab=256, seq_len=64, rope_theta=500000.0),
    # GPT-2 (Radford et al., 2019) as released on the Hugging Face hub (also under its hub names).
    "gpt2-124m": _gpt(12, 768, 12),
    "gpt2-350m": _gpt(24, 1024, 16),
    "gpt2-774m": _gpt(36, 1280, 20),
    "gpt2-1.5b": _gpt(48, 1600, 25),
    "gpt2": _gpt(12, 768, 12),
    "gpt2-medium": _gpt(24, 1024, 16),
    "gpt2-large": _gpt(36, 1280, 20),
    "gpt2-xl": _gpt(48, 1600, 25),
    # A ~1.3B GPT for single-GPU benchmarks (vocab padded to a multiple of 64).
    "gpt-1.3b": _gpt(24, 2048, 16, vocab=50304, seq_len=2048),
    # Llama 2 shapes (Touvron et al., 2023); llama-* are the earlier names of llama2-*.
    "llama-7b": _llama(32, 4096, 32, 11008),
    "llama-13b": _llama(40, 5120, 40, 13824),
    "llama-70b": _llama(80, 8192, 64, 28672, kv_heads=8),
    "llama2-7b": _llama(32, 4096, 32, 11008),
    "llama2-13b": _llama(40, 5120, 40, 13824),
    "llama2-70b": _llama(80, 8192, 64, 28672, kv_heads=8),
    # Llama 3 / 3.1 / 3.2 (Llama Team 2024, Table 3; the released config.json files): GQA with 8 KV
    # heads, a 128,256-token vocabulary, rotary base 500,000, 8192-token pre-training context;
    # 3.1 and 3.2 scale the rotary frequencies for a 131,072-token context; 3.2 ties the head.
    "llama3-8b": _llama(32, 4096, 32, 14336, kv_heads=8, **_LLAMA3),
    "llama3-70b": _llama(80, 8192, 64, 28672, kv_heads=8, **_LLAMA3),
    "llama3-405b": _llama(126, 16384, 128, 53248, kv_heads=8, **_LLAMA31),  # 405B was released as 3.1 only
    "llama3.1-8b": _llama(32, 4096, 32, 14336, kv_heads=8, **_LLAMA31),
    "llama3.1-70b": _llama(80, 8192, 64, 28672, kv_heads=8, **_LLAMA31),
    "llama3.1-405b": _llama(126, 16384, 128, 53248, kv_heads=8, **_LLAMA31),
    "llama3.2-1b": _llama(16, 2048, 32, 8192, kv_heads=8, **_LLAMA32),
    "llama3.2-3b": _llama(28, 3072, 24, 8192, kv_heads=8, **_LLAMA32),
    # Mistral 7B v0.1 (Jiang et al. 2023): Llama's block with GQA and a 4096-token sliding window,
    # which is the whole causal context at seq_len <= 4096 (longer is refused). v0.3: no window,
    # a 32,768-token vocabulary and rotary base 1e6.
    "mistral-7b": _llama(32, 4096, 32, 14336, kv_heads=8, max_positions=32768, sliding_window=4096),
    "mistral-7b-v0.3": _llama(32, 4096, 32, 14336, kv_heads=8, vocab=32768, max_positions=32768,
                              rope_theta=1000000.0),
    # Qwen2 / Qwen2.5 (Yang et al. 2024).
    "qwen2-0.5b": _llama(24, 896, 14, 4864, kv_heads=2, vocab=151936, tie=True, max_positions=131072, **_QWEN2),
    "qwen2-7b": _llama(28, 3584, 28, 18944, kv_heads=4, vocab=152064, max_positions=131072, **_QWEN2),
    "qwen2.5-0.5b": _llama(24, 896, 14, 4864, kv_heads=2, vocab=151936, tie=True, max_positions=32768, **_QWEN2),
    "qwen2.5-1.5b": _llama(28, 1536, 12, 8960, kv_heads=2, vocab=151936, tie=True, max_positions=32768, **_QWEN2),
    "qwen2.5-7b": _llama(28, 3584, 28, 18944, kv_heads=4, vocab=152064, max_positions=131072, **_QWEN2),
}

SHAPE_FIELDS = ("family", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len", "tie_embeddings",
                "rope_theta", "rope_scaling", "norm_eps", "qkv_bias", "out_bias", "mlp_bias", "pad_vocab_to",
                "max_positions", "sliding_window")
# Fields that only the llama family has a use for.
_LLAMA_ONLY = ("rope_theta", "rope_scaling", "sliding_window")


class ModelFields(Protocol):
    """What `resolve_shape` reads of a model spec besides SHAPE_FIELDS: spec.ModelSpec is one. A
    protocol, not the class, because shapes sits below the spec's fields (spec_fields.py imports this module)."""

    @property
    def preset(self) -> str | None: ...
    @property
    def params(self) -> float | None: ...
    @property
    def factory(self) -> str | None: ...
    @property
    def init(self) -> str: ...
    @property
    def path(self) -> str | None: ...


def resolve_shape(m: ModelFields) -> ModelShape:
    """Merge a preset (or, with init: hf, the folder's config.json) with explicit fields into a
    full ModelShape.

    Raises:
        ConfigError: unknown preset, missing fields, inconsistent head counts, or a field the
            family cannot honour.
    """
    if m.params is not None or m.factory is not None:
        raise ConfigError("model: a size-only ({params: N}) or factory model has no GPT shape.")
    given = {key: getattr(m, key) for key in SHAPE_FIELDS if getattr(m, key) is not None}
    if isinstance(given.get("rope_scaling"), BaseModel):
        given["rope_scaling"] = RopeScaling(**given["rope_scaling"].model_dump())
    _check_init(m, given)
    base = _base_fields(m, given)
    base.update(given)
    base.setdefault("family", "gpt")
    _complete(base)
    _check_family(base)
    return ModelShape(**base)


def _check_init(m: ModelFields, given: dict) -> None:
    """model.init and model.path agree with each other and with the shape's source."""
    init = getattr(m, "init", "random")
    path = getattr(m, "path", None)
    if init != "random" and not path:
        what = "a transformers folder (config.json + *.safetensors)" if init == "hf" else \
            "a workbench checkpoint (checkpoint.uri or step directory) or a state_dict file (.safetensors, .pt)"
        raise ConfigError(f"model.init={init} needs model.path: {what}.")
    if init == "random" and path:
        raise ConfigError(f"model.path={path!r} is read only with model.init hf or checkpoint (init is random). "
                          "Set model.init, or drop model.path.")
    if init == "hf" and m.preset is not None:
        raise ConfigError(f"model: init=hf takes the shape from model.path's config.json; drop preset "
                          f"{m.preset!r} (seq_len and pad_vocab_to may be given).")
    if init == "checkpoint" and m.preset is None and not {"layers", "hidden", "heads"} & set(given):
        raise ConfigError(f"model: init=checkpoint ({path!r}) needs the model's shape: the preset or fields of the "
                          "run that wrote it (e.g. {preset: gpt-mini, init: checkpoint, path: ...}). Every weight "
                          "is checked against that shape when it loads.")


def _base_fields(m: ModelFields, given: dict) -> dict:
    """The fields the explicit ones override: the folder's config.json (init hf), the preset's, or none."""
    if getattr(m, "init", "random") == "hf":
        from workbench.hf_config import config_fields

        base = dict(config_fields(str(getattr(m, "path", None))))  # config.json alone: no weights are read
        if base.get("rope_scaling") is not None:
            base["rope_scaling"] = RopeScaling(**base["rope_scaling"])
        _check_overrides(base, given, m)
        return base
    if m.preset is not None:
        if m.preset not in PRESETS:
            hint = did_you_mean(m.preset, PRESETS)
            raise ConfigError(f"model.preset: unknown preset {m.preset!r}.{hint} Known presets: {', '.join(PRESETS)}.")
        return dict(PRESETS[m.preset])
    return {}


def _complete(base: dict) -> None:
    """Check the merged fields' head counts and fill the defaults (kv_heads, ffn_hidden, tie_embeddings)."""
    missing = [k for k in ("layers", "hidden", "heads", "vocab", "seq_len") if base.get(k) is None]
    if missing:
        raise ConfigError(
            f"model: missing {', '.join(missing)}. Give a preset (e.g. {{preset: gpt-tiny}}) or all of "
            "layers, hidden, heads, vocab, seq_len."
        )
    if base["hidden"] % base["heads"]:
        raise ConfigError(
            f"model: hidden({base['hidden']}) must be divisible by heads({base['heads']}); "
            f"e.g. heads={_divisor_near(base['hidden'], base['heads'])}."
        )
    base.setdefault("kv_heads", base["heads"])
    if base["heads"] % base["kv_heads"]:
        raise ConfigError(f"model: heads({base['heads']}) must be a multiple of kv_heads({base['kv_heads']}).")
    if base.get("ffn_hidden") is None:
        if base["family"] == "llama":
            # SwiGLU convention: 2/3 of 4h, rounded up to a multiple of 256.
            base["ffn_hidden"] = 256 * math.ceil(int(8 * base["hidden"] / 3) / 256)
        else:
            base["ffn_hidden"] = 4 * base["hidden"]
    base.setdefault("tie_embeddings", base["family"] == "gpt")


def _check_overrides(base: dict, given: dict, m: ModelFields) -> None:
    """Beside init hf/checkpoint only the training choices may be set; an architecture field that
    disagrees with the weights' own would load them into another model."""
    free = {"seq_len", "pad_vocab_to"}
    for key, value in given.items():
        if key in free or base.get(key) == value:
            continue
        raise ConfigError(f"model.{key}={value!r}, but {m.path!r} says {base.get(key)!r}: with init={m.init} the "
                          "architecture comes from the weights' own config. Drop model.{key} (seq_len and "
                          "pad_vocab_to may be set).".replace("{key}", key))


def _check_family(base: dict) -> None:
    family = base["family"]
    if family == "gpt":
        odd = [k for k in _LLAMA_ONLY if base.get(k) is not None]
        if odd:
            raise ConfigError(f"model.{odd[0]}: the gpt family has learned positions and full attention (GPT-2); "
                              f"{', '.join(odd)} belong to the llama family. Use family: llama, or drop it.")
        unbiased = [k for k in ("qkv_bias", "out_bias", "mlp_bias") if base.get(k) is False]
        if unbiased:
            raise ConfigError(f"model.{unbiased[0]}=false: the gpt family is GPT-2, with a bias on every linear. Use "
                              "family: llama for linears without bias.")
    if base.get("rope_theta") is not None and base["rope_theta"] <= 1:
        raise ConfigError(f"model.rope_theta({base['rope_theta']}) must be > 1 (the rotary base; Llama 2 uses "
                          "10000, Llama 3 500000).")
    head_dim = base["hidden"] // base["heads"]
    if family == "llama" and head_dim % 2:
        raise ConfigError(f"model: rotary embeddings rotate pairs, but hidden({base['hidden']}) / heads"
                          f"({base['heads']}) = {head_dim} is odd. Use an even head size.")
    rs = base.get("rope_scaling")
    if rs is not None and not rs.low_freq_factor < rs.high_freq_factor:
        raise ConfigError(f"model.rope_scaling: low_freq_factor({rs.low_freq_factor}) must be below "
                          f"high_freq_factor({rs.high_freq_factor}) (Llama 3.1: 1 and 4).")
    seq, window = base["seq_len"], base.get("sliding_window")
    if window is not None and seq > window:
        raise ConfigError(f"model.seq_len({seq}) exceeds model.sliding_window({window}): this model attends "
                          f"only to the last {window} tokens, and the workbench's attention is full causal. "
                          f"Use seq_len <= {window}.")
    positions = base.get("max_positions")
    if family == "gpt" and positions is not None and seq > positions:
        raise ConfigError(f"model.seq_len({seq}) exceeds model.max_positions({positions}): the gpt family has one "
                          f"learned position per token of context. Use seq_len <= {positions}.")


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending, in O(sqrt(n)) steps (n is at most a spec's bound, 2^24)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def _divisor_near(n: int, target: int) -> int:
    return min(divisors(n), key=lambda d: abs(d - target))


def forward_gemm_shapes(shape: ModelShape, tokens: int, tp: int) -> list[list[int]]:
    """(m, n, k) of a micro-batch's forward matmuls over `tokens` rows, as (tokens x in) @ (in x out):
    the q/k/v, output, MLP and head projections at tp = 1 and at `tp` (columns split)."""
    out = set()
    for t in sorted({1, tp}):
        h, kv, f, v = shape.hidden, shape.kv_dim // t or 1, shape.ffn_hidden // t or 1, shape.vocab // t or 1
        out |= {(tokens, n, k) for n, k in [(h // t or 1, h), (kv, h), (h, h // t or 1), (f, h), (h, f), (v, h)]}
    return [list(x) for x in sorted(out)]


# The non-matmul ops of a block whose time calibrate measures (hwprofile.ELEMENTWISE_OPS): the norm
# and the MLP's activation of each family, as workbench/models.py computes them.
ELEMENTWISE = {"gpt": ("layer_norm", "gelu_tanh"), "llama": ("rms_norm", "swiglu")}


def elementwise_shapes(shape: ModelShape, tokens: int, tp: int, sp: bool = False) -> list[list]:
    """(op, rows, columns) of a block's norm and activation on one tp rank over `tokens` rows: the
    norm over the hidden width (with sequence parallelism, over this rank's `tokens / tp` rows), the
    activation over the MLP's columns on the rank (`ffn_hidden / tp`)."""
    norm, act = ELEMENTWISE[shape.family]
    return [[norm, max(1, tokens // tp) if sp else tokens, shape.hidden], [act, tokens, max(1, shape.ffn_hidden // tp)]]
