"""Checkpoints are data: every pickle in one is read with an allow-list, so a planted payload is
refused instead of run.

torch.distributed.checkpoint reads its `.metadata` with a bare `pickle.load` and the non-tensor
values of a state dict (an optimizer's param_groups, a loss scaler's state) with
`torch.load(weights_only=False)`; its tensors already go through `weights_only=True`. The readers
and the planner here close those two doors: `.metadata` may only name DCP's own metadata classes,
torch sizes, dtypes and layouts and paths; values load with `weights_only=True`. The RNG files
(checkpoint_state.rng_state) hold tensors, ints and floats only, read with `weights_only=True`.
"""
from __future__ import annotations

import io
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

# (module, name) pairs a DCP .metadata pickle may name (torch 2.6 .. 2.13 write these)
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "TensorStorageMetadata",
                                              "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint._extension": {"StreamTransformExtension"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint file that would run code or build objects we never write."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _METADATA_CLASSES.get(module, ()) or module == "torch" and isinstance(getattr(torch, name, None),
                                                                                          torch.dtype):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"it names {module}.{name}, which a checkpoint's metadata never holds")


def load_metadata(stream):
    """DCP's Metadata from a `.metadata` stream, allow-listed (UnsafeCheckpoint otherwise)."""
    try:
        return _MetadataUnpickler(stream).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # a torn or foreign file: not DCP metadata at all
        raise UnsafeCheckpoint(f"it is not DCP metadata ({type(e).__name__}: {e})") from None


def load_value(data: io.BytesIO | bytes):
    """A non-tensor state value (param_groups, a scaler's scale...): weights_only, or UnsafeCheckpoint."""
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        return torch.load(stream, weights_only=True)
    except pickle.UnpicklingError as e:  # a global outside torch's allow-list, or not a pickle at all
        raise UnsafeCheckpoint(f"a value is not plain data ({str(e).splitlines()[-1] if str(e) else e})") from None
    except Exception as e:  # torn, empty or random bytes under a re-signed CRC-32
        raise UnsafeCheckpoint(f"a value does not load ({type(e).__name__}: {str(e)[:200]})") from None


def check_paths(metadata) -> None:
    """Every storage location of a step's metadata is a plain file name in the step's folder: a
    forged `.metadata` must not send a read to any other file (which no manifest lists or checks)."""
    for info in getattr(metadata, "storage_data", {}).values():
        rel = str(getattr(info, "relative_path", ""))
        if not rel or rel in (".", "..") or "/" in rel or "\\" in rel or rel.startswith("."):
            raise UnsafeCheckpoint(f"its metadata points a read at {rel[:200]!r}, outside the step's own files")


class _SafeMetadata:
    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f)
        check_paths(metadata)
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    """FileSystemReader whose metadata is read with the allow-list."""


class SafeFsspecReader(_SafeMetadata, FsspecReader):
    """FsspecReader (object stores, FUSE stand-ins) whose metadata is read with the allow-list."""


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor values load with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:  # DefaultLoadPlanner's, but weights_only
        from torch.distributed.checkpoint._traverse import set_element

        obj = load_value(value)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def reader_for(local: bool):
    """The safe DCP reader class for a store (local folders, or fsspec URLs)."""
    return SafeFileSystemReader if local else SafeFsspecReader


def scan_step(store, step: int, manifest: dict) -> list[str]:
    """Problems with the pickles of one committed step, without loading any tensor: its `.metadata`,
    every non-tensor value it points to and every RNG file ("file: why"; empty when all are data).

    Args:
        store: the checkpoint_store.Store; step, manifest: a step that passed Store.verify.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    directory, problems = store.step_dir(step), []
    for rel in sorted(manifest.get("files", {})):
        try:
            with store.fs.open(f"{directory}/{rel}", "rb") as f:
                if rel == ".metadata":
                    metadata = load_metadata(f)
                    check_paths(metadata)
                    unlisted = sorted({i.relative_path for i in metadata.storage_data.values()}
                                      - set(manifest.get("files", {})))
                    if unlisted:
                        raise UnsafeCheckpoint(f"its metadata reads {unlisted[:3]}, which the manifest does not list")
                elif rel.startswith("rng-rank") and rel.endswith(".pt"):
                    load_value(f.read())
        except UnsafeCheckpoint as e:
            problems.append(f"{rel}: not plain checkpoint data ({e})")
    if problems or ".metadata" not in manifest.get("files", {}):
        return problems
    for fqn, item in getattr(metadata, "state_dict_metadata", {}).items():
        if not isinstance(item, BytesStorageMetadata):
            continue  # tensors load with weights_only=True inside DCP
        info = metadata.storage_data.get(MetadataIndex(fqn))
        if info is None or getattr(info, "transform_descriptors", None):
            continue  # nothing to read here (compressed values: the planner still loads them as data)
        try:
            with store.fs.open(f"{directory}/{info.relative_path}", "rb") as f:
                f.seek(info.offset)
                load_value(f.read(info.length))
        except UnsafeCheckpoint as e:
            problems.append(f"{info.relative_path} (value {fqn!r}): not plain checkpoint data ({e})")
        except (OSError, ValueError) as e:
            problems.append(f"{info.relative_path} (value {fqn!r}): unreadable ({type(e).__name__})")
    return problems


def unsafe_cause(e: BaseException) -> pickle.UnpicklingError | None:
    """The UnsafeCheckpoint behind an exception (DCP wraps each rank's failure), or None."""
    from workbench.runtime.checkpoint_store import causes

    # DCP loads tensor items with weights_only=True itself: its refusal is a plain UnpicklingError
    return next((c for c in causes(e) if isinstance(c, pickle.UnpicklingError)), None)
