"""The `local` backend's job, the driver side: an embedded Ray cluster, one relay actor per rank
(the `ray` backend's job runs the same on an existing cluster).

Each relay (backends/ray_relay.py) takes a fraction of a CPU (gloo: 4-8 ranks run on a 2-core
machine) or one GPU (NCCL), starts its rank in a child process with torchrun's variables, as
torchrun's agent does, and relays: the rank's process has no Ray in it, and the cluster's own
processes yield the CPU to the ranks (backends/embedded_ray.py, `control_plane_setup`). A driver
thread here long-polls the relays: a rank's events reach whoever follows the job as they arrive,
and the driver acknowledges each step it delivered, with the stop request; rank 0 lets at most
`STOP_WITHIN_STEPS` - 1 steps go unacknowledged (so Stop ends the run at most `STOP_WITHIN_STEPS`,
2, steps after the step seen when it was pressed, and the acknowledgement's round trip overlaps the
next step instead of adding to each: `ray_relay._rank_main`).
On a failure it tears the group down and starts it again from the last checkpoint
(`backend.max_failures`). Each relay starts its rank's process as it starts, before the job is
known, and a job that ended cleanly leaves its relays, each with its next rank process, to the
driver's next job of the same shape (backends/ray_warm.py); the job's `startup` event says where
launch to step 1 went (workbench/startup.py; docs/architecture.md, "Starting a job's ranks").

Plain actors rather than Ray Train: Ray Train adds five helper actors (controller, synchronization,
placement-group cleaner, dataset manager, autoscaling coordinator), each woken ~100 times a second,
which on a machine whose cores all run ranks cost the ranks measurable time (docs/benchmarks.md,
section a), and ~20 s of start-up.
"""
from __future__ import annotations

import itertools
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

from backends import ray_warm
from backends.base import JobState, JobStatus
from backends.elastic import describe, groups_that_fit, shrink
from backends.embedded_ray import ensure_ray
from backends.ray_relay import relay_class
from workbench.errors import WorkerError

__all__ = ["LocalRayBackend", "LocalRayJob", "ensure_ray", "rank_env", "rank_order"]

