"""Where checkpoints live: directory layout, the manifest (the commit record), verification and
retention, on a local path or any fsspec URI (s3://, gs://, az://, memory://).

A checkpoint is the directory `step-000000042/` holding torch.distributed.checkpoint's files,
one RNG file per rank and `manifest.json`. The manifest is written last and lists every file
with its size and CRC-32: a directory without a readable manifest is never loaded, and one whose
files do not match it is reported as corrupt. On local disks the files are first written to
`step-000000042.partial/` and the finished directory is renamed into place (atomic there).
"""
from __future__ import annotations

import errno
import json
import os
import re
import time
import zlib

MANIFEST = "manifest.json"
FORMAT = 1
_STEP_RE = re.compile(r"^step-(\d{9})(\.partial)?$")
_CHUNK = 4 << 20


class CorruptCheckpoint(Exception):
    """A checkpoint directory whose manifest is missing, unreadable or does not match its files."""


def step_name(step: int) -> str:
    return f"step-{step:09d}"


class Store:
    """The checkpoints under one URI.

    Args:
        uri: a local path or an fsspec URL; credentials come from the usual environment
            (never from the spec).
    """

    def __init__(self, uri: str):
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        self.uri = uri
        self.fs, root = fsspec.core.url_to_fs(uri)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.root = os.path.abspath(root) if self.local else root.rstrip("/")

    # -- paths --------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def url(self, path: str) -> str:
        """The user-facing address of `path` (a plain path on local disks)."""
        return path if self.local else self.fs.unstrip_protocol(path)

    def staging_dir(self, step: int) -> str:
        """Where step's files are written before the commit."""
        return self.path(step_name(step) + (".partial" if self.local else ""))

    def step_dir(self, step: int) -> str:
        return self.path(step_name(step))

    def _entries(self) -> list[tuple[int, bool, str]]:
        """(step, partial, path) of every step-like directory under the root."""
        if not self.fs.exists(self.root):
            return []
        out = []
        for info in self.fs.ls(self.root, detail=True):
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            m = _STEP_RE.match(name)
            if m and info.get("type") == "directory":
                out.append((int(m.group(1)), bool(m.group(2)), info["name"].rstrip("/")))
        return out

    def committed_steps(self) -> list[int]:
        """Steps whose directory has a manifest file, newest first (not yet verified)."""
        steps = [s for s, partial, p in self._entries() if not partial and self.fs.exists(f"{p}/{MANIFEST}")]
        return sorted(steps, reverse=True)

    # -- manifest -----------------------------------------------------------------------
    def read_manifest(self, step: int) -> dict:
        """The manifest of a committed step. Raises CorruptCheckpoint if unreadable."""
        try:
            with self.fs.open(f"{self.step_dir(step)}/{MANIFEST}", "rb") as f:
                manifest = json.loads(f.read().decode())
        except (OSError, ValueError) as e:
            raise CorruptCheckpoint(f"manifest unreadable ({type(e).__name__}: {e})") from e
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("step") != step:
            raise CorruptCheckpoint(f"manifest is not a format-{FORMAT} manifest of step {step}")
        return manifest

    def latest_manifest(self) -> dict | None:
        """The newest readable manifest (files not verified), or None when there is none."""
        for step in self.committed_steps():
            try:
                return self.read_manifest(step)
            except CorruptCheckpoint:
                continue
        return None

    def list_files(self, directory: str) -> list[str]:
        """Paths of the files under `directory`, relative to it, sorted."""
        prefix = directory.rstrip("/") + "/"
        return sorted(p[len(prefix):] for p in self.fs.find(directory) if p.startswith(prefix))

    def checksum(self, path: str) -> dict:
        """{"bytes": size, "crc32": crc} of one file, streamed."""
        crc, size = 0, 0
        with self.fs.open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                crc, size = zlib.crc32(chunk, crc), size + len(chunk)
        return {"bytes": size, "crc32": crc}

    def write_manifest(self, directory: str, manifest: dict) -> None:
        """Write the manifest last; a single object PUT (or a local rename) makes it atomic."""
        data = json.dumps(manifest, indent=1, sort_keys=True).encode()
        target = f"{directory}/{MANIFEST}"
        if self.local:
            tmp = f"{target}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        else:
            self.fs.pipe_file(target, data)

    def commit(self, step: int) -> str:
        """Move a finished staging directory into place; returns the checkpoint's URL."""
        final = self.step_dir(step)
        if self.local:
            if os.path.exists(final):  # a half-written leftover of an earlier attempt
                self.fs.rm(final, recursive=True)
            os.replace(self.staging_dir(step), final)
            _fsync_dir(self.root)
        return self.url(final)

    def verify(self, step: int, manifest: dict, rank: int = 0, world: int = 1) -> list[str]:
        """Problems with this rank's share of the step's files (empty when they match)."""
        directory, problems = self.step_dir(step), []
        for rel in sorted(manifest.get("files", {}))[rank::world]:
            expected = manifest["files"][rel]
            try:
                got = self.checksum(f"{directory}/{rel}")
            except (OSError, FileNotFoundError) as e:
                problems.append(f"{rel}: unreadable ({type(e).__name__})")
                continue
            if got["bytes"] != expected["bytes"]:
                problems.append(f"{rel}: {got['bytes']} bytes, manifest says {expected['bytes']} (truncated?)")
            elif got["crc32"] != expected["crc32"]:
                problems.append(f"{rel}: CRC-32 mismatch (corrupted)")
        return problems

    def write_torch(self, path: str, obj) -> None:
        import torch

        with self.fs.open(path, "wb") as f:
            torch.save(obj, f)

    def read_torch(self, path: str):
        import torch

        with self.fs.open(path, "rb") as f:
            return torch.load(f, weights_only=False)  # our own RNG states (Python and NumPy objects)

    # -- retention ----------------------------------------------------------------------
    def prune(self, keep: int, *, current: int) -> list[int]:
        """Delete all but the newest `keep` committed checkpoints, and stale partial ones.

        Directories at or above `current` without a manifest are left alone (`current` is the
        step just committed; nothing newer is being written by this job).
        """
        committed = self.committed_steps()
        removed = []
        for step, partial, path in self._entries():
            stale = (partial or step not in committed) and step < current
            if stale or (step in committed and step not in committed[:keep]):
                self.remove(path)
                removed.append(step)
        return sorted(set(removed))

    def remove(self, path: str) -> None:
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass


