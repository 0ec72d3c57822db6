"""The `local` backend: an embedded Ray cluster, one actor per rank (the `ray` backend's job runs
the same on an existing cluster).

Each actor (`RankRelay`) takes a fraction of a CPU (gloo: 4-8 ranks run on a 2-core machine) or
one GPU (NCCL), starts its rank in a child process with torchrun's variables, as torchrun's agent
does, and relays: the rank's process has no Ray in it, and the cluster's own processes yield the
CPU to the ranks (`control_plane_setup`). A driver thread long-polls the relays: a rank's events
reach whoever follows the job as they arrive, and rank 0 waits for the driver's acknowledgement
of each step, which carries the stop request (so Stop ends the run within one step of the step
seen when it was pressed: `_rank_main`). On a failure it
tears the group down and starts it again from the last checkpoint (`backend.max_failures`).

Plain actors rather than Ray Train: Ray Train adds five helper actors (controller, synchronization,
placement-group cleaner, dataset manager, autoscaling coordinator), each woken ~100 times a second,
which on a machine whose cores all run ranks cost the ranks measurable time (docs/benchmarks.md,
section a), and ~20 s of start-up.
"""
from __future__ import annotations

import functools
import itertools
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from backends.base import JobState, JobStatus
from backends.elastic import describe, groups_that_fit, shrink
from workbench.errors import WorkerError

_POLL_S = 0.2  # how often the driver thread looks for a cancel while it waits for placement or events
_LONG_POLL_S = 0.5  # the most a relay holds the driver's request for events when there are none
_PLACEMENT_WARN_S = 30.0


def _package_root() -> str:
    # backends/ and workbench/ install side by side (pyproject: one distribution, both packages),
    # so their common parent puts both on the workers' path; no `import workbench` (an import cycle).
    return str(Path(__file__).resolve().parent.parent)


def ensure_ray(num_cpus: int | None = None, note: Callable[[str, str], None] | None = None, fallback: str = ""):
    """Start (or reuse) the embedded Ray cluster; workers import workbench from this checkout.

    The start survives a busy machine (backends/ray_start.py): each attempt runs in a folder of its
    own under `<ray temp dir>/workbench/`, bounded by WORKBENCH_RAY_START_TIMEOUT_S; a failed
    attempt's processes and folder are removed before the next; after the last, RayStartError
    (exit 69) says what timed out, the load seen and what to try (`fallback`: the Ray-free route).
    `note(kind, line)` gets a warning for each retry and a note while a start is under way (default:
    printed on stderr). The folder is removed
    when this process exits.

    Safe from any thread: Ray forks its gcs_server and raylet with PR_SET_PDEATHSIG, which Linux
    fires when the *thread* that forked them exits, and the driver dies 60 s later ("Failed to
    connect to GCS"). Off the main thread (the notebook's Run button) the cluster is therefore
    started by a thread that lives as long as the process.
    """
    import ray

    from backends.ray_start import start_ray

    if not ray.is_initialized():
        def say(kind: str, line: str) -> None:
            print(f"{kind}: {line}", file=sys.stderr, flush=True)

        start_ray(functools.partial(_init_ray, num_cpus), ray.shutdown, note=note or say,
                  on_owner_thread=threading.current_thread() is not threading.main_thread(), fallback=fallback)
    return ray


def _init_ray(num_cpus: int | None, temp_dir: str) -> None:
    import ray

    root = _package_root()
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    ray.init(
        # "local": always an embedded cluster, never one a `ray start` left running
        # (that is the `ray` backend's job).
        address="local",
        num_cpus=num_cpus or os.cpu_count() or 1,
        include_dashboard=False,
        logging_level="ERROR",
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path},
                     "worker_process_setup_hook": "backends.local_ray.control_plane_setup"},
        # Ray runs workers at nice 15 so that its own daemons stay responsive; here
        # the workers are the job and should not yield to every daemon wake-up (no
        # measurable change on a 2-core VM: docs/benchmarks.md, section a).
        _system_config={"worker_niceness": 0},
        _temp_dir=temp_dir,  # this attempt's own folder: what it started is known by it (ray_start.py)
    )


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