_POLL_S = 0.2  # how often the driver thread looks for a cancel while it waits for placement or events
_LONG_POLL_S = 0.5  # the most a relay holds the driver's request for events when there are none
_PLACEMENT_WARN_S = 30.0


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
                 entry: dict | None = None, startup: dict | None = None):
        """`entry`: {"entry": callable} runs that per-rank function (a module-level function, sent to
        the ranks by reference; `workbench calibrate`'s microbenchmarks) instead of the training loop.
        `startup`: {"launched": time.monotonic() at launch, "phases": {phase: seconds}} of what the
        caller did before (local_start.start: checks, Ray), the start of the `startup` event."""
        ray = ensure_ray()
        startup = startup or {}
        self._clock = _Clock(startup.get("launched", time.monotonic()), startup.get("phases", {}))
        self._clock.mark("job_s")
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
        # the cluster's GPUs, not this process's: no torch import in the driver (seconds of start-up)
        self._use_gpu = spec.resources.gpu != "cpu" and ray.cluster_resources().get("GPU", 0) > 0
        self._rank_startup: dict[int, dict] = {}
        self._world = spec.world_size
        self._job: str | None = None  # the running group's id (config["job"]): its acks and stops name it
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
        """Start one relay per rank (or take those a previous job of this driver left: ray_warm.py),
        run the ranks to the end and tear the group down, or keep it for the next job when every
        rank ended cleanly; None when the run ended, else the first rank's failure to arrive,
        "rank N: what happened" (with an `error` event): the cause, where the other ranks' failures
        are its consequences (a peer's collective broken by the killed rank)."""
        import ray

        started = self._start_relays(attempt)
        if started is None:
            self._state = JobState.STOPPED
            return None
        group, spec, relays, where = started
        world, runs, kept = spec.world_size, {}, False
        try:
            ranks = rank_order(where)
            master = ray.get(relays[ranks.index(0)].serve_store.remote())  # once rank 0 has imported torch
            self._clock.mark("store_s")
            self._job = uuid.uuid4().hex  # a kept relay's late acks and stops for this job reach no later job
            config = {"spec": spec.to_dict(), "resume": self._resume or attempt > 0, "attempt": attempt,
                      "job": self._job, **self._entry}
            # WORKBENCH_RUN_ID: the restarted group is the same run, so it takes over the checkpoint lease
            envs = [{**rank_env(where, ranks, i, master), "WORKBENCH_RUN_ID": self._run_id} for i in range(world)]
            runs = {relays[i].run.remote(config, envs[i]): ranks[i] for i in range(world)}
            self._rank_startup, self._world = {}, world
            failure = self._relay(relays, runs)
            if failure is not None:
                self._accept({"event": "error", "rank": failure[0], "message": failure[1]})
            else:
                kept = ray_warm.keep(self._warm_key(spec), group, relays, where)
            return None if failure is None else f"rank {failure[0]}: {failure[1]}"
        finally:
            if not kept:
                _tear_down(group, relays, runs)

    def _warm_key(self, spec) -> tuple:
        return spec.world_size, spec.layout.tp, tuple(sorted(self._per_rank.items()))

    def _start_relays(self, attempt: int):
        """(placement group, spec, relays, where they run) for this attempt: a previous job's kept
        relays for a first attempt of the same shape, else new ones once the cluster holds them;
        None when the job was cancelled first. Each relay starts its rank's process at once."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if attempt == 0:
            kept = ray_warm.take(self._warm_key(self._layout))
            if kept is not None:
                self._clock.reused = True
                self._clock.mark("relays_s")
                return kept[0], self._layout, kept[1], kept[2]
        else:
            ray_warm.release_warm()  # a restart needs the resources another job's kept relays hold
        placed = self._place(attempt)
        if placed is None:
            return None
        self._clock.mark("placement_s")
        group, spec = placed
        bundle, relays = self._per_rank, []
        try:
            relay = relay_class()
            relays = [relay.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, i // spec.layout.tp)).remote()
                      for i in range(spec.world_size)]
            where = [{**w, "bundle": i // spec.layout.tp}
                     for i, w in enumerate(ray.get([r.where.remote() for r in relays]))]
        except BaseException:
            _tear_down(group, relays, {})
            raise
        self._clock.mark("relays_s")
        return group, spec, relays, where

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
                    r.stop.remote(self._job)
        # The last events: a relay's `events` returns at once when its rank has ended; a failed
        # rank's relay is still up; a peer still blocked in a collective answers after the long poll.
        for ref, relay in polls.items():
            self._take(relay, ref)
        for r in relays:
            self._take(r, r.events.remote(0.0))
        return failure

    def _take(self, relay, ref) -> None:
        """Deliver one relay's events, then acknowledge its newest step (see `ray_relay._rank_main`)."""
        import ray

        try:
            events = ray.get(ref)
        except ray.exceptions.RayActorError:  # its `run` reports the death
            return
        for event in events:
            self._accept(event)
        steps = [e["step"] for e in events if e["event"] == "step"]
        if steps:
            relay.ack.remote(max(steps), self._stop, self._job)  # read after delivery: a cancel made by then is in it

    def _accept(self, event: dict) -> None:
        """Deliver an event; rank 0's `end` is held back until every rank has finished (the other
        ranks' last events may still be on their way, and `end` is the last event of a run). The
        ranks' `startup` events become one, with the driver's part, once every rank's is in."""
        if event["event"] == "startup":
            self._rank_startup[event["rank"]] = event["phases"]
            if len(self._rank_startup) == self._world:
                self._deliver(self._clock.event(self._rank_startup))
            return
        if event["event"] == "step" and self._clock.step_1_at is None:
            self._clock.step_1()
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
        """Ask the ranks to stop: every rank stops after the same step, at most `STOP_WITHIN_STEPS`
        steps after the newest step delivered when this is called (`ray_relay._rank_main`)."""
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

    def submit(self, spec, on_event=None, resume: bool = False, startup: dict | None = None) -> LocalRayJob:
        return LocalRayJob(spec, on_event=on_event, resume=resume, startup=startup)


def _tear_down(group, relays: list, runs: dict) -> None:
    """Kill the relays and, with them, their ranks; free the placement group."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for r in relays:
        ray.kill(r)
    if runs:  # wait until the relays, and so their ranks (PR_SET_PDEATHSIG), are gone
        ray.wait(list(runs), num_returns=len(runs), timeout=30)
    remove_placement_group(group)


class _Clock:
    """The driver's part of a job's start-up, on this process's monotonic clock only (the ranks
    report durations on theirs): each phase is the time since the previous mark."""

    def __init__(self, launched: float, phases: dict):
        self.launched, self.phases, self.reused = launched, dict(phases), False
        self._last = launched + sum(phases.values())
        self.step_1_at: float | None = None

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now

    def step_1(self) -> None:
        """Rank 0's first step event has reached the driver."""
        self.mark("ranks_s")
        self.step_1_at = time.monotonic()

    def event(self, ranks: dict) -> dict:
        """The `startup` event: the driver's phases, each rank's, and launch to step 1's arrival."""
        total = None if self.step_1_at is None else self.step_1_at - self.launched
        return {"event": "startup", "launch_to_step_1_s": total, "reused": self.reused, "driver": dict(self.phases),
                "ranks": {str(r): ranks[r] for r in sorted(ranks)}}
