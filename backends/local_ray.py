"""The `local` backend: Ray Train on an embedded Ray cluster, one worker (actor) per rank.

CPU workers use gloo and take a fraction of a CPU each, so 4-8 ranks run on a 2-core machine;
with GPUs each worker gets one and NCCL. Each worker runs its rank in a child process, as
torchrun's agent does, and relays: the rank's process has no Ray in it, and the cluster's own
processes yield the CPU to the ranks (`control_plane_setup`). The rank's events reach the driver
through a small actor (`EventBus`): the worker batches them and exchanges them for the stop flag
on a background thread every `_FLUSH_S`, so the training step never waits on Ray.
"""
from __future__ import annotations

import os
import sys
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
                    runtime_env={"env_vars": {"PYTHONPATH": path, **_RAY_TRAIN_ENV},
                                 "worker_process_setup_hook": "backends.local_ray.control_plane_setup"},
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
            _set_policy("SCHED_IDLE")  # control plane: run on CPU time the ranks leave idle
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
    step); a daemon thread sends the batch and reads the stop flag every `_FLUSH_S`, and calls
    `on_stop` (from that thread) when the flag first comes back set."""

    def __init__(self, bus, on_stop: Callable[[], None], interval_s: float = _FLUSH_S):
        self._bus, self._on_stop, self._interval = bus, on_stop, interval_s
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
        if ray.get(self._bus.exchange.remote(batch)) and not self.stop:
            self.stop = True
            self._on_stop()

    def _run(self) -> None:
        while not self._done.wait(self._interval):
            self.flush()

    def close(self) -> None:
        """Stop the thread and deliver the rest (the run's last events)."""
        self._done.set()
        self._thread.join()
        self.flush()


_CHILD = "import sys; from backends.local_ray import _rank_main; _rank_main(int(sys.argv[1]))"


def _die_with_parent() -> None:
    """SIGKILL this process when the thread that started it exits (Linux): a rank must not
    outlive its Ray worker, whether Ray killed the worker or the worker crashed."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the rank exits when it finds the pipe closed
        pass


def _set_policy(policy_name: str) -> None:
    """Put every thread of this process under the Linux scheduling policy `policy_name`
    ("SCHED_BATCH", "SCHED_IDLE", "SCHED_OTHER"); a no-op where the OS has none."""
    policy = getattr(os, policy_name, None)
    if policy is None or not os.path.isdir("/proc/self/task"):
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))
        except OSError:  # the thread has exited, or a sandbox forbids it: only slower
            pass


def control_plane_setup() -> None:
    """Every Ray worker process of the embedded cluster runs SCHED_BATCH (its runtime_env's
    worker_process_setup_hook): Ray's core worker wakes each actor process ~100 times a second,
    and a batch process does not preempt a rank when it wakes; it runs on a CPU the ranks leave
    idle (waiting on a collective) or at the next tick. The ranks switch back to SCHED_OTHER
    (`_rank_main`). On a machine whose cores all run ranks, the 5-8 actor processes of Ray Train
    otherwise preempt the ranks some 500 times a second (docs/benchmarks.md, section a).

    Our own control plane goes further, to SCHED_IDLE (the event bus, and each worker once its
    rank has started: a rank cannot leave SCHED_IDLE without privileges, so the hook cannot):
    it then runs only on CPU time the ranks leave idle."""
    _set_policy("SCHED_BATCH")


def _rank_main(fd: int) -> None:
    """The rank's process: run the per-rank loop, events out and the stop request in over `fd`."""
    import traceback
    from multiprocessing.connection import Connection

    parent = os.getppid()
    _set_policy("SCHED_OTHER")  # a rank is not control plane (control_plane_setup)
    _die_with_parent()
    if os.getppid() != parent:  # the worker died before the line above
        sys.exit(1)
    conn = Connection(fd)
    config = conn.recv()
    stop = False

    def should_stop() -> bool:
        nonlocal stop
        try:
            while not stop and conn.poll():
                stop = conn.recv() == "stop"
        except EOFError:  # the worker is gone: nobody left to report to
            os._exit(1)
        return stop

    from workbench.runtime.loop import train

    try:
        train(config["spec"], lambda event: conn.send(("event", event)), should_stop=should_stop,
              resume=config["resume"], attempt=config["attempt"])
    except BaseException as e:  # noqa: BLE001 - every failure goes to the worker, then Ray
        traceback.print_exc()
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        sys.exit(1)
    conn.send(("done", None))


def _rank_rendezvous(ctx) -> tuple[dict, object]:
    """The environment of a rank's process (torchrun's variables) and the store its process group
    starts from: a TCPStore served by rank 0's worker, its address sent to every worker through
    Ray Train; the ranks join it as torchrun's workers join their agent's store."""
    import ray
    from ray.train.collective import broadcast_from_rank_zero
    from torch.distributed import TCPStore

    rank, server, address = ctx.get_world_rank(), None, None
    if rank == 0:
        host = ray.util.get_node_ip_address()
        server = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        address = (host, server.port)
    host, port = broadcast_from_rank_zero(address)
    env = {"RANK": str(rank), "WORLD_SIZE": str(ctx.get_world_size()), "LOCAL_RANK": str(ctx.get_local_rank()),
           "LOCAL_WORLD_SIZE": str(ctx.get_local_world_size()), "MASTER_ADDR": host, "MASTER_PORT": str(port),
           "TORCHELASTIC_USE_AGENT_STORE": "True", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return env, server


def _run_rank_process(conn, child_end, env: dict, mailbox: "_Mailbox", rank: int, attempt: int) -> None:
    """Start the rank's process on the pipe `conn`-`child_end` (its config already sent), relay
    its events to the mailbox until it exits, and raise if it failed. The mailbox sends it the
    stop request. Ray Train's own process group (in this worker) stays unused."""
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(child_end.fileno())],
                            pass_fds=[child_end.fileno()], env={**os.environ, **env})
    child_end.close()
    _set_policy("SCHED_IDLE")  # from here this process only relays (control_plane_setup)
    mailbox.put({"event": "worker", "rank": rank, "pid": os.getpid(), "rank_pid": proc.pid, "attempt": attempt})
    outcome = None
    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):  # the process exited (and closed its end)
            break
        if kind == "event":
            mailbox.put(payload)
        else:
            outcome = (kind, payload)
    code = proc.wait()
    if outcome is not None and outcome[0] == "failed":
        raise WorkerError(outcome[1])
    if outcome is None or code != 0:
        how = f"signal {-code}" if code < 0 else f"code {code}"
        raise WorkerError(f"the rank's process (pid {proc.pid}) exited with {how} before the run ended")