def control_plane_setup() -> None:
    """Every Ray worker process of the embedded cluster runs SCHED_BATCH (its runtime_env's
    worker_process_setup_hook): Ray's core worker wakes each actor process ~100 times a second,
    and a batch process does not preempt a rank when it wakes; it runs on a CPU the ranks leave
    idle (waiting on a collective) or at the next tick. The ranks switch back to SCHED_OTHER
    (`_rank_main`).

    A relay goes further, to SCHED_IDLE, once its rank has started (a rank forked from an idle
    process cannot leave SCHED_IDLE without privileges, so the hook cannot): it then runs only on
    CPU time the ranks leave idle."""
    _set_policy("SCHED_BATCH")


def _rank_main(fd: int) -> None:
    """The rank's process: run the per-rank loop, events out and the stop request in over `fd`.

    Stop within one step: after each step event it sends, the rank waits (in the loop's
    `should_stop`, before the ranks agree on stopping) for the driver's acknowledgement, sent once
    the event has reached whoever follows the job, with the stop request as it stood then. So a
    cancel made while step N was the newest step seen stops every rank after step N + 1 at the
    latest. Only rank 0 reports steps, so only rank 0 waits; the others wait for it anyway, in the
    stop decision's all-reduce (Checkpointer.poll)."""
    import traceback
    from multiprocessing.connection import Connection

    parent = os.getppid()
    _set_policy("SCHED_OTHER")  # a rank is not control plane (control_plane_setup)
    _normal_priority()
    _die_with_parent()
    if os.getppid() != parent:  # the worker died before the line above
        sys.exit(1)
    conn = Connection(fd)
    config = conn.recv()
    stop, sent, acked = False, 0, 0  # sent / acked: the newest step reported / acknowledged

    def sink(event: dict) -> None:
        nonlocal sent
        conn.send(("event", event))
        if event["event"] == "step":
            sent = event["step"]

    def should_stop() -> bool:
        nonlocal stop, acked
        try:
            while not stop and (acked < sent or conn.poll()):
                message = conn.recv()
                if message == "stop":
                    stop = True
                elif message[0] == "ack":  # ("ack", step, stop requested when that step was delivered)
                    acked, stop = max(acked, message[1]), message[2]
        except EOFError:  # the worker is gone: nobody left to report to
            os._exit(1)
        return stop

    from workbench.runtime.loop import train

    train = config.get("entry") or train  # `workbench calibrate`: its microbenchmarks on the ranks a run gets
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


@functools.cache  # one class per driver process, not one per restart of the group
def _relay_class():
    import ray

    @ray.remote(max_concurrency=4)  # `run`, the driver's long poll `events`, and `ack` / `stop`
    class RankRelay:
        """One Ray actor per rank, as torchrun's agent per node: it starts the rank in a process of
        its own, hands the rank's events to the driver as soon as they arrive (a long poll) and
        passes the driver's acknowledgements and the stop request on to the rank."""

        def __init__(self):
            self._pending: list[dict] = []
            self._arrived = threading.Condition()  # guards _pending, _conn, _stop, _ended
            self._conn = None
            self._stop = False
            self._ended = False
            self._store = None

        def where(self) -> dict:
            """The node and the GPUs Ray gave this actor: the driver orders the ranks from them."""
            ctx = ray.get_runtime_context()
            return {"node": ctx.get_node_id(), "gpus": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]}

        def serve_store(self) -> tuple[str, int]:
            """Rank 0's relay serves the TCPStore the ranks' process group starts from, as torchrun's
            agent does (TORCHELASTIC_USE_AGENT_STORE); it lives as long as this actor."""
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
            _set_policy("SCHED_IDLE")  # from here this process only relays (control_plane_setup)
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

    return RankRelay


def rank_order(where: list[dict]) -> list[int]:
    """Each relay's rank, from where Ray placed it (`RankRelay.where`, with the relay's placement
    `bundle`): grouped by node (nodes in order of first appearance), then by bundle, then by GPU id,
    so that a node's ranks are consecutive, a bundle's ranks (one tp group) are consecutive, and
    local ranks follow the GPUs, as torchrun numbers them."""
    nodes: dict[str, int] = {}
    for w in where:
        nodes.setdefault(w["node"], len(nodes))

    def key(i: int):
        gpu = where[i]["gpus"][0] if where[i]["gpus"] else ""
        return nodes[where[i]["node"]], where[i].get("bundle", 0), (int(gpu), "") if gpu.isdigit() else (-1, gpu), i

    ranks = [0] * len(where)
    for rank, i in enumerate(sorted(range(len(where)), key=key)):
        ranks[i] = rank
    return ranks


