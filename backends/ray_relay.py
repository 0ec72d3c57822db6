"""The relay of the `local` backend: one Ray actor per rank (`RankRelay`), as torchrun's agent per
node, and the rank's own process it starts (`_rank_main`), which has no Ray in it.

The relay hands the rank's events to the driver (backends/local_ray.py) as a long poll answers,
and passes the driver's acknowledgements and the stop request on to the rank over a pipe. Nothing
here imports Ray at module level: the rank's process imports this module.
"""
from __future__ import annotations

import functools
import os
import sys
import threading

from backends.embedded_ray import set_policy

_CHILD = "import sys; from backends.ray_relay import _rank_main; _rank_main(int(sys.argv[1]), sys.argv[2:] == ['standby'])"


def _die_with_parent() -> None:
    """SIGKILL this process when the thread that started it exits (Linux): a rank must not
    outlive its Ray worker, whether Ray killed the worker or the worker crashed."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the rank exits when it finds the pipe closed
        pass


def _normal_priority() -> None:
    """Nice 0 for this process, where the OS allows it. Ray starts its workers at nice 15 (its
    `worker_niceness`; the embedded cluster sets 0, a `ray start` cluster keeps 15) and a rank
    inherits its worker's. At nice 15 a rank weighs 36 against a nice-0 process's 1024: beside one
    busy process per core it got ~3 % of a core. Lowering the value needs CAP_SYS_NICE (root, as in
    a training container); without it the rank keeps Ray's. Linux keeps nice per thread: call this
    before the rank starts any thread, so that they all inherit it."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except (OSError, AttributeError):  # not permitted, or not a POSIX OS: only slower under load
        pass


STOP_WITHIN_STEPS = 2  # a cancel made while step N was the newest step seen stops every rank after step N + this


def _setup_rank_process() -> None:
    """Scheduling as a rank's, not the control plane's; dies with its Ray worker (exits now if that
    worker is already gone)."""
    parent = os.getppid()
    set_policy("SCHED_OTHER")  # a rank is not control plane (control_plane_setup)
    _normal_priority()
    _die_with_parent()
    if os.getppid() != parent:  # the worker died before _die_with_parent took effect
        sys.exit(1)


def _preload() -> dict:
    """Import what every rank needs before its job is known (a standby rank: `RankRelay`), timed on
    this process's clock: `import_torch_s` (torch, torch.distributed), `import_workbench_s` (the
    runtime and what it imports) and `import_dynamo_s` (torch._dynamo, which building a model on the
    meta device imports: its parameters' init runs torch's reference kernels; seconds of it)."""
    import time

    t0 = time.perf_counter()
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    t1 = time.perf_counter()
    import workbench.runtime.loop  # noqa: F401

    t2 = time.perf_counter()
    import torch._dynamo  # noqa: F401

    return {"import_torch_s": t1 - t0, "import_workbench_s": t2 - t1, "import_dynamo_s": time.perf_counter() - t2}


_STORE: list = []  # rank 0's TCPStore: served from its own process, as long as that process lives


def _serve_store(conn, host: str) -> None:
    """Rank 0's process serves the TCPStore its process group starts from (the ranks join it as
    clients: TORCHELASTIC_USE_AGENT_STORE, as under torchrun's agent), so no relay imports torch."""
    from torch.distributed import TCPStore

    _STORE.append(TCPStore(host, 0, is_master=True, wait_for_workers=False))
    conn.send(("store", _STORE[-1].port))


def _check_cuda_untouched() -> None:
    """A standby rank's imports must not have asked CUDA for its devices: CUDA_VISIBLE_DEVICES, set
    with the job, is read once, then. Fail loudly rather than run on the wrong GPUs."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    if cuda is not None and (cuda.is_initialized() or getattr(cuda, "_cached_device_count", None) is not None):
        raise RuntimeError("this rank's process looked at its GPUs before its job set CUDA_VISIBLE_DEVICES (an import "
                           "of the standby rank, backends/ray_relay.py `_preload`, did): it would run on the wrong "
                           "GPU; a bug of workbench's, please report it with the torch version")


def _take_config(conn) -> dict:
    """The rank's job (a dict), after serving the store when asked first; `env` is applied here."""
    while True:
        message = conn.recv()
        if isinstance(message, dict):
            env = message.get("env", {})
            if "CUDA_VISIBLE_DEVICES" in env:
                _check_cuda_untouched()
            os.environ.update(env)
            return message
        if message[0] == "store":
            _serve_store(conn, message[1])


