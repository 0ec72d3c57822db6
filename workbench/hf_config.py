"""A transformers folder's config.json as the spec's model fields (`model: {init: hf, path: DIR}`).

Torch-free and read alone, so planning (`memory`, `plan`, `validate`, the notebook) resolves a
released model's shape without touching its weights; workbench/hf_import.py loads the weights.
Anything the workbench cannot honour is refused with the field named.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from workbench.errors import ConfigError

MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KiB
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "GPT2LMHeadModel": "gpt2"}
_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "gpt2": "gpt2"}


# -- the shape: config.json alone ----------------------------------------------------------------


def config_fields(directory: str) -> dict:
    """ModelSpec fields from DIR/config.json (cached by the file's identity).

    Raises:
        ConfigError: no folder or config.json, an architecture other than Llama, Mistral, Qwen2 or
            GPT-2, or a field we cannot honour (named).
    """
    path = Path(directory).expanduser() / "config.json"
    try:
        st = path.stat()
    except OSError:
        raise ConfigError(f"model.path={directory!r}: no config.json there. init=hf reads a local transformers "
                          "folder (config.json + model*.safetensors), as save_pretrained writes it.") from None
    return _config_fields(str(path.resolve()), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=64)
def _config_fields(path: str, _mtime: int, size: int) -> dict:
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {size:,} bytes, but a config.json is a few KiB (at most {MAX_CONFIG_BYTES:,} "
                          "read). Point model.path at a transformers folder.")
    from workbench.spec_input import read_bounded

    data = read_bounded(Path(path), "model.path's config.json", MAX_CONFIG_BYTES)  # a FIFO would block open()
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"{path}: not readable JSON ({type(e).__name__}: {str(e)[:200]}).") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a config.json is a JSON object, got {type(raw).__name__}.")
    return _map_config(raw, path)


def _map_config(c: dict, where: str) -> dict:
    archs = c.get("architectures")
    kind = None
    if isinstance(archs, list) and archs:
        if len(archs) != 1 or not isinstance(archs[0], str) or archs[0] not in ARCHITECTURES:
            raise ConfigError(f"{where}: architectures={_short(archs)} is not one the workbench can load; it loads "
                              f"{', '.join(ARCHITECTURES)} (model.init=hf).")
        kind = ARCHITECTURES[archs[0]]
    elif isinstance(c.get("model_type"), str) and c["model_type"] in _MODEL_TYPES:
        kind = _MODEL_TYPES[c["model_type"]]
    else:
        raise ConfigError(f"{where}: no architectures (or model_type) the workbench can load: model_type="
                          f"{_short(c.get('model_type'))}; it loads {', '.join(ARCHITECTURES)}.")
    if c.get("quantization_config") is not None:
        raise ConfigError(f"{where}: quantization_config is set: quantized weights cannot be trained here. Use the "
                          "model's unquantized release.")
    if c.get("auto_map") is not None:
        raise ConfigError(f"{where}: auto_map names remote code (trust_remote_code), which is never run here; the "
                          "workbench loads the built-in architectures only.")
    get = _Getter(c, where)
    out = _gpt2_fields(get) if kind == "gpt2" else _llama_fields(get, kind)
    _check_bounds(out, where, kind)
    return out


_HF_NAMES = {"gpt2": {"layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "ffn_hidden": "n_inner",
                      "max_positions": "n_positions", "seq_len": "n_positions", "norm_eps": "layer_norm_epsilon"},
             "llama": {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
                       "kv_heads": "num_key_value_heads", "ffn_hidden": "intermediate_size",
                       "max_positions": "max_position_embeddings", "seq_len": "max_position_embeddings",
                       "norm_eps": "rms_norm_eps"}}


def _check_bounds(fields: dict, where: str, kind: str) -> None:
    """The spec's own bounds (workbench.spec_input, as ModelSpec applies them) on every number,
    each error naming config.json's field."""
    from workbench.spec_input import MAX_FFN, MAX_LAYERS, MAX_SEQ, MAX_VOCAB, MAX_WIDTH

    bounds = {"layers": MAX_LAYERS, "hidden": MAX_WIDTH, "heads": MAX_WIDTH, "kv_heads": MAX_WIDTH,
              "ffn_hidden": MAX_FFN, "vocab": MAX_VOCAB, "seq_len": MAX_SEQ, "max_positions": MAX_SEQ,
              "sliding_window": MAX_SEQ}
    for ours, top in bounds.items():
        v = fields.get(ours)
        if v is not None and not 0 < v <= top:
            theirs = _HF_NAMES["gpt2" if kind == "gpt2" else "llama"].get(ours, ours)
            raise ConfigError(f"{where}: {theirs}={_short(v)} is out of bounds (1 to {top:,}): not a model this "
                              "workbench can plan or build.")
    eps = fields.get("norm_eps")
    if eps is not None and not 0 < eps < 1:
        theirs = _HF_NAMES["gpt2" if kind == "gpt2" else "llama"]["norm_eps"]
        raise ConfigError(f"{where}: {theirs}={_short(eps)} must be between 0 and 1.")


class _Getter:
    """Typed reads of config.json fields, each error naming the field."""

    def __init__(self, c: dict, where: str):
        self.c, self.where = c, where

    def int(self, key: str, default: Any = ..., lo: int = 1) -> Any:
        v = self.c.get(key, default)
        if v is ...:
            raise ConfigError(f"{self.where}: {key} is missing.")
        if v is None and default is None:
            return None
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ConfigError(f"{self.where}: {key}={_short(v)} must be an integer >= {lo}.")
        return v

    def float(self, key: str, default: Any = ...) -> float:
        v = self.c.get(key, default)
        if v is ...:
            raise ConfigError(f"{self.where}: {key} is missing.")
        number = _finite(v)
        if number is None or not number > 0:
            raise ConfigError(f"{self.where}: {key}={_short(v)} must be a finite positive number.")
        return number

    def bool(self, key: str, default: bool) -> bool:
        v = self.c.get(key, default)
        if not isinstance(v, bool):
            raise ConfigError(f"{self.where}: {key}={_short(v)} must be true or false.")
        return v

    def refuse(self, key: str, why: str) -> None:
        raise ConfigError(f"{self.where}: {key}={_short(self.c.get(key))}: {why}")


def _llama_fields(get: _Getter, kind: str) -> dict:
    c = get.c
    hidden, heads = get.int("hidden_size"), get.int("num_attention_heads")
    out = {"family": "llama", "layers": get.int("num_hidden_layers"), "hidden": hidden, "heads": heads,
           "kv_heads": get.int("num_key_value_heads", heads), "ffn_hidden": get.int("intermediate_size"),
           "vocab": get.int("vocab_size"), "max_positions": get.int("max_position_embeddings"),
           "norm_eps": get.float("rms_norm_eps", 1e-6),
           "tie_embeddings": get.bool("tie_word_embeddings", False)}
    out["seq_len"] = out["max_positions"]
    if c.get("hidden_act", "silu") != "silu":
        get.refuse("hidden_act", "the llama family's MLP is SwiGLU (silu); other activations are not built here.")
    head_dim = c.get("head_dim")
    if head_dim is not None and (heads == 0 or head_dim != hidden // heads or hidden % heads):
        get.refuse("head_dim", f"heads here have hidden_size / num_attention_heads = {hidden // max(heads, 1)} "
                               "features; a separate head_dim is not built.")
    if kind == "qwen2":
        out.update(qkv_bias=True, out_bias=False, mlp_bias=False)
        if get.bool("use_sliding_window", False):
            out["sliding_window"] = get.int("sliding_window")
    else:
        bias = get.bool("attention_bias", False)
        out.update(qkv_bias=bias, out_bias=bias, mlp_bias=get.bool("mlp_bias", False))
        if kind == "mistral":
            window = get.int("sliding_window", 4096) if "sliding_window" in c else 4096  # MistralConfig's default
            if window is not None:
                out["sliding_window"] = window
        elif c.get("attention_bias") and kind != "llama":
            get.refuse("attention_bias", f"{kind} has no attention bias.")
    if c.get("pretraining_tp", 1) not in (1, None):
        get.refuse("pretraining_tp", "a sliced-matmul emulation (Llama 2's) that changes the numerics; the "
                                     "workbench computes the plain product. Set it to 1.")
    out.update(_rope(get))
    return out


def _rope(get: _Getter) -> dict:
    """rope_theta and Llama 3.1 scaling from transformers v5's rope_parameters or v4's
    rope_theta + rope_scaling."""
    c = get.c
    params = c.get("rope_parameters")
    if params is None:
        scaling = c.get("rope_scaling")
        params = {**(scaling if isinstance(scaling, dict) else {}), "rope_theta": c.get("rope_theta", 10000.0)}
        if scaling is not None and not isinstance(scaling, dict):
            get.refuse("rope_scaling", "must be an object.")
        field = "rope_scaling"
    else:
        field = "rope_parameters"
    if not isinstance(params, dict):
        get.refuse(field, "must be an object.")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", 10000.0)
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not 1 < theta < 1e12:
        raise ConfigError(f"{get.where}: rope_theta={_short(theta)} must be a number above 1.")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{get.where}: {field}.partial_rotary_factor={_short(params['partial_rotary_factor'])}: "
                          "rotary embeddings here rotate the whole head.")
    out: dict = {"rope_theta": float(theta)}
    if kind in ("default", None):
        return out
    if kind != "llama3":
        raise ConfigError(f"{get.where}: {field}.rope_type={_short(kind)} is not supported: the workbench builds the "
                          "default rotary embedding and Llama 3.1's 'llama3' scaling.")
    missing = [k for k in _LLAMA3_KEYS if k not in params]
    if missing:
        raise ConfigError(f"{get.where}: {field} of type llama3 needs factor, low_freq_factor, high_freq_factor and "
                          f"original_max_position_embeddings; {', '.join(missing)} missing.")
    rs = {k: _llama3_number(get.where, field, k, params[k]) for k in _LLAMA3_KEYS}
    if not rs["low_freq_factor"] < rs["high_freq_factor"]:
        raise ConfigError(f"{get.where}: {field}.low_freq_factor={rs['low_freq_factor']:g} must be below "
                          f"high_freq_factor={rs['high_freq_factor']:g} (Llama 3.1: 1 and 4).")
    out["rope_scaling"] = rs  # shapes.resolve_shape makes it a RopeScaling
    return out


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_MAX_ROPE_FACTOR = 1e6  # Llama 3.1 uses 8; the frequencies it divides stay normal floats far beyond


def _llama3_number(where: str, field: str, key: str, v: Any) -> float | int:
    """One number of llama3 rope scaling: a finite positive float, or an integer number of
    positions within the spec's bound (original_max_position_embeddings)."""
    from workbench.spec_input import MAX_SEQ

    number = _finite(v)
    if key == "original_max_position_embeddings":
        if number is None or number != int(number) or not 0 < number <= MAX_SEQ:
            raise ConfigError(f"{where}: {field}.{key}={_short(v)} must be a whole number of positions from 1 to "
                              f"{MAX_SEQ:,} (Llama 3.1: 8192).")
        return int(number)
    if number is None or not 0 < number <= _MAX_ROPE_FACTOR:
        raise ConfigError(f"{where}: {field}.{key}={_short(v)} must be a finite positive number up to "
                          f"{_MAX_ROPE_FACTOR:g} (Llama 3.1: factor 8, low_freq_factor 1, high_freq_factor 4).")
    return number


def _finite(v: Any) -> float | None:
    """`v` as a finite float, or None for anything else (bools, strings, lists, inf, NaN, 10**400)."""
    import math

    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        number = float(v)
    except OverflowError:  # an integer literal beyond float range
        return None
    return number if math.isfinite(number) else None


def _gpt2_fields(get: _Getter) -> dict:
    c = get.c
    hidden = get.int("n_embd")
    out = {"family": "gpt", "layers": get.int("n_layer"), "hidden": hidden, "heads": get.int("n_head"),
           "vocab": get.int("vocab_size"), "max_positions": get.int("n_positions"),
           "ffn_hidden": get.int("n_inner", None) or 4 * hidden, "norm_eps": get.float("layer_norm_epsilon", 1e-5),
           "tie_embeddings": get.bool("tie_word_embeddings", True)}
    out["seq_len"] = out["max_positions"]
    if c.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        get.refuse("activation_function", "the gpt family's MLP uses the tanh GELU (gelu_new).")
    if not get.bool("scale_attn_weights", True):
        get.refuse("scale_attn_weights", "attention here is scaled by 1/sqrt(head size).")
    if get.bool("scale_attn_by_inverse_layer_idx", False):
        get.refuse("scale_attn_by_inverse_layer_idx", "attention here is scaled by 1/sqrt(head size) alone.")
    return out


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."
