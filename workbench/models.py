"""The GPT decoder family (GPT-2 and llama shapes) as nn.Modules; shapes and presets are in workbench.shapes.

Model code knows nothing about sharding: attention reads its local head count from the
tensors it gets, and the top-level forward loops over a ModuleDict of blocks keyed by index,
so a pipeline stage that drops blocks (or the embedding, or the head) keeps stable names.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from workbench.errors import ConfigError
from workbench.shapes import PRESETS, SHAPE_FIELDS, ModelShape, resolve_shape  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from workbench.spec import JobSpec


# -- the modules -------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _norm(shape: ModelShape) -> nn.Module:
    if shape.family == "gpt":
        return nn.LayerNorm(shape.hidden, eps=shape.norm_eps)
    return RMSNorm(shape.hidden, eps=shape.norm_eps)


def rope_frequencies(shape: ModelShape, device=None) -> torch.Tensor:
    """The rotary inverse frequencies (D/2,) in fp32, computed as transformers computes them
    (the default and the "llama3" rope types), so the angles match to the bit."""
    d = shape.head_dim
    inv = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    rs = shape.rope_scaling
    if rs is None:
        return inv
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rope_tables(shape: ModelShape, device=None):
    inv = rope_frequencies(shape, device)
    angles = torch.outer(torch.arange(shape.seq_len, device=device, dtype=torch.float32), inv)  # (T, D/2)
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
        bias = bool(shape.qkv_bias)
        self.head_dim = shape.head_dim
        self.rope = shape.family == "llama"
        self.wq = nn.Linear(shape.hidden, shape.hidden, bias=bias)
        self.wk = nn.Linear(shape.hidden, shape.kv_dim, bias=bias)
        self.wv = nn.Linear(shape.hidden, shape.kv_dim, bias=bias)
        self.wo = nn.Linear(shape.hidden, shape.hidden, bias=bool(shape.out_bias))

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
        bias = bool(shape.mlp_bias)
        self.w1 = nn.Linear(shape.hidden, shape.ffn_hidden, bias=bias)
        self.w2 = nn.Linear(shape.ffn_hidden, shape.hidden, bias=bias)
        self.w3 = nn.Linear(shape.hidden, shape.ffn_hidden, bias=bias) if self.swiglu else None

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
        self.tok_emb = nn.Embedding(shape.padded_vocab, shape.hidden)
        self.pos_emb = nn.Embedding(shape.max_positions, shape.hidden) if shape.family == "gpt" else None
        self.blocks = nn.ModuleDict({str(i): Block(shape) for i in range(shape.layers)})
        self.norm = _norm(shape)
        self.head = nn.Linear(shape.hidden, shape.padded_vocab, bias=False)
        if shape.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self._rope = None

    def rope_tables(self, device):
        if self.shape.family != "llama":
            return None
        if self._rope is None or self._rope[0].device != device:
            self._rope = _rope_tables(self.shape, device)
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
            x = self.head(x)  # (B, T, padded vocab)
            if self.shape.padded_vocab != self.shape.vocab:
                x = mask_padded_logits(x, self.shape.vocab)
        return x


def mask_padded_logits(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """The logits of the padding rows (ids >= vocab) set to the dtype's lowest value: exp() of it
    is 0 in the softmax, so the loss, its gradients and sampling are those of the unpadded model
    (the padding rows get no gradient). Vocab-sharded DTensor logits (tp) are masked per shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = logits.to_local()
        _, offset = compute_local_shape_and_global_offset(logits.shape, logits.device_mesh, logits.placements)
        cols = torch.arange(offset[-1], offset[-1] + local.shape[-1], device=local.device)
        local = local.masked_fill(cols >= vocab, torch.finfo(local.dtype).min)
        return DTensor.from_local(local, logits.device_mesh, logits.placements, shape=logits.shape,
                                  stride=logits.stride())
    cols = torch.arange(logits.shape[-1], device=logits.device)
    return logits.masked_fill(cols >= vocab, torch.finfo(logits.dtype).min)


# -- building -----------------------------------------------------------------------------


def build_model_meta(spec: JobSpec) -> nn.Module:
    """The model with parameters on the meta device (no memory), ready to be parallelized."""
    m = spec.model
    if m.factory is not None:
        from workbench.factory import build_factory_meta

        return build_factory_meta(m.factory, m.kwargs)
    if m.params is not None:
        raise ConfigError(
            f"model: {{params: {m.params:g}}} is a size alone, for planning (workbench memory/plan). "
            "To run, give a preset or a shape, e.g. model: {preset: gpt-tiny}."
        )
    with torch.device("meta"):
        model = GPT(m.shape())
    if m.init != "random":
        # Read by parallel.materialize: each rank then loads its own slices of these weights.
        model.init_source = (m.init, m.path)
    return model


# Wrappers that insert a level into parameter names; stripped to get the canonical name.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.", "module.")


def canonical_name(name: str) -> str:
    """A parameter's name in our model, whatever wraps it (activation checkpointing, compile, FSDP, DDP)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name
