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

_CHILD = "import sys; from backends.ray_relay import _rank_main; _rank_main(int(sys.argv[1]))"


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


def _rank_main(fd: int) -> None:
    """The rank's process: run the per-rank loop, events out and the stop request in over `fd`.

    Stop within `STOP_WITHIN_STEPS` (k) steps, without waiting on every step: the driver
    acknowledges each step event once it has reached whoever follows the job, with the stop request
    as it stood then. In the loop's `should_stop` (before the ranks agree on stopping) the rank
    takes the acknowledgements already in the pipe without waiting, and waits only while its newest
    acknowledged step is more than k - 1 steps behind its newest reported one. So deciding after
    step S, rank 0 holds the acknowledgement of step S - k + 1 or later; a cancel made while step
    N was the newest step seen is in every acknowledgement of a step after N, so every rank stops
    after step N + k at the latest. The acknowledgement's round trip (driver, Ray, two pipes:
    4.6-8.6 ms under load) overlaps the next k - 1 steps instead of adding to each. Only rank 0
    reports steps, so only rank 0 can wait; the others wait for it anyway, in the stop decision's
    all-reduce (Checkpointer.poll), so the decision is the same on every rank. The driver's own
    "stop" message, sent as soon as it sees the cancel, can end the run sooner.
    config["stop_within_steps"] replaces k (1: wait for every step's acknowledgement, as before
    #35; the overhead benchmark's arm)."""
    import traceback
    from multiprocessing.connection import Connection

    _setup_rank_process()
    conn = Connection(fd)
    config = conn.recv()
    lag = int(config.get("stop_within_steps", STOP_WITHIN_STEPS)) - 1  # steps that may go unacknowledged
    stop, sent, acked = False, 0, 0  # sent / acked: the newest step reported / acknowledged

    def sink(event: dict) -> None:
        nonlocal sent
        conn.send(("event", event))
        if event["event"] == "step":
            sent = event["step"]

    def should_stop() -> bool:
        nonlocal stop, acked
        try:
            # conn.poll() without a timeout does not wait; recv() waits only while too far behind
            while not stop and (acked < sent - lag or conn.poll()):
                message = conn.recv()
                if message == "stop":
                    stop = True
                elif message[0] == "ack":  # ("ack", step, stop requested when that step was delivered)
                    acked, stop = max(acked, message[1]), message[2]
        except EOFError:  # the worker is gone: nobody left to report to
            os._exit(1)
        return stop

    train = config.get("entry")  # `workbench calibrate`: its microbenchmarks on the ranks a run gets
    if train is None:
        from workbench.runtime.loop import train
    try:
        train(config["spec"], sink, should_stop=should_stop, resume=config["resume"], attempt=config["attempt"])
    except BaseException as e:  # noqa: BLE001 - every failure goes to the relay, then the driver
        traceback.print_exc()
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        sys.exit(1)
    conn.send(("done", None))


def _send_quietly(conn, message) -> None:
    try:
        conn.send(message)
    except OSError:  # the rank has already exited: nothing left to stop
        pass


class RankRelay:
    """One Ray actor per rank, as torchrun's agent per node: it starts the rank in a process of
    its own, hands the rank's events to the driver as soon as they arrive (a long poll) and
    passes the driver's acknowledgements and the stop request on to the rank. A plain class: Ray
    makes it an actor (`relay_class`) and imports it on the workers from here."""

    def __init__(self):
        self._pending: list[dict] = []
        self._arrived = threading.Condition()  # guards _pending, _conn, _stop, _ended
        self._conn = None
        self._stop = False
        self._ended = False
        self._store = None

    def where(self) -> dict:
        """The node and the GPUs Ray gave this actor: the driver orders the ranks from them."""
        import ray

        ctx = ray.get_runtime_context()
        return {"node": ctx.get_node_id(), "gpus": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]}

    def serve_store(self) -> tuple[str, int]:
        """Rank 0's relay serves the TCPStore the ranks' process group starts from, as torchrun's
        agent does (TORCHELASTIC_USE_AGENT_STORE); it lives as long as this actor."""
        import ray
        from torch.distributed import TCPStore

        host = ray.util.get_node_ip_address()
        self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        return host, self._store.port

    def run(self, config: dict, env: dict) -> str | None:
        """Start the rank's process and relay its events until it exits: None when it finished
        the run, else what went wrong."""
        try:
            return self._run(config, env)
        finally:
            with self._arrived:
                self._ended = True
                self._arrived.notify_all()

    def _run(self, config: dict, env: dict) -> str | None:
        import subprocess
        from multiprocessing import Pipe

        import ray

        conn, child_end = Pipe()
        conn.send(config)  # first, so that it is what the rank reads first even if a stop follows at once
        path = os.pathsep.join(p for p in sys.path if p)  # this actor's: the job's code, wherever Ray put it
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(child_end.fileno())],
                                pass_fds=[child_end.fileno()], env={**os.environ, "PYTHONPATH": path, **env})
        child_end.close()
        with self._arrived:
            self._conn = conn
            if self._stop:
                _send_quietly(conn, "stop")
        set_policy("SCHED_IDLE")  # from here this process only relays (control_plane_setup)
        self._put({"event": "worker", "rank": int(env["RANK"]), "pid": os.getpid(), "rank_pid": proc.pid,
                   "attempt": config["attempt"], "world_size": int(env["WORLD_SIZE"]),
                   "node": ray.get_runtime_context().get_node_id(),
                   "master": f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}", **_output_files()})
        outcome = None
        while True:
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):  # the process exited (and closed its end)
                break
            if kind == "event":
                self._put(payload)
            else:
                outcome = (kind, payload)
        code = proc.wait()
        if outcome is not None and outcome[0] == "failed":
            return outcome[1]
        if outcome is None or code != 0:
            how = f"signal {-code}" if code < 0 else f"code {code}"
            return f"the rank's process (pid {proc.pid}) exited with {how} before the run ended"
        return None

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

    def ack(self, step: int, stop: bool) -> None:
        """Tell the rank that its step `step` has been delivered, and whether a stop was asked by then."""
        with self._arrived:
            if self._conn is not None:
                _send_quietly(self._conn, ("ack", step, stop))

    def stop(self) -> None:
        """Pass the stop request to the rank (now, or as soon as it starts)."""
        with self._arrived:
            if not self._stop:
                self._stop = True
                if self._conn is not None:
                    _send_quietly(self._conn, "stop")


@functools.cache  # one actor class per driver process, not one per restart of the group
def relay_class():
    """`RankRelay` as a Ray actor class: `run`, the driver's long poll `events`, and `ack` / `stop`
    run concurrently."""
    import ray

    return ray.remote(max_concurrency=4)(RankRelay)


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
