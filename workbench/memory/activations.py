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
# The norms differ by device (the rest does not):
# - CPU: autocast leaves layer_norm alone (stats in the input dtype); F.rms_norm is decomposed and
#   keeps its fp32-upcast input, 1/rms and the normalized fp32 product (for the weight's gradient).
# - CUDA: autocast runs layer_norm and rms_norm in fp32 (their AutocastCUDA kernels): the norm
#   keeps an fp32 copy of its input and fp32 statistics; rms_norm is the fused kernel (input, 1/rms).
# In both, the following linear keeps the norm's output in the compute dtype.
_NORMS = {
    ("gpt", "cpu"): (("input", "h", "c"), ("mean_rstd", "2", "c")),
    ("gpt", "cuda"): (("input", "h", "f32"), ("mean_rstd", "2", "f32")),
    ("llama", "cpu"): (("input_f32", "h", "f32"), ("rstd", "1", "f32"), ("normed", "h", "f32")),
    ("llama", "cuda"): (("input_f32", "h", "f32"), ("rstd", "1", "f32")),
}
_ATTN = (("q", "h", "c", "tp"), ("k", "kv", "c", "tp"), ("v", "kv", "c", "tp"),
         ("attn.logsumexp", "a", "f32", "tp"), ("attn.output", "h", "c", "tp"))
_MLP = {
    "gpt": (("mlp.w1_out", "f", "c", "tp"), ("mlp.gelu_out", "f", "c", "tp")),
    "llama": (("mlp.w1_out", "f", "c", "tp"), ("mlp.w3_out", "f", "c", "tp"), ("mlp.silu_out", "f", "c", "tp"),
              ("mlp.product", "f", "c", "tp")),
}


def _table(family: str, device: str) -> tuple:
    norm = _NORMS[(family, "cuda" if device == "cuda" else "cpu")]

    def norm_rows(prefix):
        # The norm's output is the column-parallel linears' input: with sequence parallelism they keep
        # its sequence shard and all-gather it again in backward (parallel/sequence_parallel.py).
        return tuple((f"{prefix}.{n}", d, k, "sp") for n, d, k in norm) + ((f"{prefix}.output", "h", "c", "sp"),)

    return norm_rows("norm1") + _ATTN + norm_rows("norm2") + _MLP[family]


DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def _elements(dim: str, shape) -> int:
    return {"h": shape.hidden, "kv": shape.kv_dim, "f": shape.ffn_hidden, "a": shape.heads}.get(dim) or int(dim)


def block_tensors(shape, dtype: str, tp: int = 1, sp: bool = False, device: str = "cpu") -> list[tuple[str, float]]:
    """(name, bytes per token) of everything one block keeps for backward on one tp rank.

    device: "cpu" (measured here) or "cuda" (GPUs; differs in the norms, see _NORMS).
    """
    c = DTYPE_BYTES[dtype]
    out: list[tuple[str, float]] = []
    for name, dim, kind, split in _table(shape.family, device):
        size: float = _elements(dim, shape) * (c if kind == "c" else 4)
        if split == "tp" or (split == "sp" and sp):
            size /= tp
        out.append((name, size))
    return out


@lru_cache(maxsize=4096)
def block_bytes_per_token(shape, dtype: str, tp: int = 1, sp: bool = False, device: str = "cpu") -> float:
    return sum(b for _, b in block_tensors(shape, dtype, tp, sp, device))


def boundary_bytes_per_token(shape, dtype: str, tp: int = 1, sp: bool = False) -> float:
    """A block's input (the residual stream): all a fully checkpointed block keeps."""
    return shape.hidden * DTYPE_BYTES[dtype] / (tp if sp else 1)


def head_bytes_per_token(shape, dtype: str, tp: int = 1, sp: bool = False, device: str = "cpu") -> float:
    """Final norm + head + loss on the last stage: the norm's saved tensors, the head's input,
    log_softmax's output (fp32: the loss upcasts the logits; with tp the logits stay sharded
    over the vocabulary and the loss runs under loss_parallel, so V/tp) and the int64 targets."""
    c = DTYPE_BYTES[dtype]
    h = shape.hidden
    div = tp if sp else 1
    elements = {"h": h, "1": 1, "2": 2}
    rows = _NORMS[(shape.family, "cuda" if device == "cuda" else "cpu")]
    norm = sum(elements[d] * (c if k == "c" else 4) for _, d, k in rows) / div
    return norm + h * c + shape.vocab * 4 / tp + 8


def token_batch_bytes(global_batch: int, seq_len: int) -> int:
    """The embedding keeps its int64 token ids: a view of a whole (B, T+1) batch (the step's
    global batch with gradient accumulation, the rank's concatenated micro-batches with a
    pipeline), so that batch's storage is held once, whatever the micro-batches in flight."""
    return global_batch * (seq_len + 1) * 8


def checkpointed_blocks(blocks: range, mode: str, every: int) -> int:
    """How many of a stage's blocks recompute whole in backward (full): the stage's 1st,
    (k+1)-th, ... block, k = layout.checkpoint_every (1: all; parallel/activation_checkpointing.py counts
    positions within each stage module). `selective` recomputes no whole block."""
    return -(-len(blocks) // every) if mode == "full" else 0


def attention_core_bytes_per_token(shape, tp: int = 1) -> float:
    """What `selective` (recompute the attention core) stops saving per token of one block.

    The fused SDPA kernel keeps no s x s scores; of its saved tensors, only the fp32 log-sum-exp is
    its own: q, k, v are the core's inputs (kept to recompute it) and its output's storage is the
    one `wo` saves (measured with saved_tensors_hooks in tests/unit/test_activation_checkpointing.py).
    """
    return shape.heads * 4 / tp


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
