"""`workbench.run` / `workbench run`: start a job on its backend and follow it to the end.

The driver side of a run: it validates the spec before any worker starts, writes metrics
events to the JSONL file and a terminal progress bar, and turns a worker failure into a
readable message naming the rank and the cause.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from workbench.errors import WorkerError
from workbench.runtime.checkpoint_store import RESUME_OR_FRESH
from workbench.runtime.preemption import EXIT_PREEMPTED, forward_signal
from workbench.spec import JobSpec, load_spec
from workbench.validate import check_runnable

EXIT_FAILED = 1


@dataclass
class RunResult:
    status: str  # completed | preempted | failed
    step: int
    events: list[dict] = field(default_factory=list)
    message: str = ""

    @property
    def exit_code(self) -> int:
        return {"completed": 0, "preempted": EXIT_PREEMPTED}.get(self.status, EXIT_FAILED)

    @property
    def losses(self) -> list[float]:
        return [e["loss"] for e in self.events if e["event"] == "step"]


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
    from backends.local_ray import LocalRayBackend, ensure_ray

    spec = load_spec(spec)
    check_runnable(spec)
    if spec.checkpoint.uri:
        from workbench.runtime.checkpoint_lease import check_lease_free

        check_lease_free(spec.checkpoint.uri)  # a second writer of the URI: exit 2 before any worker starts
    if resume:
        check_resume_from_checkpoint(spec, or_fresh=resume == RESUME_OR_FRESH)
    note = None if on_event is None else (lambda kind, message: on_event({"event": kind, "message": message}))
    ensure_ray(note=note, fallback=f"python -m workbench.cloud_entry --spec SPEC (torchrun with {spec.world_size} ranks "
               "running the same per-rank runtime; metrics as JSON lines on stdout, the same exit codes)")
    return LocalRayBackend().submit(spec, on_event=on_event, resume=resume)


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


def run(spec: JobSpec | dict | str, metrics_out: str | None = None, resume: bool = False, progress: bool = True,
        report: str | None = None) -> RunResult:
    """Run a job to the end on the backend named in the spec.

    Args:
        spec: a JobSpec, dict or YAML path.
        metrics_out: JSONL file for the metrics events.
        resume: continue from the newest complete checkpoint (RESUME_OR_FRESH: start at step 1 when
            every checkpoint is corrupt, instead of a ConfigError).
        progress: show a terminal progress bar.
        report: write a self-contained HTML report of the run here.
    Returns:
        RunResult with the status, last step and all events.
    Raises:
        ConfigError: the spec is invalid (before any worker starts).
        WorkerError: a worker failed; the message names the rank and the cause.
    """
    spec = load_spec(spec)
    if spec.backend.name != "local":
        return _run_remote(spec)
    check_runnable(spec)
    handle = start(spec, resume=resume)
    out = open(metrics_out, "w") if metrics_out else None
    bar = _progress_bar(spec) if progress else None
    try:
        with forward_signal(handle.cancel):  # SIGTERM: the workers stop after a step and checkpoint
            for event in handle.follow():
                _record(event, out, bar, spec.name)
        status = handle.status()
        events = handle.events
        end = next((e for e in reversed(events) if e["event"] == "end"), None)
        last_step = max((e["step"] for e in events if e["event"] == "step"), default=0)
        if end is None:
            # no rank reported the end: a failure, or a cancel before the ranks started
            end = {"event": "end", "status": "preempted" if status.state.value == "stopped" else "failed",
                   "step": last_step}
            events.append(end)
            if out is not None:
                out.write(json.dumps(end) + "\n")
    finally:
        if bar is not None:
            bar.close()
        if out is not None:
            out.close()
    result = RunResult(end["status"], end["step"], events, status.message)
    if report:
        from workbench.report.run_report import write_report

        write_report(events, spec, report)
    if result.status == "failed":
        raise WorkerError(status.message or "the run failed without a message (see Ray logs)")
    return result


def _record(event: dict, out, bar, name: str) -> None:
    if out is not None:
        out.write(json.dumps(event) + "\n")
        out.flush()
    if event["event"] == "warning":
        print(f"warning: {event['message']}", file=sys.stderr)
    if bar is not None and event["event"] == "step":
        if event["step"] == 1:
            bar.set_description_str(name)
        bar.update(event["step"] - bar.n)
        bar.set_postfix(loss=f"{event['loss']:.4f}", tok_s=f"{event['tokens_per_s']:,.0f}")


def _progress_bar(spec: JobSpec):
    from tqdm import tqdm

    where = "GPU" if spec.resources.gpu != "cpu" else "CPU"
    desc = f"{spec.name}: starting {spec.world_size} {where} workers on local Ray"
    return tqdm(total=spec.train.steps, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True)


def _run_remote(spec: JobSpec) -> RunResult:
    from backends import dispatch

    handle = dispatch(spec)
    print(f"submitted {handle.job_id} to {spec.backend.name}; following it", file=sys.stderr)
    status = handle.wait()
    result = RunResult(status.state.value if status.state.value in ("completed", "failed") else "failed", 0,
                       message=status.message)
    if result.status == "failed":
        raise WorkerError(f"{spec.backend.name} job {handle.job_id}: {status.state.value}: {status.message}")
    return result
