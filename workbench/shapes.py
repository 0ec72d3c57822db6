"""Model shapes and presets: the GPT/llama architecture as numbers, with exact parameter counts.

Torch-free (no allocation), so planning, validation and the memory model never import torch;
`workbench.models` builds the nn.Module from a ModelShape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workbench.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    from workbench.spec import ModelSpec


@dataclass(frozen=True)
class ModelShape:
    family: str  # "gpt" | "llama"
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    seq_len: int
    tie_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def num_params(self) -> int:
        """Exact parameter count, computed from the shape (no allocation)."""
        return self.embedding_params() + self.layers * self.block_params() + self.final_params()

    def embedding_params(self) -> int:
        pos = self.seq_len * self.hidden if self.family == "gpt" else 0
        return self.vocab * self.hidden + pos

    def block_params(self) -> int:
        h, f, kv = self.hidden, self.ffn_hidden, self.kv_dim
        attn = 2 * h * h + 2 * h * kv
        if self.family == "gpt":
            attn += 2 * h + 2 * kv  # q, k, v, o biases
            mlp = 2 * h * f + f + h
            norms = 2 * 2 * h  # two LayerNorms with bias
        else:
            mlp = 3 * h * f
            norms = 2 * h  # two RMSNorms
        return attn + mlp + norms

    def final_params(self) -> int:
        norm = 2 * self.hidden if self.family == "gpt" else self.hidden
        head = 0 if self.tie_embeddings else self.vocab * self.hidden
        return norm + head


def _gpt(layers, hidden, heads, vocab=50257, seq_len=1024, tie=True):
    return dict(family="gpt", layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq_len=seq_len, tie_embeddings=tie)


def _llama(layers, hidden, heads, ffn, kv_heads=None, vocab=32000, seq_len=4096):
    return dict(family="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads or heads,
                ffn_hidden=ffn, vocab=vocab, seq_len=seq_len, tie_embeddings=False)


PRESETS: dict[str, dict] = {
    # Trains in seconds on CPU; byte-level vocabulary so the text source fits it. Untied so
    # every pipeline layout can run it.
    "gpt-tiny": _gpt(4, 64, 4, vocab=256, seq_len=64, tie=False),
    # A larger CPU-feasible model for memory-accuracy runs and benchmarks.
    "gpt-mini": _gpt(6, 256, 8, vocab=256, seq_len=128, tie=False),
    # GPT-2 (Radford et al., 2019) as released on the Hugging Face hub.
    "gpt2-124m": _gpt(12, 768, 12),
    "gpt2-350m": _gpt(24, 1024, 16),
    "gpt2-774m": _gpt(36, 1280, 20),
    "gpt2-1.5b": _gpt(48, 1600, 25),
    # A ~1.3B GPT for single-GPU benchmarks (vocab padded to a multiple of 64).
    "gpt-1.3b": _gpt(24, 2048, 16, vocab=50304, seq_len=2048),
    # Llama 2 shapes (Touvron et al., 2023); llama-* are the earlier names of llama2-*.
    "llama-7b": _llama(32, 4096, 32, 11008),
    "llama-13b": _llama(40, 5120, 40, 13824),
    "llama-70b": _llama(80, 8192, 64, 28672, kv_heads=8),
    "llama2-7b": _llama(32, 4096, 32, 11008),
    "llama2-13b": _llama(40, 5120, 40, 13824),
    "llama2-70b": _llama(80, 8192, 64, 28672, kv_heads=8),
    # Llama 3 / 3.1 (Llama Team 2024, Table 3; the released config.json files): GQA with 8 KV heads,
    # a 128,256-token vocabulary, 8192-token pre-training context. (Rotary base 500,000 there,
    # 10,000 in our module; it changes no shape or count.)
    "llama3-8b": _llama(32, 4096, 32, 14336, kv_heads=8, vocab=128256, seq_len=8192),
    "llama3-70b": _llama(80, 8192, 64, 28672, kv_heads=8, vocab=128256, seq_len=8192),
    "llama3-405b": _llama(126, 16384, 128, 53248, kv_heads=8, vocab=128256, seq_len=8192),
}

SHAPE_FIELDS = ("family", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len", "tie_embeddings")


def resolve_shape(m: ModelSpec) -> ModelShape:
    """Merge a preset with explicit fields into a full ModelShape.

    Raises:
        ConfigError: unknown preset, missing fields, or inconsistent head counts.
    """
    if m.params is not None or m.factory is not None:
        raise ConfigError("model: a size-only ({params: N}) or factory model has no GPT shape.")
    base: dict = {}
    if m.preset is not None:
        if m.preset not in PRESETS:
            hint = did_you_mean(m.preset, PRESETS)
            raise ConfigError(f"model.preset: unknown preset {m.preset!r}.{hint} Known presets: {', '.join(PRESETS)}.")
        base = dict(PRESETS[m.preset])
    for key in SHAPE_FIELDS:
        value = getattr(m, key)
        if value is not None:
            base[key] = value
    base.setdefault("family", "gpt")
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
    return ModelShape(**base)


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
