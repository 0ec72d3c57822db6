"""Where checkpoints live: directory layout, the manifest (the commit record), verification and
retention, on a local path or any fsspec URI (s3://, gs://, az://, memory://).

A checkpoint is the directory `step-000000042/` holding torch.distributed.checkpoint's files,
one RNG file per rank and `manifest.json`. Each rank writes its files where its node can (a
local folder, a FUSE mount, an object store); rank 0 writes the manifest last, listing every
rank's files with size and CRC-32. A step is complete iff its manifest is readable and every
file it lists is present and matches: no directory rename anywhere, so stores that cannot rename
(Cloud Storage FUSE, blobfuse, object stores) and per-node folders merged by a sync both work.
"""
from __future__ import annotations

import errno
import json
import os
import re
import time
import zlib

MANIFEST = "manifest.json"
FORMAT = 1  # unchanged by per-rank commits: the manifest lists files as before
_STEP_RE = re.compile(r"^step-(\d{9})(\.partial)?$")  # .partial: staging folders of format-1 writers
_CHUNK = 4 << 20
# A manifest lists two files per rank (~150 bytes each) and the spec: 8 MiB holds ~25,000 ranks.
MAX_MANIFEST_BYTES = 8 << 20
RESUME_OR_FRESH = "or-fresh"  # resume=...: start at step 1 when every checkpoint is rejected
RUN_ID_KEY = "run_id"  # the manifest key of the run that wrote a checkpoint


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
        # A subclass with a protocol of its own (e.g. a FUSE stand-in) goes through fsspec, not os.
        self.local = isinstance(self.fs, LocalFileSystem) and "file" in _protocols(self.fs)
        self.root = os.path.abspath(root) if self.local else root.rstrip("/")

    # -- paths --------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def url(self, path: str) -> str:
        """The user-facing address of `path` (a plain path on local disks)."""
        return path if self.local else self.fs.unstrip_protocol(path)

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
        """Steps whose directory has a manifest file in this view, newest first (not yet verified)."""
        steps = [s for s, partial, p in self._entries() if not partial and self.fs.exists(f"{p}/{MANIFEST}")]
        return sorted(steps, reverse=True)

    def view_id(self) -> str:
        """Names this rank's view of the store: ranks with the same id see the same files."""
        import socket

        return f"{socket.gethostname()}:{self.root}" if self.local else self.url(self.root)

    # -- manifest -----------------------------------------------------------------------
    def read_manifest(self, step: int) -> dict:
        """The manifest of a committed step, read only from a regular file of at most
        MAX_MANIFEST_BYTES (a pipe or a huge file costs nothing). Raises CorruptCheckpoint if unreadable."""
        path = f"{self.step_dir(step)}/{MANIFEST}"
        try:
            info = self.fs.info(path)
            if info.get("type") != "file":  # a FIFO would block the open, a folder is no manifest
                raise CorruptCheckpoint(f"{MANIFEST} is not a regular file ({info.get('type')})")
            if (info.get("size") or 0) > MAX_MANIFEST_BYTES:
                raise CorruptCheckpoint(f"{MANIFEST} is {info['size']:,} bytes; a manifest is at most "
                                        f"{MAX_MANIFEST_BYTES:,} (it lists a few files per rank)")
            with self.fs.open(path, "rb") as f:
                data = f.read(MAX_MANIFEST_BYTES + 1)
            if len(data) > MAX_MANIFEST_BYTES:
                raise CorruptCheckpoint(f"{MANIFEST} is over {MAX_MANIFEST_BYTES:,} bytes (it grew while read)")
            manifest = json.loads(data.decode())
        except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested thousands deep
            raise CorruptCheckpoint(f"manifest unreadable ({type(e).__name__}: {str(e)[:200]})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("step") != step:
            raise CorruptCheckpoint(f"manifest is not a format-{FORMAT} manifest of step {step}")
        return manifest

    def newest_complete(self, check=None) -> tuple[dict | None, list[tuple[int, str]]]:
        """(the manifest of the newest complete step or None, [(step, why) of newer rejected ones]),
        checking every file in this one view (the driver's check before any worker starts).

        Args:
            check: (store, step, manifest) -> [problem], run on a step whose files all match
                (e.g. checkpoint_safe.scan_step: its pickles are data).
        """
        rejected = []
        for step in self.committed_steps():
            manifest, problems = self.check_step(step, check)
            if not problems:
                return manifest, rejected
            rejected.append((step, "; ".join(problems[:3])))
        return None, rejected

    def check_step(self, step: int, check=None) -> tuple[dict | None, list[str]]:
        """(manifest, problems) of one step: its manifest is readable, every file it lists matches
        (size, CRC-32) and then `check` (as in newest_complete) finds nothing; problems is empty then."""
        manifest, problem = manifest_or_problem(self, step)
        if problem:
            return None, [problem]
        problems = self.verify(step, manifest)
        if not problems and check is not None:
            problems = check(self, step, manifest)
        return manifest, problems

    def checksum(self, path: str) -> dict:
        """{"bytes": size, "crc32": crc} of one file, streamed."""
        crc, size = 0, 0
        with self.fs.open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                crc, size = zlib.crc32(chunk, crc), size + len(chunk)
        return {"bytes": size, "crc32": crc}

    def write_manifest(self, directory: str, manifest: dict) -> None:
        """Write the manifest last (the commit)."""
        self.write_atomic(f"{directory}/{MANIFEST}", json.dumps(manifest, indent=1, sort_keys=True).encode())

    def write_atomic(self, target: str, data: bytes) -> None:
        """Readers see the old or the new content, never a torn file: a single object PUT, or a
        temporary file, fsync and a file rename (a FUSE mount's copy-then-delete rename still
        replaces the target whole)."""
        if not self.local:
            self.fs.pipe_file(target, data)
            return
        tmp = f"{target}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)

    def verify(self, step: int, manifest: dict, rank: int = 0, world: int = 1) -> list[str]:
        """Problems with the step's files in this view (empty when they match).

        Every rank checks that every listed file is here with its size (one listing), and the
        CRC-32 of its share: loading may read any file (resharding), so each view must hold all.
        """
        directory, problems = self.step_dir(step), []
        files = manifest.get("files", {})
        if not isinstance(files, dict) or not all(
                isinstance(v, dict) and all(type(v.get(k)) is int for k in ("bytes", "crc32")) for v in files.values()):
            return [f"{MANIFEST}: 'files' is not a mapping of file names to their bytes and crc32 (integers)"]
        prefix = directory.rstrip("/") + "/"
        try:
            here = {p[len(prefix):]: info for p, info in self.fs.find(directory, detail=True).items()
                    if p.startswith(prefix)}
        except (OSError, FileNotFoundError):
            here = {}
        for rel in sorted(files):
            size = here.get(rel, {}).get("size")
            if size is None:
                problems.append(f"{rel}: missing")
            elif size != files[rel]["bytes"]:
                problems.append(f"{rel}: {size} bytes, manifest says {files[rel]['bytes']} (truncated?)")
        if problems:
            return problems
        for rel in sorted(files)[rank::world]:
            try:
                got = self.checksum(f"{directory}/{rel}")
            except (OSError, FileNotFoundError) as e:
                problems.append(f"{rel}: unreadable ({type(e).__name__})")
                continue
            if got["crc32"] != files[rel]["crc32"]:
                problems.append(f"{rel}: CRC-32 mismatch (corrupted)")
        return problems

    def write_torch(self, path: str, obj) -> None:
        import torch

        with self.fs.open(path, "wb") as f:
            torch.save(obj, f)

    def read_bytes(self, path: str) -> bytes:
        """A file's bytes (load a `write_torch` file with checkpoint_safe.load_value: data only)."""
        with self.fs.open(path, "rb") as f:
            return f.read()

    # -- retention ----------------------------------------------------------------------
    def doomed(self, kept: list[int], *, current: int) -> list[str]:
        """Step folders in this view that retention drops: below `current` (the step just
        committed; nothing newer is written by this job) and not in `kept` (rank 0's newest
        complete steps). Leftovers of interrupted writes are among them."""
        return [path for step, partial, path in self._entries() if step < current and (partial or step not in kept)]

    def remove_manifest(self, directory: str) -> None:
        """Un-commit a step: without its manifest it is never loaded, whatever else is left."""
        self.remove(f"{directory}/{MANIFEST}")

    def remove(self, path: str) -> None:
        """Delete a file or a folder, file by file, tolerating files that another rank sharing
        this view deleted first."""
        try:
            files = self.fs.find(path) if self.fs.isdir(path) else [path]
        except FileNotFoundError:
            return
        for f in files:
            try:
                self.fs.rm_file(f)
            except FileNotFoundError:
                pass
        try:
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)  # the empty folders
        except (FileNotFoundError, OSError):
            pass


