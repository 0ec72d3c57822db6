"""`workbench.run` / `workbench run`: start a job on its backend and follow it to the end.

The driver side of a run: it validates the spec before any worker starts, writes metrics
events to the JSONL file and a terminal progress bar, and turns a worker failure into a
readable message naming the rank and the cause.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from backends.local_start import check_fresh_checkpoint_uri, check_resume_from_checkpoint, start  # noqa: F401 - the API
from workbench.errors import WorkerError
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


def checkpoint_version(uri: str) -> tuple:
    """What changes when a checkpoint under `uri` is committed or re-written: the committed steps,
    and the newest one's write time and run id. Cheap: the store is listed and one manifest read,
    no file verified. Raises OSError / ValueError / ImportError for an unreachable or unknown store."""
    from workbench.runtime.checkpoint_store import Store, manifest_or_problem, manifest_run_id

    store = Store(uri)
    steps = tuple(store.committed_steps())
    # the newest manifest too: another run may re-write a step this run wrote
    newest = (manifest_or_problem(store, steps[0])[0] if steps else None) or {}
    return (uri, steps, newest.get("created_unix"), manifest_run_id(newest))


def newest_checkpoint_owner(uri: str) -> tuple[int, str | None] | None:
    """(step, run id) of the newest complete checkpoint under `uri` (every file verified, size and
    CRC-32, as a resume does before any worker starts), or None. The run id is None for a
    checkpoint written before runs had one. Nothing is loaded or deleted."""
    from workbench.runtime.checkpoint_store import Store, manifest_run_id

    manifest, _ = Store(uri).newest_complete()
    return None if manifest is None else (int(manifest["step"]), manifest_run_id(manifest))


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
    if event["event"] == "startup" and bar is not None:
        from workbench.startup import by_owner

        owners = ", ".join(f"{who} {s:.1f} s" for who, s in by_owner(event).items())
        reused = " (relays and rank processes kept from the previous run)" if event.get("reused") else ""
        bar.write(f"step 1 ended {event['launch_to_step_1_s']:.1f} s after launch{reused}: {owners}", file=sys.stderr)
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