def _rank_main(fd: int, standby: bool = False) -> None:
    """The rank's process: run the per-rank loop, events out and the stop request in over `fd`.

    `standby`: the relay started this process before its job was known (`RankRelay.__init__`): it
    imports torch and the runtime first, says ("ready", timings) and then waits for the job, so the
    imports overlap the placement, the other relays' start and the rendezvous instead of following
    them. The job is a dict: the spec and `env` (torchrun's variables), applied before anything
    reads them. Before it, rank 0's process may be asked to serve the store (`_serve_store`).

    Stop within `STOP_WITHIN_STEPS` (k >= 2) steps, without waiting on every step: the driver
    acknowledges each step event once it has reached whoever follows the job, with the stop request
    as it stood then. The loop asks `should_stop` once step S's gradients are final, before the
    ranks agree on stopping and before rank 0 reports step S (the loss and the stop decision travel
    in one all-reduce, `loop._agree`, while the update runs). There the rank takes the
    acknowledgements already in the pipe without waiting, and waits only while its newest
    acknowledged step is more than k - 2 steps behind its newest reported one, S - 1. So deciding
    after step S, rank 0 holds the acknowledgement of step S - k + 1 or later; a cancel made while
    step N was the newest step seen is in every acknowledgement of a step after N, so every rank
    stops after step N + k at the latest. The acknowledgement's round trip (driver, Ray, two pipes:
    4.6-8.6 ms under load) overlaps the next step's compute instead of adding to each. Only rank 0 reports steps, so only rank 0 can wait;
    the others wait for it anyway, in the step's all-reduce, so the decision is the same on every
    rank. The driver's own "stop" message, sent as soon as it sees the cancel, can end the run
    sooner. config["stop_within_steps"] replaces k; k = 1 (wait for the acknowledgement of every
    step before the next, as before #35) cannot be kept since the decision precedes the report.
    """
    import time
    import traceback
    from multiprocessing.connection import Connection

    _setup_rank_process()
    conn = Connection(fd)
    phases = {}
    if standby:
        phases = _preload()
        conn.send(("ready", phases))
    config = _take_config(conn)
    configured = time.perf_counter()

    def started(loop_phases: dict) -> None:  # after step 1: this rank's start-up, as durations
        channel.sink({"event": "startup", "rank": int(os.environ.get("RANK", 0)),
                      "phases": {**phases, **loop_phases, "configured_to_step_1_s": time.perf_counter() - configured,
                                 "cpu_s": time.process_time()}})  # this process's CPU seconds, imports included

    train = config.get("entry")  # `workbench calibrate`: its microbenchmarks on the ranks a run gets
    try:
        channel = _Channel(conn, int(config.get("stop_within_steps", STOP_WITHIN_STEPS)))  # refuses k < 2
        if train is None:
            from workbench.runtime.loop import train as loop_train

            train = functools.partial(loop_train, on_started=started)
        train(config["spec"], channel.sink, should_stop=channel.should_stop, resume=config["resume"],
              attempt=config["attempt"])
    except BaseException as e:  # noqa: BLE001 - every failure goes to the relay, then the driver
        traceback.print_exc()
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        sys.exit(1)
    conn.send(("done", None))


class _Channel:
    """The rank's side of the pipe: events out; acknowledgements and the stop in (`_rank_main`).
    `within`: k, the steps after the newest one the driver had seen when it was cancelled that
    the rank may still run."""

    def __init__(self, conn, within: int):
        if within < 2:
            raise ValueError(f"stop_within_steps must be at least 2, not {within}: the rank decides whether to "
                             "stop after step S before it reports S, so the newest acknowledgement it can hold "
                             "then is of step S - 1")
        self._conn, self._lag = conn, within - 2  # reported steps that may be unacknowledged at a decision
        self._stop, self._sent, self._acked = False, 0, 0  # sent / acked: the newest step reported / acknowledged

    def sink(self, event: dict) -> None:
        self._conn.send(("event", event))
        if event["event"] == "step":
            self._sent = event["step"]

    def should_stop(self) -> bool:
        try:
            # conn.poll() without a timeout does not wait; recv() waits only while too far behind
            while not self._stop and (self._acked < self._sent - self._lag or self._conn.poll()):
                message = self._conn.recv()
                if message == "stop":
                    self._stop = True
                elif message[0] == "ack":  # ("ack", step, stop requested when that step was delivered)
                    self._acked, self._stop = max(self._acked, message[1]), message[2]
        except EOFError:  # the worker is gone: nobody left to report to
            os._exit(1)
        return self._stop


