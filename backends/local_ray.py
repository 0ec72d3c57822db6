"""The `local` backend: Ray Train on an embedded Ray cluster, one worker (actor) per rank.

CPU workers use gloo and take a fraction of a CPU each, so 4-8 ranks run on a 2-core machine;
with GPUs each worker gets one and NCCL. Metrics flow from the workers to the driver through a
small actor (`EventBus`). Each worker batches its events and exchanges them for the stop flag
on a background thread every `_FLUSH_S`, so the training step never waits on Ray: no actor call
on the hot path, one small one per rank per interval.
"""
from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from backends.base import JobState, JobStatus
from workbench.errors import WorkerError

_POLL_S = 0.2
_FLUSH_S = 0.25  # worker -> bus: events out, stop flag back
_START_ATTEMPTS = 3
# Ray Train's preemption watcher polls for node drains from an actor of its own: one more process
# to start while training begins, with nothing to watch on a one-node embedded cluster (SIGTERM
# preemption is the runtime's own: workbench/runtime/preemption.py).
_RAY_TRAIN_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


def _package_root() -> str:
    import workbench

    return str(Path(workbench.__file__).resolve().parent.parent)


def ensure_ray(num_cpus: int | None = None):
    """Start (or reuse) the embedded Ray cluster; workers import workbench from this checkout."""
    import ray

    if not ray.is_initialized():
        root = _package_root()
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        for attempt in range(_START_ATTEMPTS):
            try:
                ray.init(
                    # "local": always an embedded cluster, never one a `ray start` left running
                    # (that is the `ray` backend's job).
                    address="local",
                    num_cpus=num_cpus or os.cpu_count() or 1,
                    include_dashboard=False,
                    logging_level="ERROR",
                    log_to_driver=False,
                    runtime_env={"env_vars": {"PYTHONPATH": path, **_RAY_TRAIN_ENV}},
                    # Ray runs workers at nice 15 so that its own daemons stay responsive; here
                    # the workers are the job and should not yield to every daemon wake-up (no
                    # measurable change on a 2-core VM: docs/benchmarks.md, section a).
                    _system_config={"worker_niceness": 0},
                )
                break
            except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception on a slow start
                # Ray gives its raylet a fixed 30 s to register; a loaded machine can miss that.
                ray.shutdown()
                if attempt == _START_ATTEMPTS - 1 or "timed out during startup" not in str(e):
                    raise
    return ray


def _event_bus_class():
    import ray

    @ray.remote(num_cpus=0)
    class EventBus:
        """Mailbox between workers and the driver: metrics events out, a stop request in."""

        def __init__(self):
            self.events: list[dict] = []
            self.stop = False
            self.starts: dict[int, int] = {}

        def register(self, rank: int) -> int:
            """Count a rank's starts: the worker group's restart attempt (0 on the first start)."""
            self.starts[rank] = self.starts.get(rank, 0) + 1
            return self.starts[rank] - 1

        def exchange(self, events: list[dict]) -> bool:
            """A worker's batch of events in; whether a stop was requested back."""
            self.events.extend(events)
            return self.stop

        def drain(self) -> list[dict]:
            out, self.events = self.events, []
            return out

        def request_stop(self) -> None:
            self.stop = True

        def stop_requested(self) -> bool:
            return self.stop

    return EventBus


class _Mailbox:
    """The worker's side of the EventBus: `put` appends locally (no Ray call on the training
    step); a daemon thread sends the batch and reads the stop flag every `_FLUSH_S`."""

    def __init__(self, bus, interval_s: float = _FLUSH_S):
        self._bus, self._interval = bus, interval_s
        self._pending: list[dict] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.stop = False
        self._thread = threading.Thread(target=self._run, name="workbench-mailbox", daemon=True)
        self._thread.start()

    def put(self, event: dict) -> None:
        with self._lock:
            self._pending.append(event)

    def flush(self) -> None:
        """Send what is pending and wait until the bus has it."""
        import ray

        with self._lock:
            batch, self._pending = self._pending, []
        self.stop = ray.get(self._bus.exchange.remote(batch)) or self.stop

    def _run(self) -> None:
        while not self._done.wait(self._interval):
            self.flush()

    def close(self) -> None:
        """Stop the thread and deliver the rest (the run's last events)."""
        self._done.set()
        self._thread.join()
        self.flush()


def _train_worker(config: dict) -> None:
    """Runs inside each Ray Train worker; Ray has already joined the process group."""
    import ray
    import torch.distributed as dist

    from workbench.runtime.loop import train

    bus = config["bus"]
    rank = dist.get_rank() if dist.is_initialized() else 0
    # After FailureConfig restarts the group, continue from the last checkpoint.
    attempt = ray.get(bus.register.remote(rank))
    mailbox = _Mailbox(bus)
    try:
        mailbox.put({"event": "worker", "rank": rank, "pid": os.getpid(), "attempt": attempt})
        train(config["spec"], mailbox.put, should_stop=lambda: mailbox.stop,
              resume=config["resume"] or attempt > 0, attempt=attempt)
    except BaseException as e:
        mailbox.put({"event": "error", "rank": rank, "message": f"{type(e).__name__}: {e}"})
        raise
    finally:
        mailbox.close()


