"""Activation bytes held for backward, from the tensors `workbench.models` really saves.

The per-block tables below list what autograd keeps for one token of one block of our GPT
(verified against `torch.autograd.graph.saved_tensors_hooks` in tests/unit/test_memory_activations.py).
Attention is `F.scaled_dot_product_attention(is_causal=True)`: the flash / memory-efficient
kernels (and PyTorch's CPU flash kernel) keep q, k, v, the output and a log-sum-exp of H floats
per token, never the s x s score matrix. Korthikanti et al.'s formula, which assumes the
unfused softmax and dropout, is `korthikanti_layer_bytes` for comparison.
"""
from __future__ import annotations

from functools import lru_cache

# (name, elements per token, dtype, split): dtype "c" is the compute dtype, "f32" always fp32;
# split "tp": divided by tp, "sp": divided by tp only with sequence parallelism, "rep": never.
_GPT = (
    ("ln1.input", "h", "c", "sp"), ("ln1.mean_rstd", "2", "c", "sp"), ("ln1.output", "h", "c", "rep"),
    ("q", "h", "c", "tp"), ("k", "kv", "c", "tp"), ("v", "kv", "c", "tp"),
    ("attn.logsumexp", "a", "f32", "tp"), ("attn.output", "h", "c", "tp"),
    ("ln2.input", "h", "c", "sp"), ("ln2.mean_rstd", "2", "c", "sp"), ("ln2.output", "h", "c", "rep"),
    ("mlp.w1_out", "f", "c", "tp"), ("mlp.gelu_out", "f", "c", "tp"),
)
# F.rms_norm on CPU is decomposed: it keeps its input upcast to fp32, 1/rms and the normalized
# fp32 product (for the weight's gradient); the linear keeps the output in the compute dtype.
_LLAMA = (
    ("rms1.input_f32", "h", "f32", "sp"), ("rms1.rstd", "1", "f32", "sp"), ("rms1.normed", "h", "f32", "sp"),
    ("rms1.output", "h", "c", "rep"),
    ("q_rope", "h", "c", "tp"), ("k_rope", "kv", "c", "tp"), ("v", "kv", "c", "tp"),
    ("attn.logsumexp", "a", "f32", "tp"), ("attn.output", "h", "c", "tp"),
    ("rms2.input_f32", "h", "f32", "sp"), ("rms2.rstd", "1", "f32", "sp"), ("rms2.normed", "h", "f32", "sp"),
    ("rms2.output", "h", "c", "rep"),
    ("mlp.w1_out", "f", "c", "tp"), ("mlp.w3_out", "f", "c", "tp"), ("mlp.silu_out", "f", "c", "tp"),
    ("mlp.product", "f", "c", "tp"),
)
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def _elements(dim: str, shape) -> int:
    return {"h": shape.hidden, "kv": shape.kv_dim, "f": shape.ffn_hidden, "a": shape.heads}.get(dim) or int(dim)


def block_tensors(shape, dtype: str, tp: int = 1, sp: bool = False) -> list[tuple[str, float]]:
    """(name, bytes per token) of everything one block keeps for backward on one tp rank."""
    c = DTYPE_BYTES[dtype]
    out = []
    for name, dim, kind, split in _GPT if shape.family == "gpt" else _LLAMA:
        size = _elements(dim, shape) * (c if kind == "c" else 4)
        if split == "tp" or (split == "sp" and sp):
            size /= tp
        out.append((name, size))
    return out


@lru_cache(maxsize=4096)
def block_bytes_per_token(shape, dtype: str, tp: int = 1, sp: bool = False) -> float:
    return sum(b for _, b in block_tensors(shape, dtype, tp, sp))


def boundary_bytes_per_token(shape, dtype: str, tp: int = 1, sp: bool = False) -> float:
    """A block's input (the residual stream): all a fully checkpointed block keeps."""
    return shape.hidden * DTYPE_BYTES[dtype] / (tp if sp else 1)


def head_bytes_per_token(shape, dtype: str, tp: int = 1, sp: bool = False) -> float:
    """Final norm + head + loss on the last stage: the norm's saved tensors, the head's input,
    log_softmax's output (fp32: the loss upcasts the logits) and the int64 targets."""
    c = DTYPE_BYTES[dtype]
    h = shape.hidden
    div = tp if sp else 1
    if shape.family == "gpt":
        norm = (h + 2) * c / div
    else:
        norm = (2 * h + 1) * 4 / div
    return norm + h * c + shape.vocab * 4 + 8


def token_batch_bytes(global_batch: int, seq_len: int) -> int:
    """The embedding keeps its int64 token ids: a view of the step's whole (B, T+1) batch, so
    the whole batch's storage is held once, whatever the micro-batches in flight."""
    return global_batch * (seq_len + 1) * 8


def checkpointed_blocks(blocks: range, mode: str, every: int) -> int:
    """How many of a stage's blocks recompute in backward: all (full), or blocks 0, k, 2k, ...
    (selective, k = layout.checkpoint_every), counted by global block index."""
    if mode == "full":
        return len(blocks)
    if mode == "selective":
        return sum(1 for b in blocks if b % every == 0)
    return 0


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False) -> float:
    """Korthikanti et al. 2022 (arXiv:2205.05198), bytes per transformer layer, fp16, no recompute.

    No parallelism: s*b*h*(34 + 5*a*s/h). Tensor parallel: s*b*h*(10 + 24/t + 5*a*s/(h*t)).
    With sequence parallelism: s*b*h/t*(34 + 5*a*s/h). It assumes the unfused softmax (the
    5*a*s^2*b term: scores, softmax, dropout mask and output) and two dropout masks.
    """
    if t == 1:
        return s * b * h * (34 + 5 * a * s / h)
    if sp:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def ours_in_korthikanti_terms(s: int, b: int, h: int, a: int) -> dict[str, float]:
    """Our GPT block (fp16, SDPA flash path) split like Korthikanti's terms, in bytes.

    The difference to their 34 sbh + 5 a s^2 b: no dropout (-2 sbh of masks) and a fused
    attention that keeps q, k, v, output and a log-sum-exp instead of the s x s matrices.
    """
    return {
        "attention (ln out, q, k, v, out)": 2 * s * b * h * 5,
        "attention softmax (log-sum-exp, fp32)": 4 * a * s * b,
        "mlp (ln out, 4h in, 4h gelu out)": s * b * h * (2 + 8 + 8),
        "layer norms (inputs)": 4 * s * b * h,
        "layer norm stats": 2 * 2 * 2 * s * b,
    }