def rank_env(where: list[dict], ranks: list[int], i: int, master: tuple[str, int]) -> dict:
    """Relay `i`'s rank's environment: torchrun's variables and, with GPUs, every GPU of its node
    visible, LOCAL_RANK selecting its own (Ray shows each actor only its own GPU)."""
    node = where[i]["node"]
    peers = sorted((ranks[j], j) for j in range(len(where)) if where[j]["node"] == node)
    env = {"RANK": str(ranks[i]), "WORLD_SIZE": str(len(where)),
           "LOCAL_RANK": str([j for _, j in peers].index(i)), "LOCAL_WORLD_SIZE": str(len(peers)),
           "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    gpus = [g for _, j in peers for g in where[j]["gpus"]]
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        env["LOCAL_RANK"] = str(gpus.index(where[i]["gpus"][0]))
    return env


class LocalRayJob:
    """A job on a Ray cluster (a JobHandle): one relay actor per rank in a placement group, polled
    by a driver thread; on a failure the group is torn down and started again from the last
    checkpoint, up to `backend.max_failures` times.

    The placement group has one bundle per tensor-parallel group (tp ranks; mesh order puts tp
    innermost, so they are consecutive ranks): a bundle lives on one node, so tp's collectives never
    cross nodes, and PACK fills nodes before spreading. A restart asks for the same resources per
    rank, on whatever nodes are left; with `backend.elastic` it takes the largest dp they hold
    (backends/elastic.py) instead of waiting for capacity."""

    def __init__(self, spec, on_event: Callable[[dict], None] | None = None, resume: bool = False,
                 entry: dict | None = None):
        """`entry`: {"entry": callable} runs that per-rank function (a module-level function, sent to
        the ranks by reference; `workbench calibrate`'s microbenchmarks) instead of the training loop."""
        import torch

        ensure_ray()
        self.spec = spec
        self.job_id = f"{spec.name}-{int(time.time())}"
        self.events: list[dict] = []
        self._on_event = on_event
        self._resume = resume
        self._entry = entry or {}
        self._run_id = os.environ.get("WORKBENCH_RUN_ID") or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._state = JobState.PENDING
        self._error: str | None = None
        self._end: dict | None = None
        self._delivered = threading.Condition()  # guards events and _finished; tells followers
        self._finished = False
        self._stop = False
        self._use_gpu = torch.cuda.is_available() and spec.resources.gpu != "cpu"
        self._layout = spec  # the layout running now: a smaller dp after an elastic shrink
        self._per_rank = self._bundle()  # fixed for the job: restarts ask for the same per rank
        self._thread = threading.Thread(target=self._fit, name=f"workbench-{self.job_id}", daemon=True)
        self._thread.start()

    def _fit(self) -> None:
        self._state = JobState.RUNNING
        try:
            for attempt in itertools.count():
                failure = self._run_group(attempt)
                if failure is None:
                    break
                if self._stop or attempt >= self.spec.backend.max_failures:
                    self._error = failure
                    break
        except Exception as e:  # noqa: BLE001 - reported through status and wait()
            self._error = f"{type(e).__name__}: {e}"
        finally:
            try:
                if self._end is not None:  # rank 0's end, held back until every rank had finished
                    self._deliver(self._end)
            finally:
                with self._delivered:
                    self._finished = True
                    self._delivered.notify_all()

    def _bundle(self) -> dict:
        import ray

        if self._use_gpu:
            return {"CPU": 1.0, "GPU": 1.0}
        return {"CPU": min(1.0, ray.cluster_resources().get("CPU", 1) / self.spec.world_size)}

    def _run_group(self, attempt: int) -> str | None:
        """Start one relay per rank, run the ranks to the end and tear the group down; None when
        the run ended, else the first rank's failure to arrive, "rank N: what happened" (with an
        `error` event): the cause, where the other ranks' failures are its consequences (a peer's
        collective broken by the killed rank)."""
        import ray
        from ray.util.placement_group import remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        placed = self._place(attempt)
        if placed is None:
            self._state = JobState.STOPPED
            return None
        group, spec = placed
        world, tp, bundle = spec.world_size, spec.layout.tp, self._per_rank
        relays, runs = [], {}
        try:
            relay = _relay_class()
            relays = [relay.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, i // tp)).remote()
                      for i in range(world)]
            where = [{**w, "bundle": i // tp} for i, w in enumerate(ray.get([r.where.remote() for r in relays]))]
            ranks = rank_order(where)
            master = ray.get(relays[ranks.index(0)].serve_store.remote())
            config = {"spec": spec.to_dict(), "resume": self._resume or attempt > 0, "attempt": attempt, **self._entry}
            # WORKBENCH_RUN_ID: the restarted group is the same run, so it takes over the checkpoint lease
            envs = [{**rank_env(where, ranks, i, master), "WORKBENCH_RUN_ID": self._run_id} for i in range(world)]
            runs = {relays[i].run.remote(config, envs[i]): ranks[i] for i in range(world)}
            failure = self._relay(relays, runs)
            if failure is not None:
                self._accept({"event": "error", "rank": failure[0], "message": failure[1]})
            return None if failure is None else f"rank {failure[0]}: {failure[1]}"
        finally:
            for r in relays:
                ray.kill(r)
            if runs:  # wait until the relays, and so their ranks (PR_SET_PDEATHSIG), are gone
                ray.wait(list(runs), num_returns=len(runs), timeout=30)
            remove_placement_group(group)

    def _group_bundle(self, spec) -> dict:
        """The resources of one placement bundle: a tp group's ranks."""
        return {k: v * spec.layout.tp for k, v in self._per_rank.items()}

    def _place(self, attempt: int):
        """(placement group, spec) once the cluster holds this attempt's ranks; None when the job was
        cancelled first. With backend.elastic, a restart takes the largest dp the live nodes hold,
        and shrinks again if more nodes are declared dead while it waits."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        elastic = self.spec.backend.elastic and attempt > 0
        while True:
            spec = self._layout
            if elastic:
                groups = groups_that_fit(ray.nodes(), self._group_bundle(spec))
                smaller = shrink(spec, groups)  # ConfigError: the job fails with its reason
                if smaller is not None:
                    self._accept({"event": "warning", "message": describe(spec, smaller, groups)})
                    spec = self._layout = smaller
            group = placement_group([self._group_bundle(spec)] * (spec.world_size // spec.layout.tp),
                                    strategy="PACK")
            try:
                outcome = self._wait_for_placement(group, spec, elastic)
            except BaseException:  # a refused shrink: the group must not linger in the cluster
                remove_placement_group(group)
                raise
            if outcome == "placed":
                return group, spec
            remove_placement_group(group)
            if outcome == "stopped":
                return None

    def _wait_for_placement(self, group, spec, elastic: bool) -> str:
        """Wait until the cluster holds every rank (an autoscaler may be adding nodes); say what is
        missing after `_PLACEMENT_WARN_S`. "placed", "stopped" when the job was cancelled first, or
        (`elastic`) "shrink" when the live nodes can no longer hold the group (the GCS declares a
        lost node dead seconds after the ranks on it failed)."""
        import ray

        bundle = self._per_rank
        warn_at = time.monotonic() + _PLACEMENT_WARN_S
        check_at = time.monotonic()
        while not ray.wait([group.ready()], timeout=_POLL_S)[0]:
            if self._stop:
                return "stopped"
            if elastic and time.monotonic() > check_at:
                check_at = time.monotonic() + 1.0
                if shrink(spec, groups_that_fit(ray.nodes(), self._group_bundle(spec))) is not None:
                    return "shrink"
            if warn_at is not None and time.monotonic() > warn_at:
                warn_at = None
                free, total = ray.available_resources(), ray.cluster_resources()
                need = ", ".join(f"{k} {v:g}" for k, v in bundle.items())
                has = ", ".join(f"{k} {free.get(k, 0):g} free of {total.get(k, 0):g}" for k in bundle)
                together = f", tp({spec.layout.tp}) of them on one node" if spec.layout.tp > 1 else ""
                self._accept({"event": "warning", "message": (
                    f"waiting for resources: {spec.world_size} ranks need {need} each{together}; the cluster has "
                    f"{has} (another job holds them, or an autoscaler is still adding nodes); cancel to give up")})
        return "placed"

    @staticmethod
    def _outcome(ref, rank: int) -> tuple[int, str] | None:
        import ray

        try:
            message = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            message = f"its Ray worker died ({type(e).__name__}; the Ray logs say why, e.g. out of memory)"
        return None if message is None else (rank, message)

    def _relay(self, relays: list, runs: dict) -> tuple[int, str] | None:
        """Deliver the ranks' events as they arrive and pass the stop on, until every rank has ended
        or one failed: None, or (rank, what happened) of the first failure to arrive."""
        import ray

        relay_runs = dict(zip(relays, runs))  # relay -> its `run`
        polls = {r.events.remote(_LONG_POLL_S): r for r in relays}
        pending, failure, stop_sent = set(runs), None, False
        while pending and failure is None:
            done, _ = ray.wait([*pending, *polls], num_returns=1, timeout=_POLL_S)
            for ref in done:
                if ref in pending:
                    pending.discard(ref)
                    failure = failure or self._outcome(ref, runs[ref])
                else:
                    relay = polls.pop(ref)
                    self._take(relay, ref)
                    if relay_runs[relay] in pending:  # an ended rank's relay answers at once: no spinning
                        polls[relay.events.remote(_LONG_POLL_S)] = relay
            if self._stop and not stop_sent:
                stop_sent = True
                for r in relays:
                    r.stop.remote()
        # The last events: a relay's `events` returns at once when its rank has ended; a failed
        # rank's relay is still up; a peer still blocked in a collective answers after the long poll.
        for ref, relay in polls.items():
            self._take(relay, ref)
        for r in relays:
            self._take(r, r.events.remote(0.0))
        return failure

    def _take(self, relay, ref) -> None:
        """Deliver one relay's events, then acknowledge its newest step (see `_rank_main`)."""
        import ray

        try:
            events = ray.get(ref)
        except ray.exceptions.RayActorError:  # its `run` reports the death
            return
        for event in events:
            self._accept(event)
        steps = [e["step"] for e in events if e["event"] == "step"]
        if steps:
            relay.ack.remote(max(steps), self._stop)  # read after delivery: a cancel made by then is in it

    def _accept(self, event: dict) -> None:
        """Deliver an event; rank 0's `end` is held back until every rank has finished (the other
        ranks' last events may still be on their way, and `end` is the last event of a run)."""
        if event["event"] == "end":
            self._end = event
            self._state = JobState.STOPPED if event["status"] == "preempted" else JobState.COMPLETED
        else:
            self._deliver(event)

    def _deliver(self, event: dict) -> None:
        if self._on_event is not None:
            self._on_event(event)
        with self._delivered:
            self.events.append(event)
            self._delivered.notify_all()

    def follow(self, timeout_s: float | None = None):
        """Yield events as they arrive until the job ends (or `timeout_s` passed)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        seen = 0
        while True:
            with self._delivered:
                while seen == len(self.events) and not self._finished:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return
                    self._delivered.wait(timeout=left)
                new, finished = self.events[seen:], self._finished  # finished: nothing more comes
            for event in new:
                seen += 1
                yield event
            if finished:
                self._thread.join()
                return
            if deadline is not None and time.monotonic() > deadline:
                return

    def wait(self, timeout_s: float | None = None) -> JobStatus:
        for _ in self.follow(timeout_s):
            pass
        return self.status()

    def status(self) -> JobStatus:
        if not self._finished:
            return JobStatus(self._state)
        if self._error is not None:
            return JobStatus(JobState.FAILED, self._error)
        if self._state == JobState.RUNNING:  # finished without an end event
            return JobStatus(JobState.FAILED, "workers exited without finishing the run")
        return JobStatus(self._state)

    def logs(self, tail: int = 100) -> str:
        import json

        return "\n".join(json.dumps(e) for e in self.events[-tail:])

    def cancel(self) -> None:
        """Ask the ranks to stop after the current step (they agree on the step)."""
        self._stop = True

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
