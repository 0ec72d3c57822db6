"""The one object the notebook UI shows: the spec being edited, its estimate and the run's events.

Widgets observe it and never talk to each other. Metrics arrive on a runtime thread; they are
appended under a lock and a single refresher thread tells observers at most every
``refresh_s`` seconds (and redraws at most a quarter of the time), so a fast run cannot flood
the browser or block the kernel.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from workbench.errors import ConfigError
from workbench.spec import JobSpec, load_spec

Observer = Callable[[str], None]
_SLEEP_PER_REDRAW = 3  # after a redraw the refresher sleeps 3x as long as it took: redraws <= 1/4 of the time


class WorkbenchState:
    """Spec + derived predictions + run events, with change notification.

    Topics passed to observers: "spec" (the spec or its error changed, estimate recomputed),
    "plan" (planner result), "events" (new metrics, throttled), "run" (run started/ended), "step"
    (a step event, at once, on the runtime's thread: only quick work there).
    """

    def __init__(self, spec: JobSpec | dict | str | None = None, refresh_s: float = 0.5):
        self.raw: dict = load_spec(spec).to_dict() if spec is not None else default_spec_dict()
        self.spec: JobSpec | None = None
        self.error: str | None = None
        self.estimate: dict | None = None
        self.estimate_note: str | None = None
        self.plan: dict | None = None
        self._plan_key: str | None = None  # the job the plan answers, without the layout it picks
        self.events: list[dict] = []
        self.last_step: dict | None = None  # the newest step event of the shown run
        self.history: list[dict] = []  # earlier runs of this session: {"label", "status", "events"}
        self.run_state = "idle"  # idle | running | completed | failed | stopped | preempted
        self._label = ""
        self._resumes = 0  # resumes of the newest fresh run
        self._runs = 0  # fresh runs started in this session: run labels "run 1", "run 2", ...
        self.refresh_s = refresh_s
        self._observers: list[Observer] = []
        self._lock = threading.Lock()
        self._dirty = threading.Event()
        self._refresher: threading.Thread | None = None
        self.set_raw(self.raw)

    # -- observers -----------------------------------------------------------------------
    def observe(self, fn: Observer) -> None:
        self._observers.append(fn)

    def notify(self, topic: str) -> None:
        for fn in list(self._observers):
            try:
                fn(topic)
            except Exception as e:  # one broken panel must not stop the others from updating
                self.estimate_note = f"display error in a panel: {type(e).__name__}: {e}"

    # -- spec ----------------------------------------------------------------------------
    def set_raw(self, raw: dict) -> None:
        """Validate a raw spec dict; on success recompute the memory estimate. Never raises."""
        self.raw = raw
        try:
            self.spec = load_spec(raw)
            self.error = None
        except ConfigError as e:
            self.spec, self.error = None, str(e)
        except Exception as e:  # noqa: BLE001 - a bug behind the spec (e.g. reading a model folder): shown, never raised
            self.spec, self.error = None, f"the spec could not be read: {type(e).__name__}: {e}"
        self._estimate()
        if self.plan is not None and self.spec is not None and _plan_key(raw, self.spec) != self._plan_key:
            self.plan = None  # it answered another job (kept while the form is invalid: its rows can fix it)
        self.notify("spec")

    def update(self, overrides: dict[str, Any]) -> None:
        """Apply ``{"layout.dp": 4, ...}`` to the raw spec and re-validate."""
        self.set_raw(apply_overrides(self.raw, overrides))

    def _estimate(self) -> None:
        self.estimate = None
        if self.spec is None:
            self.estimate_note = None
            return
        try:
            from workbench.memory import estimate_memory
        except ImportError:
            self.estimate_note = "The memory model (workbench.memory) is not installed in this build yet."
            return
        try:
            self.estimate = estimate_memory(self.spec).to_dict()
            self.estimate_note = None
        except ConfigError as e:
            self.estimate_note = str(e)

    def run_plan(self, top: int = 8) -> None:
        """Ask the planner for the best layouts of the current spec (sets .plan or .estimate_note)."""
        if self.spec is None:
            return
        try:
            from workbench.planner import plan
        except ImportError:
            self.plan = {"note": "The planner (workbench.planner) is not installed in this build yet."}
        else:
            try:
                self.plan = plan(self.spec).to_dict(top=top)  # with its "source": a calibrated profile or the catalog
            except ConfigError as e:
                self.plan = {"note": str(e)}
        self._plan_key = _plan_key(self.raw, self.spec)
        self.notify("plan")

    # -- run events (called from the runtime's thread) -----------------------------------
    def add_event(self, event: dict) -> None:
        with self._lock:
            self.events.append(event)
            if event.get("event") == "end":
                self.run_state = str(event.get("status", "completed"))
            elif event.get("event") == "step":
                self.last_step = event
        self._dirty.set()
        if event.get("event") == "step":
            self.notify("step")  # at once, on this thread: observers keep it quick (RunPanel._show_step)

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.events)

    def start_events(self, label: str, carry: list[dict] = ()) -> None:
        """Move the previous run's events to `history` and start the new run's with `carry` (a
        resumed run continues the curves of the run it resumes); start the throttled refresher."""
        with self._lock:
            if self.events:
                self.history.append({"label": self._label, "status": self.run_state, "events": self.events})
            self.events, self._label = list(carry), label
            self.last_step = next((e for e in reversed(self.events) if e.get("event") == "step"), None)
            self.run_state = "running"
        self._dirty.set()  # wakes the refresher, asleep without a timeout since the last run ended (#34)
        self.notify("run")
        self.notify("events")  # the previous run's curves go at once, not with the new run's first step
        if self._refresher is None:
            self._refresher = threading.Thread(target=self._refresh_loop, name="workbench-ui-refresh", daemon=True)
            self._refresher.start()

    def run_label(self, resume: bool = False) -> str:
        """The label of the run about to start: "run N" for the N-th fresh run of the session, and a
        resume keeps the number of the run it continues ("run N (resumed)")."""
        if not resume or self._runs == 0:
            self._runs, self._resumes = self._runs + 1, 0
            return f"run {self._runs}"
        self._resumes += 1
        return f"run {self._runs} (resumed)" if self._resumes == 1 else f"run {self._runs} (resumed {self._resumes}x)"

    def touch(self) -> None:
        """Ask for a redraw without a new event (e.g. the run's start-up moved on)."""
        self._dirty.set()

    def _refresh_loop(self) -> None:
        """Lives as long as the state (a thread that ended between two runs would miss the next)."""
        shown = self.run_state
        while True:
            # at least once a second while running: the elapsed time moves on
            self._dirty.wait(timeout=1.0 if self.run_state == "running" else None)
            self._dirty.clear()
            started = time.monotonic()
            self.notify("events")
            if self.run_state != shown:
                shown = self.run_state
                self.notify("run")
            # Throttle: at most one redraw per refresh_s, and never more than a quarter of the time:
            # a redraw holds the GIL (building the figures), and the kernel's own thread must stay
            # free for a click (Stop) however long the run's curves grow or however loaded the host.
            time.sleep(max(self.refresh_s, _SLEEP_PER_REDRAW * (time.monotonic() - started)))

    def finish(self, status: str) -> None:
        """Mark the run as ended (when the runtime stopped without an "end" event)."""
        with self._lock:
            if self.run_state == "running":
                self.run_state = status
        self._dirty.set()


def apply_overrides(raw: dict, overrides: dict[str, Any]) -> dict:
    """A copy of `raw` with ``{"layout.dp": 4, ...}`` applied (None removes the key: its default)."""
    raw = _copy(raw)
    for key, value in overrides.items():
        node = raw
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return raw


def default_spec_dict() -> dict:
    """The quickstart job: gpt-tiny, data parallel on 2 local CPU workers, 20 steps."""
    return {"name": "quickstart", "model": {"preset": "gpt-tiny"},
            "train": {"steps": 20, "global_batch": 16, "micro_batch": 4},
            "layout": {"dp": 2}, "resources": {"gpu": "cpu", "gpus_per_node": 2, "nodes": 1}}


def _plan_key(raw: dict, spec: JobSpec) -> str:
    """What a plan depends on: the spec but the layout, micro-batch and per-node GPUs the planner sets,
    and the number of GPUs it searches (which follows the layout when resources.gpus_per_node is not
    given: a plan for 1 GPU stayed on screen after dp went to 8)."""
    import json

    rest = {k: v for k, v in raw.items() if k != "layout"}
    rest["train"] = {k: v for k, v in (raw.get("train") or {}).items() if k != "micro_batch"}
    rest["resources"] = {k: v for k, v in (raw.get("resources") or {}).items() if k != "gpus_per_node"}
    rest["gpus"] = spec.resources.num_gpus
    return json.dumps(rest, sort_keys=True, default=str)


def _copy(d: dict) -> dict:
    import copy

    return copy.deepcopy(d)