def _fsync_dir(path: str) -> None:
    """Persist a rename: fsync the directory entry (POSIX)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def new_manifest(step: int, spec: dict, world_size: int, files: dict, save_s: float) -> dict:
    return {"format": FORMAT, "step": step, "spec": spec, "world_size": world_size,
            "layout": spec.get("layout", {}), "files": files, "created_unix": time.time(),
            "save_s": round(save_s, 4)}


def describe_error(e: BaseException) -> str:
    """A one-line cause, unwrapping DCP's per-rank CheckpointException; names a full disk."""
    causes = list(_causes(e))
    for inner in causes:
        if isinstance(inner, OSError) and inner.errno == errno.ENOSPC:
            return f"no space left on device ({inner})"
    root = causes[-1] if len(causes) > 1 and getattr(e, "failures", None) else e
    return f"{type(root).__name__}: {str(root).splitlines()[0] if str(root) else ''}"


def disk_full(store: Store, need_bytes: int) -> str | None:
    """On a local disk, a failure with less free space than the checkpoint needs is a full disk.

    torch.save's zip writer turns the OSError(ENOSPC) of a full disk into "unexpected pos", so
    the cause is recovered from the volume itself.
    """
    import shutil

    if not store.local:
        return None
    path = store.root
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    free = shutil.disk_usage(path).free
    if free >= need_bytes:
        return None
    return (f"no space left on device: {free / 2**20:.1f} MiB free on the volume of {store.root}, this rank's "
            f"checkpoint needs about {need_bytes / 2**20:.1f} MiB")


def _causes(e: BaseException):
    seen, todo = set(), [e]
    while todo:
        cur = todo.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        yield cur
        todo += [cur.__cause__, cur.__context__]
        for failure in (getattr(cur, "failures", None) or {}).values():  # DCP: {rank: (exc, tb)}
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