class LocalRayJob:
    """A job running on the embedded Ray cluster (a JobHandle)."""

    def __init__(self, spec, on_event: Callable[[dict], None] | None = None, resume: bool = False):
        ray = ensure_ray()
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        import torch

        self.spec = spec
        self.job_id = f"{spec.name}-{int(time.time())}"
        self.events: list[dict] = []
        self._on_event = on_event
        self._state = JobState.PENDING
        self._error: str | None = None
        self._end: dict | None = None
        self._bus = _event_bus_class().remote()
        world = spec.world_size
        use_gpu = torch.cuda.is_available() and spec.resources.gpu != "cpu"
        cpus = ray.cluster_resources().get("CPU", 1)
        self._trainer = TorchTrainer(
            _train_worker,
            train_loop_config={"spec": spec.to_dict(), "bus": self._bus, "resume": resume},
            torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
            scaling_config=ScalingConfig(
                num_workers=world, use_gpu=use_gpu,
                resources_per_worker=None if use_gpu else {"CPU": min(1.0, cpus / world)},
            ),
            run_config=RunConfig(
                name=self.job_id,
                storage_path=tempfile.mkdtemp(prefix="workbench-ray-"),
                failure_config=FailureConfig(max_failures=spec.backend.max_failures),
            ),
        )
        self._thread = threading.Thread(target=self._fit, name=f"workbench-{self.job_id}", daemon=True)
        self._thread.start()

    def _fit(self) -> None:
        self._state = JobState.RUNNING
        try:
            self._trainer.fit()
        except Exception as e:  # noqa: BLE001 - reported through status and wait()
            self._error = f"{type(e).__name__}: {e}"
        finally:
            self._pump(final=True)

    def _pump(self, final: bool = False) -> None:
        """Take the workers' events from the bus. Rank 0's `end` is held back until every
        worker has finished (`final`): the other ranks' last events may still be on their way,
        and `end` is the last event of a run."""
        import ray

        for event in ray.get(self._bus.drain.remote()):
            if event["event"] == "end":
                self._end = event
                self._state = JobState.STOPPED if event["status"] == "preempted" else JobState.COMPLETED
            else:
                self._deliver(event)
        if final and self._end is not None:
            self._deliver(self._end)
            self._end = None

    def _deliver(self, event: dict) -> None:
        self.events.append(event)
        if self._on_event is not None:
            self._on_event(event)

    def follow(self, timeout_s: float | None = None):
        """Yield events as they arrive until the job ends."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        seen = 0
        while True:
            alive = self._thread.is_alive()
            if alive:
                self._pump()
            while seen < len(self.events):
                seen += 1
                yield self.events[seen - 1]
            if not alive:
                return
            if deadline is not None and time.monotonic() > deadline:
                return
            time.sleep(_POLL_S)

    def wait(self, timeout_s: float | None = None) -> JobStatus:
        for _ in self.follow(timeout_s):
            pass
        return self.status()

    def status(self) -> JobStatus:
        if self._thread.is_alive():
            return JobStatus(self._state)
        if self._error is not None:
            return JobStatus(JobState.FAILED, self.failure_message())
        if self._state == JobState.RUNNING:  # finished without an end event
            return JobStatus(JobState.FAILED, "workers exited without finishing the run")
        return JobStatus(self._state)

    def failure_message(self) -> str:
        errors = [e for e in self.events if e["event"] == "error"]
        if errors:
            first = min(errors, key=lambda e: e["rank"])
            return f"rank {first['rank']}: {first['message']}"
        return self._error or ""

    def logs(self, tail: int = 100) -> str:
        import json

        return "\n".join(json.dumps(e) for e in self.events[-tail:])

    def cancel(self) -> None:
        """Ask the workers to stop after the current step (they agree on the step)."""
        import ray

        ray.get(self._bus.request_stop.remote())

    def raise_for_failure(self) -> None:
        status = self.status()
        if status.state == JobState.FAILED:
            raise WorkerError(status.message)


class LocalRayBackend:
    name = "local"

    def dry_run(self, spec) -> dict:
        world = spec.world_size
        return {"ray": "embedded (ray.init on this machine)", "num_workers": world,
                "backend": "gloo" if spec.resources.gpu == "cpu" else "nccl", "spec": spec.to_dict()}

    def submit(self, spec, on_event=None, resume: bool = False) -> LocalRayJob:
        return LocalRayJob(spec, on_event=on_event, resume=resume)
