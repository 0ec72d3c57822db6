"""The GPT decoder family (GPT-2 and llama shapes), its presets and exact parameter counts.

Model code knows nothing about sharding: attention reads its local head count from the
tensors it gets, and the top-level forward loops over a ModuleDict of blocks keyed by index,
so a pipeline stage that drops blocks (or the embedding, or the head) keeps stable names.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from workbench.errors import ConfigError

if TYPE_CHECKING:
    from workbench.spec import JobSpec, ModelSpec


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
    # Llama 2 shapes (Touvron et al., 2023).
    "llama-7b": _llama(32, 4096, 32, 11008),
    "llama-13b": _llama(40, 5120, 40, 13824),
    "llama-70b": _llama(80, 8192, 64, 28672, kv_heads=8),
}

SHAPE_FIELDS = ("family", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len", "tie_embeddings")


def resolve_shape(m: "ModelSpec") -> ModelShape:
    """Merge a preset with explicit fields into a full ModelShape.

    Raises:
        ConfigError: unknown preset, missing fields, or inconsistent head counts.
    """
    if m.params is not None or m.factory is not None:
        raise ConfigError("model: a size-only ({params: N}) or factory model has no GPT shape.")
    base: dict = {}
    if m.preset is not None:
        if m.preset not in PRESETS:
            import difflib

            guess = difflib.get_close_matches(m.preset, PRESETS, n=1)
            hint = f" Did you mean {guess[0]!r}?" if guess else ""
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


def _divisor_near(n: int, target: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: abs(d - target))


# -- the modules -------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _norm(shape: ModelShape) -> nn.Module:
    return nn.LayerNorm(shape.hidden) if shape.family == "gpt" else RMSNorm(shape.hidden)


def _rope_tables(seq_len: int, head_dim: int, device=None):
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)  # (T, D/2)
    return angles.cos(), angles.sin()


def _apply_rope(x, cos, sin):
    # x: (B, T, H, D); rotate pairs (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos)
    T = x.shape[1]
    cos, sin = cos[:T, None, :], sin[:T, None, :]
    x0, x1 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        bias = shape.family == "gpt"
        self.head_dim = shape.head_dim
        self.rope = shape.family == "llama"
        self.wq = nn.Linear(shape.hidden, shape.hidden, bias=bias)
        self.wk = nn.Linear(shape.hidden, shape.kv_dim, bias=bias)
        self.wv = nn.Linear(shape.hidden, shape.kv_dim, bias=bias)
        self.wo = nn.Linear(shape.hidden, shape.hidden, bias=bias)

    def forward(self, x, rope=None):
        B, T, _ = x.shape
        # Head counts come from the tensors, so a tensor-parallel shard just has fewer heads.
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, Hq, D)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, Hkv, D)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        if self.rope:
            q, k = _apply_rope(q, *rope), _apply_rope(k, *rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.swiglu = shape.family == "llama"
        bias = not self.swiglu
        self.w1 = nn.Linear(shape.hidden, shape.ffn_hidden, bias=bias)
        self.w2 = nn.Linear(shape.ffn_hidden, shape.hidden, bias=bias)
        self.w3 = nn.Linear(shape.hidden, shape.ffn_hidden, bias=False) if self.swiglu else None

    def forward(self, x):
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.attn_norm = _norm(shape)
        self.attn = Attention(shape)
        self.mlp_norm = _norm(shape)
        self.mlp = MLP(shape)

    def forward(self, x, rope=None):
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Decoder-only transformer. forward(tokens (B, T) int64) -> logits (B, T, vocab).

    On a pipeline stage, `tok_emb`/`pos_emb` (first stage) and `norm`/`head` (last stage) may
    be None; forward then takes and returns hidden states (B, T, C).
    """

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.shape = shape
        self.tok_emb = nn.Embedding(shape.vocab, shape.hidden)
        self.pos_emb = nn.Embedding(shape.seq_len, shape.hidden) if shape.family == "gpt" else None
        self.blocks = nn.ModuleDict({str(i): Block(shape) for i in range(shape.layers)})
        self.norm = _norm(shape)
        self.head = nn.Linear(shape.hidden, shape.vocab, bias=False)
        if shape.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self._rope = None

    def rope_tables(self, device):
        if self.shape.family != "llama":
            return None
        if self._rope is None or self._rope[0].device != device:
            self._rope = _rope_tables(self.shape.seq_len, self.shape.head_dim, device)
        return self._rope

    def forward(self, x):
        if self.tok_emb is not None:
            T = x.shape[1]
            h = self.tok_emb(x)  # (B, T, C)
            if self.pos_emb is not None:
                h = h + self.pos_emb(torch.arange(T, device=x.device))
            x = h
        rope = self.rope_tables(x.device)
        for block in self.blocks.values():
            x = block(x, rope)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)  # (B, T, vocab)
        return x


# -- building -----------------------------------------------------------------------------


def build_model_meta(spec: "JobSpec") -> nn.Module:
    """The model with parameters on the meta device (no memory), ready to be parallelized."""
    m = spec.model
    if m.params is not None:
        raise ConfigError(
            f"model: {{params: {m.params:g}}} is a size alone, for planning (workbench memory/plan). "
            "To run, give a preset or a shape, e.g. model: {preset: gpt-tiny}."
        )
    if m.factory is not None:
        with torch.device("meta"):
            return call_factory(m.factory, m.kwargs)
    with torch.device("meta"):
        return GPT(m.shape())


def call_factory(path: str, kwargs: dict) -> nn.Module:
    module_name, sep, attr = path.partition(":")
    if not sep:
        raise ConfigError(f"model.factory {path!r}: expected 'pkg.module:function'.")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"model.factory {path!r}: cannot import it ({e}). Is the module on PYTHONPATH?") from None
    model = fn(**kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.factory {path!r} returned {type(model).__name__}, not a torch.nn.Module.")
    return model


def build_model(spec: "JobSpec | dict | str") -> nn.Module:
    """The model materialized on CPU with the spec's deterministic initialization.

    Args:
        spec: a JobSpec, or anything `load_spec` accepts.
    Returns:
        An nn.Module whose forward(tokens) returns logits.
    """
    from workbench.runtime.materialize import materialize
    from workbench.spec import load_spec

    spec = load_spec(spec)
    model = build_model_meta(spec)
    materialize(model, torch.device("cpu"), seed=spec.train.seed)
    return model


def shape_dict(spec: "JobSpec") -> dict:
    return asdict(spec.model.shape())