def _protocols(fs) -> tuple:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def manifest_or_problem(store: Store, step: int) -> tuple[dict | None, str | None]:
    """(manifest, None) or (None, why it is unreadable)."""
    try:
        return store.read_manifest(step), None
    except CorruptCheckpoint as e:
        return None, str(e)


def manifest_run_id(manifest: dict | None) -> str | None:
    """The id of the run that wrote a checkpoint (its manifest's `run_id`), or None for a
    checkpoint written before runs had an id (or a manifest whose id is not a non-empty string)."""
    value = (manifest or {}).get(RUN_ID_KEY)
    return value if isinstance(value, str) and value else None


def fresh_run_conflict(store: Store, run_id: str | None, keep: int) -> str | None:
    """Why a fresh run (no resume) must not write under `store`, or None: the store holds committed
    checkpoints of another run (a manifest naming another run id, or none). Its first saves would
    write over the steps both runs share, its retention of the newest `keep` would delete the other's,
    and a later resume would load whichever run wrote the newest step. `run_id`: this run's, whose own
    checkpoints (the same job started again) are not another's; None when it has none yet."""
    foreign = []
    for step in store.committed_steps():
        manifest, _ = manifest_or_problem(store, step)
        if manifest is None:  # an unreadable manifest: no checkpoint a run could load
            continue
        owner = manifest_run_id(manifest)
        if owner is None or owner != run_id:
            foreign.append((step, owner))
    if not foreign:
        return None
    step, owner = foreign[0]
    whose = f"run {owner}" if owner else "a run from before checkpoints named their run"
    listed = ", ".join(str(s) for s, _ in sorted(foreign))
    return (f"{store.uri} holds another run's checkpoints (steps {listed}; the newest, step {step}, by {whose}). A "
            f"fresh run there would write over the steps both runs reach, its retention (checkpoint.keep: {keep}) "
            "would delete the others, and a later --resume would load whichever run wrote the newest step. Nothing "
            "was written or deleted. Continue that run with `workbench run --resume`, or give this run a "
            "checkpoint.uri of its own (to start over in this one, delete its step-* folders first).")