def _send_quietly(conn, message) -> None:
    try:
        conn.send(message)
    except OSError:  # the rank has already exited: nothing left to stop
        pass


def _train_worker(config: dict) -> None:
    """Runs inside each Ray Train worker: starts this rank in a process of its own and relays.

    The rank does not train in the worker: Ray's core worker in that process wakes it ~100 times
    a second, and the training thread got less of its core there than under torchrun; in a child
    process the rank runs as it would under torchrun (docs/benchmarks.md, section a)."""
    from multiprocessing import Pipe

    import ray

    bus = config["bus"]
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    # After FailureConfig restarts the group, continue from the last checkpoint.
    attempt = ray.get(bus.register.remote(rank))
    conn, child_end = Pipe()
    # The config goes first, so that it is the first thing the rank reads even if a stop follows at once.
    conn.send({"spec": config["spec"], "resume": config["resume"] or attempt > 0, "attempt": attempt})
    mailbox = _Mailbox(bus, on_stop=lambda: _send_quietly(conn, "stop"))
    try:
        env, _server = _rank_rendezvous(ctx)
        _run_rank_process(conn, child_end, env, mailbox, rank, attempt)
    except BaseException as e:
        mailbox.put({"event": "error", "rank": rank, "message": str(e) if isinstance(e, WorkerError)
                     else f"{type(e).__name__}: {e}"})
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
