"""What goes into a checkpoint besides DCP's own work: the model view over pipeline stages,
RNG states, the CPU copy for background saves and the size of a rank's share.

No torch.distributed collectives here; checkpoint.py runs those.
"""
from __future__ import annotations

import copy
import random

import torch
import torch.nn as nn


def state_dict_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Flattened optimizer state: hyper-parameters per parameter name, not per param group, so
    # pipeline ranks (each with its own group of different parameters) do not overwrite each
    # other's groups in the deduplicated checkpoint, and any layout can load it (torchtitan does this).
    return StateDictOptions(flatten_optimizer_state_dict=True)


def union_module(modules: list[nn.Module]) -> nn.Module:
    """One module whose parameter names are the full model's, over several stage modules.

    Pipeline stages are copies of the model with blocks removed, so their names never clash;
    this view (it shares the modules, copies nothing) lets DCP see one model.
    """
    root = nn.Module()
    for m in modules:
        _merge_into(root, m)
    return root


def _merge_into(dst: nn.Module, src: nn.Module) -> None:
    for name, p in src._parameters.items():
        if p is not None:
            dst.register_parameter(name, p)
    for name, b in src._buffers.items():
        if b is not None:
            dst.register_buffer(name, b, persistent=name not in src._non_persistent_buffers_set)
    for name, child in src._modules.items():
        if child is None:
            continue
        if name in dst._modules and isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            _merge_into(dst._modules[name], child)
        elif isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            dst._modules[name] = nn.Module()
            _merge_into(dst._modules[name], child)
        else:
            dst._modules[name] = child


def rng_state() -> dict:
    """This process's random number generator states (torch CPU and CUDA, Python, NumPy) as tensors,
    ints and floats only: a checkpoint's RNG file loads with weights_only=True (checkpoint_safe)."""
    import numpy as np

    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {"torch": torch.get_rng_state(),
             "python": torch.tensor(internal, dtype=torch.int64), "python_version": version, "python_gauss": gauss,
             "numpy": torch.from_numpy(keys.astype(np.int64)), "numpy_pos": int(pos),
             "numpy_has_gauss": int(has_gauss), "numpy_gauss": float(cached)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore `rng_state()`'s output. Raises ValueError when it is not such a state."""
    import numpy as np

    try:
        python = (int(state["python_version"]), tuple(int(x) for x in state["python"].tolist()),
                  state["python_gauss"])
        numpy = ("MT19937", state["numpy"].numpy().astype(np.uint32), int(state["numpy_pos"]),
                 int(state["numpy_has_gauss"]), float(state["numpy_gauss"]))
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(state["torch"])
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise ValueError(f"not an RNG state written by this version ({type(e).__name__}: {e})") from None
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def stage(obj, cache: dict | None = None, key: str = ""):
    """A CPU copy of a state dict, for a background save.

    Plain tensors are copied into `cache`'s buffers from the previous save when their shape and
    dtype match (first-touch allocation costs more than the copy); DTensors are cloned.
    """
    if isinstance(obj, torch.Tensor):
        if cache is None or hasattr(obj, "to_local"):
            return obj.detach().to("cpu", copy=True)
        buf = cache.get(key)
        if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
            buf = cache[key] = torch.empty(obj.shape, dtype=obj.dtype, device="cpu")
        return buf.copy_(obj.detach())
    if isinstance(obj, dict):
        return {k: stage(v, cache, f"{key}/{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(stage(v, cache, f"{key}/{i}") for i, v in enumerate(obj))
    return copy.deepcopy(obj)


def state_bytes(obj) -> int:
    """Bytes of the tensors this rank holds in a state dict (local shards of DTensors)."""
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def saved_keys(state: dict, names: dict[str, str]) -> tuple[dict, dict]:
    """`state` ({"model": ..., "optim": ..., extras}) with its parameter names as saved, and the way back.

    `names` (parallel/tied.saved_names) maps a parameter name to its saved name; model keys are
    parameter names, flattened optimizer keys `state.<name>.<field>` / `param_groups.<name>.<hyper>`.
    Two keys with one saved name (a tied head and its embedding) keep the first: the same values.
    Returns:
        (the renamed state, {part: {key in the module's state dict: saved key}} for model and optim).
    """
    out, back = dict(state), {}
    for part in ("model", "optim"):
        if part not in state:
            continue
        renamed, keys = {}, {}
        for key, value in state[part].items():
            saved = _saved_key(key, names, optim=part == "optim")
            keys[key] = saved
            renamed.setdefault(saved, value)
        out[part], back[part] = renamed, keys
    return out, back


def _saved_key(key: str, names: dict[str, str], *, optim: bool) -> str:
    if not optim:
        return names.get(key, key)
    kind, _, rest = key.partition(".")
    name, _, field = rest.rpartition(".")
    return f"{kind}.{names[name]}.{field}" if name in names else key


def module_keys(part: dict, keys: dict[str, str]) -> dict:
    """A state dict keyed as the module's (`saved_keys`' way back) from one keyed as saved."""
    return {key: part[saved] for key, saved in keys.items()}
