"""Start a spec on local Ray in the background, after the checks a run makes before any worker starts.

`workbench.launch.start` (the driver, the notebook's Run panel) and `python -m workbench.cloud_entry`
inside a Ray job both start runs here, so the entry point needs nothing from the driver.
"""
from __future__ import annotations

import os
from collections.abc import Callable

from workbench.errors import ConfigError
from workbench.runtime.checkpoint_store import RESUME_OR_FRESH
from workbench.spec import JobSpec, load_spec
from workbench.validate import check_runnable


def start(spec, on_event: Callable[[dict], None] | None = None, resume: bool = False):
    """Start `spec` on local Ray in the background and return its handle (non-blocking).

    The handle has `.events`, `.follow()`, `.wait()`, `.status()`, `.cancel()`. The job's driver
    thread delivers each event as it arrives: `on_event` is called from that thread (keep it
    quick: rank 0 waits for each step event's delivery), and `follow()` / `wait()` yield them.
    `cancel()` stops every rank after the same step, at most one step after the newest step
    delivered when it was called.

    Starting Ray itself (the first run of a process) is bounded and retried (backends/ray_start.py):
    each retry arrives as a `warning` event and a start still under way as a `note` (through
    `on_event`; on stderr without it); after the last attempt RayStartError (a WorkerError; the CLI
    exits 69) names what timed out, the load and what to try, among which the Ray-free route.
    """
    import time

    from backends.local_ray import LocalRayBackend, ensure_ray

    launched = time.monotonic()
    spec = load_spec(spec)
    check_before_start(spec, resume)
    checked = time.monotonic()
    note = None if on_event is None else (lambda kind, message: on_event({"event": kind, "message": message}))
    ensure_ray(note=note, fallback=f"python -m workbench.cloud_entry --spec SPEC (torchrun with {spec.world_size} ranks "
               "running the same per-rank runtime; metrics as JSON lines on stdout, the same exit codes)")
    startup = {"launched": launched, "phases": {"checks_s": checked - launched, "ray_s": time.monotonic() - checked}}
    return LocalRayBackend().submit(spec, on_event=on_event, resume=resume, startup=startup)


def check_before_start(spec: JobSpec, resume: bool | str = False) -> None:
    """Every refusal a local run makes before any worker starts (`workbench validate` makes the
    same): the spec's rules, a checkpoint to start from (model.init: checkpoint) with no intact
    step, a second writer of checkpoint.uri, and that URI's checkpoints against a fresh run
    (another run's) or a resume (incompatible, corrupt, not data)."""
    check_runnable(spec)
    m = spec.model
    if m.init == "checkpoint" and m.path and ("://" in m.path or os.path.isdir(m.path)):
        from workbench.export import checkpoint_dir

        checkpoint_dir(m.path)  # a workbench checkpoint to start from: its newest intact step, as --resume
    if spec.checkpoint.uri:
        from workbench.runtime.checkpoint_lease import check_lease_free

        check_lease_free(spec.checkpoint.uri)
    if resume:
        check_resume_from_checkpoint(spec, or_fresh=resume == RESUME_OR_FRESH)
    else:
        check_fresh_checkpoint_uri(spec)


def check_fresh_checkpoint_uri(spec: JobSpec) -> None:
    """Before any worker starts: ConfigError if a fresh run would write over another run's
    checkpoints under checkpoint.uri (the ranks check again, checkpoint.Checkpointer.check_fresh)."""
    if not spec.checkpoint.uri:
        return
    from workbench.runtime.checkpoint_store import Store, fresh_run_conflict

    conflict = fresh_run_conflict(Store(spec.checkpoint.uri), os.environ.get("WORKBENCH_RUN_ID"), spec.checkpoint.keep)
    if conflict:
        raise ConfigError(conflict)


def check_resume_from_checkpoint(spec: JobSpec, or_fresh: bool = False) -> None:
    """Before any worker starts: ConfigError if the newest complete checkpoint's spec is
    incompatible, or if there are checkpoints and every one is corrupt or holds anything but data
    (a planted pickle) (unless `or_fresh`). The workers resume from that same step: they skip the
    same ones, and also those whose tensors do not load."""
    if not spec.checkpoint.uri:
        return
    from workbench.runtime.checkpoint_safe import scan_step
    from workbench.runtime.checkpoint_store import Store, all_rejected, manifest_spec
    from workbench.validate import check_resume

    manifest, rejected = Store(spec.checkpoint.uri).newest_complete(check=scan_step)
    if manifest is not None:
        check_resume(spec, manifest_spec(manifest, spec.checkpoint.uri))
    elif rejected and not or_fresh:
        raise all_rejected(spec.checkpoint.uri, rejected)