def _send_quietly(conn, message) -> None:
    try:
        conn.send(message)
    except OSError:  # the rank has already exited: nothing left to stop
        pass


class RankRelay:
    """One Ray actor per rank, as torchrun's agent per node: it starts the rank in a process of
    its own, hands the rank's events to the driver as soon as they arrive (a long poll) and
    passes the driver's acknowledgements and the stop request on to the rank. A plain class: Ray
    makes it an actor (`relay_class`) and imports it on the workers from here.

    The rank's process starts with the actor, before its job is known (a standby: `_rank_main`),
    and a relay kept for the driver's next job starts another (`standby`): a job finds its rank's
    torch and runtime already imported. Each job still gets a process, and a process group, of its own."""

    def __init__(self):
        self._pending: list[dict] = []
        self._arrived = threading.Condition()  # guards _pending, _conn, _job, _stopped, _ended
        self._conn = None
        self._job: str | None = None  # the job running now (config["job"]): acks and stops name theirs
        self._stopped: set = set()  # the jobs asked to stop, also before they started here
        self._ended = False
        self._proc = None
        self._spawned = None  # (pipe, perf_counter at spawn, {phase: seconds} once ready)
        self._spawn()

    def _spawn(self) -> None:
        """Start the next job's rank process, which imports torch and the runtime, then waits for the job."""
        import subprocess
        import time
        from multiprocessing import Pipe

        conn, child_end = Pipe()
        path = os.pathsep.join(p for p in sys.path if p)  # this actor's: the job's code, wherever Ray put it
        spawned = time.perf_counter()
        self._proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(child_end.fileno()), "standby"],
                                      pass_fds=[child_end.fileno()], env={**os.environ, "PYTHONPATH": path})
        child_end.close()
        self._spawned = (conn, spawned, None)

    def standby(self) -> None:
        """Ready for the driver's next job: a new rank process (the last one has exited)."""
        with self._arrived:
            self._pending, self._conn, self._job, self._ended = [], None, None, False
        self._spawn()

    def _ready(self) -> dict:
        """The standby rank's import timings once it has them (waits for its ("ready", ...)), with
        the relay's own: `spawn_to_ready_s`, process start and imports; `python_start_s`, the rest."""
        conn, spawned, phases = self._spawned
        if phases is None:
            kind, imports = conn.recv()
            assert kind == "ready", kind
            phases = _ready_phases(imports, spawned)
            self._spawned = (conn, spawned, phases)
        return phases

    def ready(self) -> dict:
        """Once the standby rank process has imported torch and the runtime: its `_ready` timings."""
        return self._ready()

    def where(self) -> dict:
        """The node and the GPUs Ray gave this actor: the driver orders the ranks from them."""
        import ray

        ctx = ray.get_runtime_context()
        return {"node": ctx.get_node_id(), "gpus": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]}

    def serve_store(self) -> tuple[str, int]:
        """Rank 0's process serves the TCPStore the ranks' process group starts from, as torchrun's
        agent does (TORCHELASTIC_USE_AGENT_STORE); it lives as long as that process. Waits until the
        process has imported torch."""
        import ray

        host = ray.util.get_node_ip_address()
        self._ready()
        conn = self._spawned[0]
        conn.send(("store", host))
        kind, port = conn.recv()
        assert kind == "store", kind
        return host, port

    def run(self, config: dict, env: dict) -> str | None:
        """Give the standby rank process its job and relay its events until it exits: None when it
        finished the run, else what went wrong."""
        try:
            return self._run(config, env)
        finally:
            with self._arrived:
                self._ended = True
                self._arrived.notify_all()

    def _run(self, config: dict, env: dict) -> str | None:
        import time

        import ray

        conn, proc = self._spawned[0], self._proc
        files = _output_files()
        # before the job is sent: a standby rank starts at once, and may write (and die) before this thread runs again
        stderr_from = _size(files.get("stderr"))  # a kept relay's file holds its earlier jobs' output too
        conn.send({**config, "env": env})  # first, so that it is what the rank reads first even if a stop follows at once
        sent = time.perf_counter()
        with self._arrived:
            self._conn, self._job = conn, config.get("job")
            if self._job in self._stopped:
                _send_quietly(conn, "stop")
        set_policy("SCHED_IDLE")  # from here this process only relays (control_plane_setup)
        self._put({"event": "worker", "rank": int(env["RANK"]), "pid": os.getpid(), "rank_pid": proc.pid,
                   "attempt": config["attempt"], "world_size": int(env["WORLD_SIZE"]),
                   "node": ray.get_runtime_context().get_node_id(),
                   "master": f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}", **files})
        outcome = None
        while True:
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):  # the process exited (and closed its end)
                break
            if kind == "event":
                self._put(self._with_spawn(payload, sent))
            elif kind == "ready":  # the job was sent before the process had imported torch and the runtime
                self._spawned = (conn, self._spawned[1], _ready_phases(payload, self._spawned[1]))
            else:
                outcome = (kind, payload)
        code = proc.wait()
        if outcome is not None and outcome[0] == "failed":
            return outcome[1]
        if outcome is None or code != 0:
            how = f"signal {-code} ({_signal_name(-code)})" if code < 0 else f"code {code}"
            tail = _tail(files.get("stderr"), stderr_from)
            return (f"the rank's process (pid {proc.pid}) exited with {how} before the run ended"
                    + (f"; the last of its stderr: {tail}" if tail else ""))
        return None

    def _with_spawn(self, event: dict, sent: float) -> dict:
        """A rank's `startup` event with the relay's part: its process's start and imports, and how
        long the job had to wait for them (`job_waited_s`, 0 when the process was ready first)."""
        if event["event"] != "startup":
            return event
        phases = self._spawned[2] or {}
        ready_at = self._spawned[1] + phases.get("spawn_to_ready_s", 0.0)
        return {**event, "phases": {**phases, **event["phases"], "job_waited_s": max(0.0, ready_at - sent)}}

    def _put(self, event: dict) -> None:
        with self._arrived:
            self._pending.append(event)
            self._arrived.notify_all()

    def events(self, timeout_s: float) -> list[dict]:
        """The driver's long poll: the rank's events as soon as there are any (or none after
        `timeout_s`, or once the rank's process has ended)."""
        with self._arrived:
            self._arrived.wait_for(lambda: self._pending or self._ended, timeout=timeout_s)
            out, self._pending = self._pending, []
        return out

    def ack(self, step: int, stop: bool, job: str | None = None) -> None:
        """Tell the rank that its step `step` has been delivered, and whether a stop was asked by
        then; `job`: the job it belongs to (a late one for an earlier job of a kept relay is dropped)."""
        with self._arrived:
            if self._conn is not None and job == self._job:
                _send_quietly(self._conn, ("ack", step, stop))

    def stop(self, job: str | None = None) -> None:
        """Pass the stop request to the rank of job `job` (now, or as soon as it starts)."""
        with self._arrived:
            if job not in self._stopped:
                self._stopped.add(job)
                if self._conn is not None and job == self._job:
                    _send_quietly(self._conn, "stop")


