"""Start from released weights: `model: {init: hf, path: DIR}` (a local transformers folder) and
`model: {init: checkpoint, path: ...}` (a workbench checkpoint or a state_dict file of our model).

Planning reads DIR/config.json alone (`config_fields`). Loading happens in
parallel.materialize: every rank reads, for each parameter it holds, only its slice (its tensor-
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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.errors import ConfigError
from workbench.hf_config import ARCHITECTURES, _short, config_fields  # noqa: F401 - re-exported

# model.safetensors.index.json: one line per tensor (Llama 3.1 405B: ~100 KiB; DeepSeek-V3's 91k tensors: 9 MiB)
MAX_INDEX_BYTES = 16 << 20
# Tensors some checkpoints carry that are buffers, not parameters (recomputed here).
_BUFFERS = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")

if TYPE_CHECKING:
    import torch

    from workbench.shapes import ModelShape

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
    out: dict[str, str] = {}
    held: dict[str, set[str]] = {}  # file -> the tensor names its header lists (each file read once)
    for name, file in weight_map.items():
        # Plain names of files beside the index: never a path elsewhere.
        if not isinstance(file, str) or not file.endswith(".safetensors") or "/" in file or "\\" in file \
                or file.startswith("."):
            raise ConfigError(f"{index}: weight_map[{_short(name)}]={_short(file)} is not a .safetensors file name "
                              "beside the index.")
        path = index.parent / file
        if file not in held:
            if not path.is_file():
                raise ConfigError(f"{index}: names {file}, which is missing (missing weights: {_short(name)}).")
            held[file] = set(_safetensor_names(path))
        if name not in held[file]:
            raise ConfigError(f"{index}: weight_map maps {_short(name)} to {file}, which does not hold it (its header lists "
                              f"{len(held[file]):,} tensors, not that one): the index does not belong to these files. Save "
                              "the folder again (save_pretrained) or fetch its index and shards from one release.")
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
    from workbench.models import canonical_name

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
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

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
        try:
            dcp.load(state, storage_reader=self.reader(self.url), planner=SafeLoadPlanner(), no_dist=True)
        except (Exception, CheckpointException) as e:  # files that passed size, CRC-32 and the pickle scan
            from workbench.runtime.checkpoint_safe import unsafe_cause
            from workbench.runtime.checkpoint_store import describe_error

            cause = unsafe_cause(e)
            why = f"holds files that are not plain checkpoint data ({cause})" if cause else \
                f"does not load ({describe_error(e)})"
            raise ConfigError(f"model.path={self.where!r}: checkpoint {self.url} {why}; nothing in it was run. "
                              "Start from a checkpoint written by workbench that nobody else can write to.") from None

    def close(self) -> None:
        pass
