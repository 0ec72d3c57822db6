"""Start from released weights: `model: {init: hf, path: DIR}` (a local transformers folder) and
`model: {init: checkpoint, path: ...}` (a workbench checkpoint or a state_dict file of our model).

Planning reads DIR/config.json alone (`config_fields`). Loading happens in
runtime.materialize: every rank reads, for each parameter it holds, only its slice (its tensor-
parallel rows or columns, its pipeline stage's blocks, its FSDP shard), through safetensors'
lazy `get_slice`, and converts HF's naming and conventions into ours with export.py's links (the
same table the export writes with, read backwards). No rank ever holds the whole model.

A checkpoint is data: safetensors have no code, .pt files load with weights_only=True, workbench
checkpoints through checkpoint_safe's allow-listed readers; nothing is downloaded, no
trust_remote_code.
"""
from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from workbench.shapes import ModelShape

MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KiB
MAX_INDEX_BYTES = 64 << 20  # model.safetensors.index.json: one line per tensor (405B: ~100 KiB)
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "GPT2LMHeadModel": "gpt2"}
_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "gpt2": "gpt2"}
# Tensors some checkpoints carry that are buffers, not parameters (recomputed here).
_BUFFERS = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


# -- the shape: config.json alone ----------------------------------------------------------------


def source_fields(m) -> dict:
    """The shape fields (ModelSpec names) of model.path: config.json for init hf; the run's own
    spec for a workbench checkpoint (init checkpoint). Reads no weights."""
    if m.init == "hf":
        return dict(config_fields(m.path))
    return checkpoint_fields(m.path)


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
    try:
        with open(path, "rb") as f:
            raw = json.loads(f.read(MAX_CONFIG_BYTES + 1))
    except (OSError, ValueError, RecursionError) as e:
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
    elif c.get("model_type") in _MODEL_TYPES:
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
    """The spec's own bounds (workbench.spec_input) on every number, each error naming config.json's field."""
    from pydantic import ValidationError

    from workbench.spec import ModelSpec

    plain = {k: v for k, v in fields.items() if k != "rope_scaling"}
    try:
        ModelSpec(**plain)
    except ValidationError as e:
        err = e.errors()[0]
        ours = str(err["loc"][0]) if err["loc"] else "?"
        theirs = _HF_NAMES["gpt2" if kind == "gpt2" else "llama"].get(ours, ours)
        raise ConfigError(f"{where}: {theirs}={_short(fields.get(ours))} is out of bounds ({err['msg']}): not a "
                          "model this workbench can plan or build.") from None


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
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf"):
            raise ConfigError(f"{self.where}: {key}={_short(v)} must be a positive number.")
        return float(v)

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
    from workbench.shapes import RopeScaling

    try:
        rs = RopeScaling(float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"]),
                         int(params["original_max_position_embeddings"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{get.where}: {field} of type llama3 needs factor, low_freq_factor, high_freq_factor and "
                          f"original_max_position_embeddings ({type(e).__name__}: {e}).") from None
    if not (rs.factor > 0 and 0 < rs.low_freq_factor < rs.high_freq_factor and rs.original_max_position_embeddings > 0):
        raise ConfigError(f"{get.where}: {field}={_short(params)}: needs factor > 0 and 0 < low_freq_factor < "
                          "high_freq_factor.")
    out["rope_scaling"] = rs
    return out


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


def checkpoint_fields(path: str) -> dict:
    """The shape fields a workbench checkpoint was written with (its manifest's spec)."""
    from dataclasses import fields

    from workbench.export import checkpoint_dir
    from workbench.runtime.checkpoint_store import manifest_spec
    from workbench.shapes import ModelShape
    from workbench.spec import load_spec

    if not os.path.isdir(path) and "://" not in path:
        raise ConfigError(f"model.init=checkpoint with a file ({path!r}): give the model's shape too (a preset or "
                          "layers/hidden/heads/...); a state_dict file does not say it. A workbench checkpoint "
                          "directory does.")
    _, manifest = checkpoint_dir(path)
    spec = load_spec(manifest_spec(manifest, path))
    if spec.model.factory is not None or spec.model.params is not None:
        raise ConfigError(f"model.path={path!r} is a checkpoint of a factory model: init=checkpoint loads the "
                          "built-in GPT/llama family.")
    shape = spec.model.shape()
    return {f.name: getattr(shape, f.name) for f in fields(ModelShape)}


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


# -- the weights: each rank its own slices -------------------------------------------------------


def local_index(param) -> tuple[slice, ...]:
    """The region of the full tensor this rank's `param` (plain or DTensor) holds."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return tuple(slice(0, d) for d in param.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, local_shape))


class SliceReader:
    """Named tensors read by region without loading them whole: safetensors files (lazily, with
    get_slice) or a .pt state dict (memory-mapped, weights_only)."""

    def __init__(self, files: dict[str, str], where: str):
        self.where = where
        self._files = files  # tensor name -> file
        self._handles: dict[str, Any] = {}
        self._pt: dict | None = None

    @classmethod
    def hf_folder(cls, directory: str) -> SliceReader:
        d = Path(directory).expanduser()
        index = d / "model.safetensors.index.json"
        if index.is_file():
            return cls(_index_files(index), str(d))
        single = d / "model.safetensors"
        if single.is_file():
            return cls({name: str(single) for name in _safetensor_names(single)}, str(d))
        other = sorted(p.name for p in d.glob("*.bin"))[:3]
        hint = f" It has {', '.join(other)}: pickles, which are never loaded here; convert them to safetensors " \
               "(transformers: save_pretrained(..., safe_serialization=True))." if other else ""
        raise ConfigError(f"model.path={directory!r}: no model.safetensors or model.safetensors.index.json.{hint}")

    @classmethod
    def state_dict_file(cls, path: str) -> SliceReader:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ConfigError(f"model.path={path!r}: no such file or checkpoint directory.")
        if p.suffix == ".safetensors":
            return cls({name: str(p) for name in _safetensor_names(p)}, str(p))
        if p.suffix in (".pt", ".pth"):
            reader = cls({}, str(p))
            reader._pt = _load_pt(p)
            reader._files = {name: str(p) for name in reader._pt}
            return reader
        raise ConfigError(f"model.path={path!r}: a state_dict file is .safetensors, or .pt/.pth (read as data, "
                          "weights_only=True).")

    def names(self) -> set[str]:
        return set(self._files)

    def _slice(self, name: str):
        if self._pt is not None:
            return self._pt[name]
        from safetensors import safe_open

        file = self._files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        s = self._slice(name)
        return tuple(s.shape) if self._pt is not None else tuple(s.get_shape())

    def dtype(self, name: str) -> str:
        s = self._slice(name)
        return str(s.dtype).replace("torch.", "") if self._pt is not None else str(s.get_dtype())

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The region `index` of tensor `name`. The file is mapped for this read only: the pages a
        read touches leave the process with the mapping, so they never add up over a whole file."""
        if self._pt is not None:
            return self._pt[name][index]
        from safetensors import safe_open

        self._handles.clear()  # the metadata checks' mappings
        with safe_open(self._files[name], framework="pt") as f:
            return f.get_slice(name)[index]

    def close(self) -> None:
        self._handles.clear()
        self._pt = None


def _safetensor_names(path: Path) -> list[str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a safetensors file ({type(e).__name__}: {str(e)[:200]}).") from None


def _index_files(index: Path) -> dict[str, str]:
    if index.stat().st_size > MAX_INDEX_BYTES:
        raise ConfigError(f"{index}: larger than {MAX_INDEX_BYTES:,} bytes; an index names one file per tensor.")
    try:
        raw = json.loads(index.read_bytes())
        weight_map = raw["weight_map"]
        assert isinstance(weight_map, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError, RecursionError):
        raise ConfigError(f"{index}: not a safetensors index (a JSON object with a weight_map).") from None
    out = {}
    for name, file in weight_map.items():
        # Plain names of files beside the index: never a path elsewhere.
        if not isinstance(file, str) or not file.endswith(".safetensors") or "/" in file or "\\" in file \
                or file.startswith("."):
            raise ConfigError(f"{index}: weight_map[{_short(name)}]={_short(file)} is not a .safetensors file name "
                              "beside the index.")
        path = index.parent / file
        if not path.is_file():
            raise ConfigError(f"{index}: names {file}, which is missing (missing weights: {_short(name)}).")
        out[name] = str(path)
    return out


def _load_pt(path: Path) -> dict:
    import pickle

    import torch

    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, ValueError, EOFError) as e:
        raise ConfigError(f"{path}: does not load as a plain state_dict (weights_only=True: tensors and containers "
                          f"only): {type(e).__name__}: {str(e)[:200]}.") from None
    if isinstance(obj, dict) and set(obj) == {"model"} and isinstance(obj["model"], dict):
        obj = obj["model"]
    if not isinstance(obj, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in obj.items()):
        raise ConfigError(f"{path}: not a state_dict (a mapping of parameter names to tensors).")
    from workbench.runtime.materialize import canonical_name

    return {canonical_name(k): v for k, v in obj.items()}


class WeightLoader:
    """Fills a model's parameters (each rank's own slices) from HF weights or a state dict of ours.

    Links (export.hf_links) say where each parameter lives; for a state dict of our own model,
    every link is the identity.
    """

    def __init__(self, reader: SliceReader, shape: ModelShape, links: dict):
        self.reader, self.shape, self.links = reader, shape, links
        self._check()

    def _check(self) -> None:
        """Every tensor we need is there with the shape we expect; no weight would go unused."""
        import torch

        from workbench.export import to_hf
        from workbench.models import GPT

        with torch.device("meta"):
            meta = GPT(self.shape)
        full = {k: v for k, v in meta.state_dict().items() if k in self.links}
        want = {name: tuple(t.shape) for name, t in to_hf(full, self.shape).items()} if self._hf else \
            {k: tuple(v.shape) for k, v in full.items()}
        have = self.reader.names()
        self._alias = {}
        for name in want:
            if name not in have:
                for prefix in ("transformer.", "model."):  # the oldest GPT-2 files have no "transformer."
                    if name.startswith(prefix) and name[len(prefix):] in have:
                        self._alias[name] = name[len(prefix):]
        missing = [n for n in want if n not in have and n not in self._alias]
        if missing:
            raise ConfigError(f"{self.reader.where}: missing weights {', '.join(missing[:4])}"
                              f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''} (of {len(want)}): the "
                              "weights do not belong to this model's config (or the folder is incomplete).")
        for name, shape in want.items():
            got = self.reader.shape(self._alias.get(name, name))
            if got != shape:
                raise ConfigError(f"{self.reader.where}: weight {name} has shape {list(got)}, but the config says "
                                  f"{list(shape)}: the weights do not belong to this config.")
            dtype = self.reader.dtype(self._alias.get(name, name)).lower()
            if not any(t in dtype for t in ("float", "f16", "f32", "f64", "bf16", "half", "double")):
                raise ConfigError(f"{self.reader.where}: weight {name} is {dtype}, not floating point (quantized?).")
        used = set(want) | set(self._alias.values())
        tied_head = {"lm_head.weight", "head.weight"} if self.shape.tie_embeddings else set()
        extra = sorted(n for n in have - used if n not in tied_head and not n.endswith(_BUFFERS))
        if extra:
            raise ConfigError(f"{self.reader.where}: weights {', '.join(extra[:4])}"
                              f"{f' and {len(extra) - 4} more' if len(extra) > 4 else ''} have no place in this "
                              "model: the checkpoint is another architecture than its config says.")

    @property
    def _hf(self) -> bool:
        return any(link.hf != link.ours for link in self.links.values())

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """ours[index] (fp32), reading only the part of the stored tensor that holds it."""
        import torch

        link = self.links.get(name)
        if link is None:
            raise ConfigError(f"{self.reader.where}: no weight for parameter {name}.")
        rows = index[0]
        r0, r1 = rows.start, rows.stop
        if r1 <= r0 or any(s.stop <= s.start for s in index[1:]):
            return torch.empty(tuple(s.stop - s.start for s in index), dtype=torch.float32)
        lo, hi = r0, r1
        if link.rope_heads:  # the HF rows of the whole heads that hold [r0, r1)
            d = link.head_dim
            lo, hi = r0 // d * d, -(-r1 // d) * d
        stored_hi = min(hi, link.vocab) if link.vocab else hi  # padding rows are not stored
        part = torch.zeros((hi - lo, *(s.stop - s.start for s in index[1:])), dtype=torch.float32)
        if stored_hi > lo:
            off = link.offset
            rest = index[1:]
            if link.transpose:
                hf_index = (rest[0], slice(off + lo, off + stored_hi))
            else:
                hf_index = (slice(off + lo, off + stored_hi), *rest)
            t = self.reader.read(self._alias.get(link.hf, link.hf), hf_index)
            part[: stored_hi - lo] = (t.t() if link.transpose else t).float()
        if link.rope_heads:
            part = _unpermute(part, link.head_dim)
        return part[r0 - lo: r1 - lo]

    def close(self) -> None:
        self.reader.close()


def _unpermute(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    from workbench.export import rope_unpermute

    return rope_unpermute(rows, rows.shape[0] // head_dim)


def open_loader(source: tuple[str, str], shape: ModelShape):
    """The loader for a model's init_source: ("hf", DIR) or ("checkpoint", PATH)."""
    kind, path = source
    if kind == "hf":
        from workbench.export import hf_links

        return WeightLoader(SliceReader.hf_folder(path), shape, hf_links(shape))
    if os.path.isdir(path) or "://" in path:
        return CheckpointLoader(path, shape)
    from workbench.export import Link

    reader = SliceReader.state_dict_file(path)
    import torch

    from workbench.models import GPT

    with torch.device("meta"):
        names = list(GPT(shape).state_dict())
    if shape.tie_embeddings:
        names.remove("head.weight")
    return WeightLoader(reader, shape, {n: Link(n, n) for n in names})


class CheckpointLoader:
    """A workbench checkpoint (DCP) as init: the fp32 master when the run kept one, else its
    model weights; DCP reads each rank's regions (any layout to any layout)."""

    def __init__(self, path: str, shape: ModelShape):
        from workbench.export import checkpoint_dir
        from workbench.runtime.checkpoint_safe import reader_for

        self.url, _ = checkpoint_dir(path)
        self.reader = reader_for("://" not in self.url)
        self.meta = self.reader(self.url).read_metadata().state_dict_metadata
        self.shape, self.where = shape, path

    def fill(self, named: list[tuple[str, Any]]) -> None:
        import torch.distributed.checkpoint as dcp

        from workbench.runtime.checkpoint_safe import SafeLoadPlanner

        state = {}
        for name, param in named:
            key = f"master.master.{name}" if f"master.master.{name}" in self.meta else f"model.{name}"
            saved = self.meta.get(key)
            if saved is None or tuple(saved.size) != tuple(param.shape):
                what = "lacks it" if saved is None else f"has it as {list(saved.size)}"
                raise ConfigError(f"model.path={self.where!r}: parameter {name} {list(param.shape)}: the checkpoint "
                                  f"{what}; it was written by another model shape.")
            state[key] = param
        dcp.load(state, storage_reader=self.reader(self.url), planner=SafeLoadPlanner(), no_dist=True)

    def close(self) -> None:
        pass