def _ready_phases(imports: dict, spawned: float) -> dict:
    """A standby rank's start, now that it said ("ready", imports): `spawn_to_ready_s` on the relay's
    clock, of which `python_start_s` is the interpreter's start and the rank entry's own imports."""
    import time

    took = time.perf_counter() - spawned
    return {**imports, "spawn_to_ready_s": took, "python_start_s": max(0.0, took - sum(imports.values()))}


@functools.cache  # one actor class per driver process, not one per restart of the group
def relay_class():
    """`RankRelay` as a Ray actor class: `run`, the driver's long poll `events`, and `ack` / `stop`
    run concurrently."""
    import ray

    return ray.remote(max_concurrency=4)(RankRelay)


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown"


def _size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


TAIL_LINES, TAIL_BYTES, TAIL_LINE_CHARS = 4, 8192, 300


def _tail(path: str | None, start: int) -> str:
    """The last TAIL_LINES non-blank lines a rank wrote to its stderr file since offset `start` (the
    file's size when its job began), each clipped, joined by ' | '; '' without any. The embedded Ray
    cluster removes its logs when it stops, so this is what is left of a rank that died by a signal
    (an abort's 'terminate called after throwing ...', a fatal Python error)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(max(start, _size(path) - TAIL_BYTES))
            text = f.read(TAIL_BYTES).decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [line.strip()[:TAIL_LINE_CHARS] for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-TAIL_LINES:])


def _output_files() -> dict:
    """The files this process's stdout and stderr go to, which its rank's process inherits (Ray writes
    a worker's output to `<session>/logs/worker-*.out` and `.err`): {"stdout": path, "stderr": path},
    only for plain files (Linux), so the notebook can show each rank's tail."""
    out = {}
    for fd, key in ((1, "stdout"), (2, "stderr")):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if os.path.isfile(path):
            out[key] = path
    return out