def all_rejected(uri: str, rejected: list[tuple[int, str]]):
    """The ConfigError of a resume that found checkpoints but could load none of them."""
    from workbench.errors import ConfigError

    listed = "; ".join(f"{step_name(step)}: {why}" for step, why in rejected)
    planted = any("not plain checkpoint data" in why for _, why in rejected)
    return ConfigError(
        f"cannot resume: every checkpoint under {uri} was rejected ({listed}). Nothing was loaded and nothing "
        "was deleted. " + (f"Files that are not plain checkpoint data are never unpickled, so nothing in them "
                           f"ran; check who can write to {uri}. " if planted else "")
        + "Restore the files (e.g. from the store's versioning or a backup), or start from step 1 "
        "explicitly: `workbench run --resume-or-fresh` (or without --resume, or with another checkpoint.uri); "
        "`python -m workbench.cloud_entry` does so by default, and refuses only with --strict-resume.")


def manifest_spec(manifest: dict, uri: str):
    """The spec a checkpoint records (layout rules skipped: another layout may resume it). It is
    data like the rest of the manifest: validated, and nothing it names is imported here.

    Raises:
        ConfigError: the recorded spec is invalid, named as the checkpoint's.
    """
    from workbench.errors import ConfigError
    from workbench.spec import load_spec

    if not isinstance(manifest.get("spec"), dict):  # a string would be read as a path on this host
        raise ConfigError(f"cannot use the checkpoint of step {manifest.get('step')} under {uri}: it records no spec "
                          "(its manifest's 'spec' is not a mapping). Nothing was loaded. Restore the checkpoint from "
                          "a trusted copy, or start a fresh run with another checkpoint.uri.")
    try:
        return load_spec(manifest["spec"], layout=False)
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:  # ValueError: ConfigError too
        raise ConfigError(f"cannot use the checkpoint of step {manifest.get('step')} under {uri}: the spec it records "
                          f"is not a valid spec ({e}). Nothing was loaded. Restore the checkpoint from a "
                          "trusted copy, or start a fresh run with another checkpoint.uri.") from None


def new_manifest(step: int, spec: dict, world_size: int, files: dict, save_s: float) -> dict:
    return {"format": FORMAT, "step": step, "spec": spec, "world_size": world_size,
            "layout": spec.get("layout", {}), "files": files, "created_unix": time.time(),
            "save_s": round(save_s, 4)}


def describe_error(e: BaseException) -> str:
    """A one-line cause, unwrapping DCP's per-rank CheckpointException; names a full disk."""
    found = list(causes(e))
    for inner in found:
        if isinstance(inner, OSError) and inner.errno == errno.ENOSPC:
            return f"no space left on device ({inner})"
    root = found[-1] if len(found) > 1 and getattr(e, "failures", None) else e
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


def causes(e: BaseException):
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
