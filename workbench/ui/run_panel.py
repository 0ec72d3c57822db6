"""Run panel: Run / Stop / Resume on local Ray, live figures, the run's log, history and report.

Each button only starts work; the job is followed on a background thread, and every figure and
text is drawn from the state (`render`), so the kernel stays free for other cells while the job
runs. Ray itself is started by a thread that outlives the run (`backends.local_ray.ensure_ray`).
"""
from __future__ import annotations

import contextlib
import html
import os
import threading
import time
import uuid
from pathlib import Path

import ipywidgets as w

from workbench.errors import ConfigError, WorkerError
from workbench.report import figures
from workbench.ui.live import FigureBox, LiveFigure, note_html
from workbench.ui.runs import rank_tails
from workbench.ui.state import WorkbenchState

_DONE_KIND = {"completed": "ok", "stopped": "info", "preempted": "info", "failed": "error"}
_LOGGED = ("note", "warning", "checkpoint", "restart", "error", "end")  # events shown as log lines
_STEP_EVERY_S = 0.05  # the progress line's quick path (see RunPanel._show_step)
_BUTTON = dict(flex="0 0 auto", width="auto", min_width="84px")
_RUN_ID_VAR = "WORKBENCH_RUN_ID"  # the local backend gives it to every rank; the checkpoint manifest records it
_RUN_ID_LOCK = threading.Lock()  # one panel at a time sets it for the job it starts (_with_run_id)


class RunPanel:
    """Run/Stop/Resume buttons, progress, the live figures, log, history and report; `.widget` to display."""

    def __init__(self, state: WorkbenchState):
        self.state = state
        self.handle = None
        self._error: str | None = None
        self._stop_requested = False
        self.stop_step: int | None = None  # the newest step the panel had when Stop was pressed
        self._report = ""  # "Report written: ..." under the run's note, until the next run
        self._phase = ""  # start-up progress until the first step
        self._t0 = 0.0
        self._carried = 0  # step events a resumed run took over from the run it continues
        self._carried_events = 0  # all its events
        self._first_own: dict | None = None  # this run's first own step event (ETA)
        self._step_shown_at = 0.0
        self._checkpoints: tuple | None = None  # (uri, committed steps) -> newest complete (step, run id): resume_check
        self._offered: tuple | None = None  # the other run's (step, run id) "Continue that run" was drawn for
        self._asked: tuple | None = None  # the checkpoint a refused fresh Run asked about (`_ask`), while newest
        self._asked_note = ""
        # This run's identity, recorded in each checkpoint it writes: Resume continues only checkpoints
        # with this id (never another run's under the same URI). A fresh Run gets a new one; Resume keeps it.
        self.run_id: str | None = None
        # The running spec, its memory estimate and its step-time prediction, fixed when Run is pressed:
        # measurements are paired with these, never with a later edit of the form.
        self.run_spec = None
        self._run_estimate: dict | None = None
        self.prediction: dict | None = None  # predict_run(run_spec), from the run's thread
        self._run_seq = 0  # which Run press the prediction belongs to
        self._render_lock = threading.Lock()  # the refresher thread and the kernel's thread both render
        self._build_controls()
        self._build_views()
        self.widget = self._build_widget()
        state.observe(self._on_state)
        self.render()

    def _build_controls(self) -> None:
        """The buttons, the progress line and the chart's toggles, wired to their actions."""
        self.run_button = w.Button(description="Run", icon="play", button_style="success",
                                   tooltip="Train this spec on local Ray", layout=w.Layout(**_BUTTON))
        self.stop_button = w.Button(description="Stop", icon="stop", button_style="danger", disabled=True,
                                    tooltip="Stop after the current step", layout=w.Layout(**_BUTTON))
        self.resume_button = w.Button(description="Resume", icon="step-forward", tooltip=(
            "Continue from the newest checkpoint"), layout=w.Layout(display="none", **_BUTTON))
        self.continue_button = w.Button(description="Continue that run", icon="share", layout=w.Layout(
            display="none", **_BUTTON), tooltip="Continue the run whose checkpoint is the newest under the URI")
        self.report_button = w.Button(description="Export report", icon="download", disabled=True,
                                      tooltip="Write this run as one offline HTML file", layout=w.Layout(**_BUTTON))
        self.progress = w.IntProgress(value=0, min=0, max=1, bar_style="info",
                                      layout=w.Layout(flex="1 1 160px", min_width="120px", max_width="320px"))
        self.progress_text = w.HTML("idle")
        self.progress_text.add_class("wb-run-progress")
        self.smooth = w.FloatSlider(value=0.0, min=0.0, max=0.95, step=0.05, description="smoothing",
                                    readout_format=".2f", layout=w.Layout(width="260px"),
                                    tooltip="Exponential moving average of every curve (0: raw)")
        self.log_loss = w.Checkbox(value=False, description="log-scale loss", indent=False,
                                   layout=w.Layout(width="auto"))
        self.overlay = w.Checkbox(value=True, description="earlier runs", indent=False, layout=w.Layout(width="auto"))
        self.x_axis = w.ToggleButtons(options=[("step", "step"), ("wall time", "time"), ("tokens", "tokens")],
                                      value="step", tooltips=["optimizer step", "seconds since the run's first step",
                                                              "tokens trained so far"],
                                      style={"button_width": "92px"})
        self.x_axis.add_class("wb-run-x-axis")
        self.run_button.on_click(lambda _: self.run())
        self.resume_button.on_click(lambda _: self.run(resume=True))
        self.continue_button.on_click(lambda _: self.continue_other())
        self.stop_button.on_click(lambda _: self.stop())
        self.report_button.on_click(lambda _: self.export_report())
        for toggle in (self.smooth, self.log_loss, self.overlay, self.x_axis):
            toggle.observe(lambda _: self.render(), names="value")

    def _build_views(self) -> None:
        """What the state is drawn into: notes, the live charts (zoom kept), tables, logs, comparison."""
        from workbench.ui.compare_panel import ComparePanel

        self.note = w.HTML()
        self.run_box = LiveFigure()  # updated in place: a zoom survives new steps
        self.run_box.add_class("wb-run-chart")
        self.mem_box = FigureBox()  # with the first memory event
        self.host_box = LiveFigure()  # host CPU/memory and GPU utilisation/memory per rank
        self.host_box.add_class("wb-host-chart")
        self.timeline_box = FigureBox()
        self.rank_times = w.HTML()
        self.predicted = w.HTML()  # step time and tokens/s: predicted for the running layout beside measured
        self.predicted.add_class("wb-run-predicted")
        self.log = w.HTML()
        # The tail of each rank's stdout/stderr, a fold per rank: which one is open is the widget's own
        # state, so new output does not close what a person opened (as re-sent <details> would).
        self.rank_output = w.Accordion(children=(), layout=w.Layout(display="none", max_width="100%"))
        self.rank_output.add_class("wb-rank-output")
        self.compare = ComparePanel(on_change=self.render)

    def _build_widget(self) -> w.VBox:
        wrap = dict(flex_flow="row wrap", align_items="center", grid_gap="6px 8px")
        return w.VBox([
            w.HBox([self.run_button, self.stop_button, self.resume_button, self.continue_button, self.progress,
                    self.progress_text],
                   layout=w.Layout(**wrap)),
            self.note, self.predicted, self.run_box,
            w.HBox([self.x_axis, self.smooth, self.log_loss, self.overlay, self.report_button], layout=w.Layout(**wrap)),
            self.compare.widget, self.mem_box, self.rank_times, self.host_box, self.timeline_box, self.log,
            self.rank_output], layout=w.Layout(max_width="100%"))

    # -- actions -------------------------------------------------------------------------
    def run(self, resume: bool = False) -> None:
        """Start the spec on local Ray; errors in the spec are shown inline, never raised."""
        st = self.state
        if not self._startable():
            return
        if resume:
            step, why = self.resume_check()
            if step is None:  # the folder changed since the button was drawn: nothing is started
                self.note.value = note_html(why or "Nothing to resume: no checkpoint of this run.", "error")
                return
            self._launch(st.run_label(resume=True), _continued(st.snapshot(), step), resume=True)
        elif (found := self._newest()) is not None:  # a fresh run would write over them: ask
            self._ask(found)
        else:
            self.run_id = f"notebook-{uuid.uuid4().hex[:12]}"
            self._launch(st.run_label(), [], resume=False)

    def _ask(self, found: tuple[int, str | None]) -> None:
        """Run was pressed with checkpoints under checkpoint.uri: nothing starts; the note says whose
        they are and what a fresh run would do to them, and "Continue that run" is offered."""
        step, owner = found
        uri = self.state.spec.checkpoint.uri
        whose = ("this panel's last run" if owner is not None and owner == self.run_id else
                 f"run {owner}" if owner else "a run from before checkpoints named their run")
        self._asked, self._offered = found, found
        self._asked_note = note_html(
            f"Nothing was started: {uri} holds checkpoints, the newest of step {step} by {whose}. A fresh run "
            f"there would write over them (its own steps, then its retention of the newest "
            f"{self.state.spec.checkpoint.keep}). Continue that run, or give this run a checkpoint URI of its own "
            "under Dispatch. Nothing was loaded or deleted.", "error")
        self.note.value = self._asked_note
        self.continue_button.layout.display = ""

    def continue_other(self) -> None:
        """Continue, on purpose, the run whose checkpoint is the newest under checkpoint.uri (the
        "Continue that run" button, drawn with the note that names it): another run's, whose id this
        panel takes, with its curve when its metrics were kept beside the checkpoints; this panel's own
        (after Run asked, `_ask`) is a Resume. Only the checkpoint the button was drawn for: when the
        folder changed since, nothing is started. Nothing is deleted either way."""
        offered, found = self._offered, self._newest()
        if offered is None or found != offered:
            now = f"the newest is now step {found[0]} of {found[1] or 'an unnamed run'}" if found else \
                "no other run's checkpoint is there now"
            self.note.value = note_html(f"Nothing was started: the checkpoint folder changed since the button was "
                                        f"drawn ({now}). Read the note again and choose.", "error")
            self._offered = None
            self.continue_button.layout.display = "none"
            return
        step, owner = found
        if self.state.spec is not None and step >= self.state.spec.train.steps:
            self.note.value = note_html(f"Nothing was started: that run's checkpoint is at step {step} and this spec "
                                        f"trains {self.state.spec.train.steps} steps. Raise the steps to continue it.",
                                        "error")
            return
        if owner is not None and owner == self.run_id:  # this panel's own last run (Run asked): a resume
            self.run(resume=True)
            return
        if not self._startable():
            return
        uri = self.state.spec.checkpoint.uri
        self.run_id = owner or f"notebook-{uuid.uuid4().hex[:12]}"  # (an unnamed run's next checkpoints: this id)
        carried = _continued(_kept_events(uri, owner), step) if owner else []
        label = f"{self.state.run_label()} (continues {owner or 'an unnamed run'} from step {step})"
        self._launch(label, carried, resume=True)

    def _startable(self) -> bool:
        """The spec can run and is predicted to fit; otherwise the note says why."""
        st = self.state
        if st.spec is None:
            self.note.value = note_html("Fix the layout first: " + (st.error or ""), "error")
            return False
        try:
            from workbench.validate import check_runnable

            check_runnable(st.spec)
        except ConfigError as e:
            self.note.value = note_html(str(e), "error")
            return False
        est = st.estimate
        if est is not None and not est["fits"]:
            self.note.value = note_html(
                f"Predicted not to fit: the largest rank needs {max(r['total'] for r in est['per_rank']) / 2**30:.1f} GiB "
                f"of {est['device_memory'] / 2**30:.1f} GiB. Change the layout (see Memory) before running.", "error")
            return False
        return True

    def _launch(self, label: str, carried: list[dict], resume: bool) -> None:
        """Start the job on a thread as run `self.run_id`, the chart continuing `carried`."""
        from workbench.launch import start

        st = self.state
        self._error, self.handle, self._stop_requested, self._report = None, None, False, ""
        self._offered, self._asked = None, None
        self._t0 = time.monotonic()
        self._phase = ("1/3 starting Ray…" if not _ray_started() else
                       f"2/3 starting {st.spec.world_size} rank(s)…")
        self.note.value = note_html(f"Starting {st.spec.world_size} worker(s) on local Ray…", "info")
        self.progress.max, self.progress.value = st.spec.train.steps, 0
        self._carried = sum(1 for e in carried if e.get("event") == "step")
        self._carried_events = len(carried)
        self.run_spec, self._run_estimate, self.prediction = st.spec, st.estimate, None
        self._run_seq += 1
        st.start_events(label, carry=carried)
        threading.Thread(target=self._start_and_follow, args=(_with_run_id(start, self.run_id), st.spec, resume,
                                                             self._run_seq),
                         name="workbench-ui-run", daemon=True).start()

    def _start_and_follow(self, start, spec, resume: bool, seq: int = 0) -> None:
        prediction = predict_run(spec)  # (the planner: well under a second) before the workers take the CPU
        if seq == self._run_seq:  # still this run's
            self.prediction = prediction
            self.state.touch()
        try:
            self.handle = start(spec, on_event=self.state.add_event, resume=resume)
        except Exception as e:  # noqa: BLE001 - on this thread nothing else would show it
            text = str(e) if isinstance(e, (ConfigError, WorkerError)) else f"{type(e).__name__}: {e}"
            again = (" Press Run to try again: Ray is started afresh." if type(e).__name__ == "RayStartError"
                     else "")
            self._error = f"the run did not start: {text}{again}"
            self.state.finish("failed")
            return
        self._phase = f"2/3 starting {spec.world_size} rank(s) (importing torch)…"
        self.state.touch()
        if self._stop_requested:
            self.handle.cancel()
        try:
            status = self.handle.wait()
            state, message = status.state.value, status.message
        except Exception as e:  # noqa: BLE001 - shown in the panel, never raised into the kernel
            state, message = "failed", f"{type(e).__name__}: {e}"
        if state == "failed":
            self._error = message or "the run failed (see the Ray logs)"
        self.state.finish("failed" if state == "failed" else "completed")
        self._keep_metrics(spec)

    def _keep_metrics(self, spec) -> None:
        """A run whose checkpoint folder is on this machine leaves its events there
        (`metrics-<run id>.jsonl`), so a later session can compare it (Compare runs: the folder)."""
        uri = spec.checkpoint.uri
        if not uri or "://" in uri or self.run_id is None or not Path(uri).expanduser().is_dir():
            return
        from workbench.ui.runs import save_events

        try:
            save_events(self.state.snapshot(), uri, self.run_id)
        except OSError as e:  # the run itself is done: say so, never raise on this thread
            self._report = note_html(f"The run's metrics could not be kept beside its checkpoints: {e}", "error")
            self.state.touch()

    def stop(self) -> None:
        """Ask the workers to stop: every rank stops after the same step, at most one step after the
        newest step this panel had when Stop was pressed (`stop_step`); the run ends "preempted"
        (resumable when it writes checkpoints)."""
        self.stop_button.disabled = True
        self._stop_requested = True  # honoured as soon as the job exists, if it is still starting
        if self.handle is not None:
            self.handle.cancel()  # rank 0 reads it with an acknowledgement within STOP_WITHIN_STEPS steps
        # read after cancel(): no step delivered before the cancel is newer than this one
        steps = [e["step"] for e in self.state.snapshot() if e.get("event") == "step"]
        self.stop_step = steps[-1] if steps else 0
        self.render()

    def export_report(self) -> Path | None:
        """Write the shown run as a self-contained HTML report next to the notebook."""
        from workbench.report.run_report import write_report

        spec, events = self.state.spec, self.state.snapshot()
        if spec is None or not events:
            return None
        path = Path(f"{spec.name}-report.html")
        write_report(events, spec, path)
        self._report = note_html(f"Report written: {path.resolve()}", "ok")
        self.render()
        return path

    # -- state -> widgets ----------------------------------------------------------------
    def _on_state(self, topic: str) -> None:
        if topic == "step":
            self._show_step()
        elif topic == "spec" and not self.state.events:  # only Run's availability depends on the spec
            self.run_button.disabled = self.state.run_state == "running" or self.state.spec is None
        elif topic in ("events", "run", "spec"):
            self.render()

    def render(self) -> None:
        """Draw buttons, progress, note, figures and log from the state and this run's outcome."""
        with self._render_lock:
            self._render()

    def _render(self) -> None:
        st = self.state
        events, running = st.snapshot(), st.run_state == "running"
        steps = [e for e in events if e.get("event") == "step"]
        self.run_button.disabled = running or st.spec is None
        self.stop_button.disabled = not running or self._stop_requested
        self.report_button.disabled = running or not steps
        newest = self._newest()  # (one listing of the store per redraw)
        resumable, foreign = self._verdict(newest)
        cut_short = not running and st.run_state in ("preempted", "stopped", "failed")
        can_resume = cut_short and resumable is not None
        self.resume_button.layout.display = "" if can_resume else "none"
        if self._asked is not None and (running or newest != self._asked):
            self._asked = None  # (the folder or the URI changed since Run asked)
        self._offered = self._asked or (newest if cut_short and foreign else None)
        self.continue_button.layout.display = "" if self._offered else "none"
        self.progress.max = max(self.progress.max, 1)
        self.progress.value = min(steps[-1]["step"], self.progress.max) if steps else 0
        self.progress.bar_style = {"completed": "success", "failed": "danger"}.get(st.run_state, "info")
        own = steps[self._carried:]  # the carried ones ran before this run's start-up
        self._first_own = own[0] if own else None
        self.progress_text.value = html.escape(self._progress_line(steps[-1] if steps else None, self._first_own,
                                                                   running))
        ended = not running and st.run_state != "idle"  # (the idle and running notes keep what they show)
        self.note.value = self._note(events, steps, running, can_resume, foreign) + (self._report if ended else "")
        self._render_charts(events)
        self.rank_times.value = _rank_times_html(figures.latest_rank_times(events))
        self.predicted.value = prediction_html(self.prediction, steps[self._carried:], self.run_spec) \
            if self.run_spec is not None and st.run_state != "idle" else ""
        has_timeline = any(e.get("event") == "timeline" for e in events)
        self.timeline_box.show(figures.measured_timeline_figure(events) if has_timeline else None)
        self.log.value = _log_html(events)
        self._show_rank_output(rank_tails(events))

    def _show_rank_output(self, tails: dict[int, dict[str, str]]) -> None:
        bodies = {rank: _rank_output_html(kinds) for rank, kinds in tails.items()}
        bodies = {rank: body for rank, body in bodies.items() if body}
        titles = tuple(f"rank {rank}: stdout/stderr, last lines" for rank in bodies)
        if tuple(self.rank_output.titles) != titles:
            self.rank_output.children = tuple(w.HTML() for _ in bodies)
            self.rank_output.titles = titles
        for child, body in zip(self.rank_output.children, bodies.values()):
            child.value = body
        self.rank_output.layout.display = "" if bodies else "none"

    def _render_charts(self, events: list[dict]) -> None:
        """The Training chart (with earlier and compared runs), the measured memory and the hosts' chart,
        on the chosen x axis with the smoothing."""
        history = [r for r in self.state.history if self.overlay.value] + self.compare.picked()
        predicted = self.prediction if self.prediction and "error" not in self.prediction else None
        x_axis, smooth = self.x_axis.value, self.smooth.value
        self.run_box.show(figures.run_figure(events, history=history, smooth=smooth, log_loss=self.log_loss.value,
                                             predicted=predicted, x_axis=x_axis))
        measured = figures.latest_measured(events)
        self.mem_box.show(self._memory_figure(measured) if measured else None)
        has_host = any(e.get("event") == "memory" and ("cpu_s" in e or "host" in e or "gpu" in e) for e in events)
        self.host_box.show(figures.host_figure(events, smooth=smooth, x_axis=x_axis) if has_host else None)

    def _progress_line(self, last: dict | None, first: dict | None, running: bool) -> str:
        """The line beside the buttons, from the newest step event and this run's first own one."""
        state = self.state.run_state
        if state == "idle":
            return "idle"
        step = last["step"] if last else 0
        if not running:
            stopped = f" (Stop pressed at step {self.stop_step})" if self._stop_requested else ""
            return f"{state} at step {step} / {self.progress.max}{stopped}"
        elapsed = time.monotonic() - self._t0
        if self._stop_requested:
            return f"stopping: Stop pressed at step {self.stop_step}, at step {step} ({elapsed:.0f} s)"
        if last is None:
            return self._startup_line(elapsed)
        eta = ""
        if first is not None and step > first["step"] and "time" in first:  # this run's own steps only
            per_step = (last["time"] - first["time"]) / (step - first["step"])
            eta = f", ETA {per_step * (self.progress.max - step):.0f} s"
        return f"step {step} / {self.progress.max} · {elapsed:.0f} s elapsed{eta}"

    def _startup_line(self, elapsed: float) -> str:
        """Before the first step: the phase (1/3 Ray, 2/3 the ranks, 3/3 the first step), the time since
        Run and the newest start-up note (a retry of Ray's start, the load), so a slow start is seen moving."""
        events = self.state.snapshot()[self._carried_events:]
        phase = self._phase
        started = sum(1 for e in events if e.get("event") == "worker")
        if started and self.run_spec is not None:
            phase = f"3/3 {started} of {self.run_spec.world_size} rank(s) started, waiting for the first step…"
        notes = [e for e in events if e.get("event") in ("note", "warning") and e.get("message")]
        latest = f" · {str(notes[-1]['message']).split(';')[0]}" if notes else ""
        return f"{phase} {elapsed:.0f} s{latest}"

    def _show_step(self) -> None:
        """The newest step in the progress line at once (the driver's thread, each step event; at
        most every `_STEP_EVERY_S`), not with the next full redraw: a person presses Stop looking
        at it, and the run ends at most one step after the step the panel had then."""
        now = time.monotonic()
        if now - self._step_shown_at < _STEP_EVERY_S or not self._render_lock.acquire(blocking=False):
            return  # (a full redraw in progress shows a step as new)
        try:
            self._step_shown_at = now
            last = self.state.last_step
            if self._first_own is None:
                self._first_own = last
            if last is not None and self.state.run_state == "running":
                self.progress.value = min(last["step"], self.progress.max)
                self.progress_text.value = html.escape(self._progress_line(last, self._first_own, True))
        finally:
            self._render_lock.release()

    def _note(self, events: list[dict], steps: list[dict], running: bool, can_resume: bool,
              foreign: str | None) -> str:
        state = self.state.run_state
        if self._asked is not None:
            return self._asked_note
        if self._error is not None:
            return note_html(f"Run failed: {self._error}", "error")
        if running:
            restarts = [e for e in events if e.get("event") == "restart"]
            if any(e.get("attempt", 0) > 0 for e in restarts):
                failed = sum(1 for e in restarts if e.get("attempt", 0) > 0)
                return note_html(f"Restarted {failed} time(s) after a failure; resumed from the last checkpoint.")
            if restarts:
                return note_html(f"Resumed from the checkpoint of step {restarts[-1].get('from_step', 0)}.")
            return "" if steps else self.note.value
        if state == "idle":
            return self.note.value
        step = steps[-1]["step"] if steps else 0
        extra = ""
        if state in ("preempted", "stopped", "failed") and foreign:
            return note_html(f"Run {state} after {step} step(s). {foreign}", _DONE_KIND.get(state, "info"))
        if state in ("preempted", "stopped"):
            extra = (" Resume continues from its newest checkpoint." if can_resume else
                     " It cannot be resumed: no checkpoint was written (set a checkpoint URI and interval under "
                     "Dispatch to make runs resumable).")
        return note_html(f"Run {state} after {step} step(s).{extra}", _DONE_KIND.get(state, "info"))

    def resumable_step(self) -> int | None:
        """The step Resume continues from: the newest complete checkpoint under the spec's
        checkpoint.uri when this run wrote it (None otherwise: see `resume_check`)."""
        return self.resume_check()[0]

    def resume_check(self) -> tuple[int | None, str | None]:
        """(step, None) when the newest complete checkpoint (every file verified: size and CRC-32, as a
        resume does before any worker starts) under the spec's checkpoint.uri is this run's own (its
        manifest's run id); (None, why) when it is another run's, or one written before runs had an id
        (a resume would load it: the workers take the newest); (None, None) with no URI, no complete
        checkpoint or an unreachable store. Verified once per set of committed steps and newest manifest:
        re-renders after each edit list the store and read one manifest, they do not re-read the
        checkpoint. Nothing is ever deleted here."""
        return self._verdict(self._newest())

    def _verdict(self, found: tuple[int, str | None] | None) -> tuple[int | None, str | None]:
        """`resume_check` of the newest checkpoint's (step, run id)."""
        if found is None:
            return None, None
        step, owner = found
        if owner is not None and owner == self.run_id:
            return step, None
        whose = (f"another run ({owner})" if owner else "a run from before checkpoints named their run")
        return None, (f"Resume is not offered: the newest checkpoint under {self.state.spec.checkpoint.uri} (step "
                      f"{step}) was written by {whose}, not by this run ({self.run_id or 'none yet'}), and a resume "
                      "loads the newest one. Nothing was loaded or deleted. To continue that run on purpose, press "
                      "Continue that run (this panel takes its id), or: workbench run SPEC --set "
                      f"checkpoint.uri={self.state.spec.checkpoint.uri} --resume. To make this run resumable, give it "
                      "a checkpoint URI of its own under Dispatch.")

    def _newest(self) -> tuple[int, str | None] | None:
        """(step, run id) of the newest complete checkpoint under the spec's checkpoint.uri; None with
        no URI, no complete checkpoint or an unreachable store (cached per committed steps, see
        `resume_check`)."""
        spec = self.state.spec
        if spec is None or not spec.checkpoint.uri:
            return None
        from workbench.launch import checkpoint_version, newest_checkpoint_owner

        try:
            key = checkpoint_version(spec.checkpoint.uri)
            if self._checkpoints is None or self._checkpoints[0] != key:
                self._checkpoints = (key, newest_checkpoint_owner(spec.checkpoint.uri))
        except (OSError, ValueError, ImportError):  # unreachable or unknown store: nothing to resume from here
            return None
        return self._checkpoints[1]

    def _memory_figure(self, measured: dict):
        """The run's measured memory beside the estimate of the spec that runs (never the form's later edit)."""
        spec, estimate = self.run_spec, self._run_estimate
        device = _device_bytes(spec.resources.gpu) if spec is not None else None
        fig = figures.memory_figure(estimate, measured, device_memory=device, height=320)
        title = "Memory per rank: measured beside predicted" if estimate else "Memory per rank: measured"
        return fig.update_layout(title_text=title)


def predict_run(spec) -> dict:
    """The planner's step time and tokens/s for exactly this spec's layout (`plan(spec).given`) and
    where they come from (`PlanResult.source`); {"error": why} when it cannot be scored. Never raises:
    a run starts whatever the planner says."""
    try:
        from workbench.planner import plan

        result = plan(spec)
    except ImportError:
        return {"error": "the planner (workbench.planner) is not installed in this build"}
    except ConfigError as e:
        return {"error": str(e).splitlines()[0]}
    except Exception as e:  # noqa: BLE001 - a planner bug must not stop the run; it is shown instead
        return {"error": f"the planner failed: {type(e).__name__}: {e}"}
    source = result.source
    g = result.given
    if g is None:
        return {"error": (result.given_error or "the layout could not be scored").splitlines()[0], "source": source}
    return {"step_time_s": g.step_time_s, "tokens_per_s": g.tokens_per_s, "mfu": g.mfu, "source": source,
            "device": result.device, "layout": dict(g.layout), "micro_batch": g.micro_batch}


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def measured_steps(own: list[dict]) -> tuple[float, float, str] | None:
    """(median step time, median tokens/s, which steps) of a run's own step events; the first is
    left out once there are more (it holds the warm-up)."""
    import statistics

    steady = own[1:] if len(own) > 1 else own
    if not steady:
        return None
    first, last = steady[0]["step"], steady[-1]["step"]
    which = f"step {first}" if first == last else f"median of steps {first}-{last}"
    return (statistics.median(e["step_time_s"] for e in steady),
            statistics.median(e["tokens_per_s"] for e in steady), which)


def prediction_html(prediction: dict | None, own: list[dict], spec) -> str:
    """Step time and tokens/s predicted for the running layout beside the measured ones (this run's own
    steps), with the prediction's source. `spec` is the running spec: its layout is named."""
    lay = spec.layout
    layout = html.escape(figures.layout_label(
        {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "zero": lay.zero, "offload": lay.offload,
         "activation_checkpointing": lay.activation_checkpointing, "pp_schedule": lay.pp_schedule,
         "virtual_stages": lay.virtual_stages, "sequence_parallel": lay.sequence_parallel}, spec.train.micro_batch))
    head = f"<b>Predicted beside measured</b> for this run's layout ({layout} on {html.escape(spec.resources.gpu)})"
    style = "font-size:12px;margin:4px 0"
    if prediction is None:
        return f"<div class='wb-run-predicted-body' style='{style}'>{head}: predicting…</div>"
    if "error" in prediction:
        return (f"<div class='wb-run-predicted-body' style='{style}'>{head}: no prediction: "
                f"{html.escape(prediction['error'])}</div>")
    got = measured_steps(own)
    p_step, p_tok = prediction["step_time_s"], prediction["tokens_per_s"]
    if got is None:
        m_step = m_tok = "waiting for steps"
        r_step = r_tok = which = ""
    else:
        step, tok, which = got
        m_step, m_tok = _duration(step), f"{tok:,.0f}"
        r_step = f"{step / p_step:.2f}x" if p_step else "-"
        r_tok = f"{tok / p_tok:.2f}x" if p_tok else "-"
        which = f"; measured: {which}"
    cell = "style='padding:1px 10px 1px 0;text-align:right;white-space:nowrap'"
    rows = "".join(
        f"<tr><td style='padding-right:10px'>{name}</td><td class='wb-predicted-{key}' {cell}>{pred}</td>"
        f"<td class='wb-measured-{key}' {cell}>{meas}</td><td {cell}>{ratio}</td></tr>"
        for name, key, pred, meas, ratio in (("step time", "step", _duration(p_step), m_step, r_step),
                                             ("tokens/s", "tokens", f"{p_tok:,.0f}", m_tok, r_tok)))
    return (f"<div class='wb-run-predicted-body' style='{style}'>{head}<table style='border-collapse:collapse'>"
            f"<tr style='color:var(--jp-content-font-color2, #666)'><td></td><td {cell}>predicted</td><td {cell}>measured</td>"
            f"<td {cell}>measured / predicted</td></tr>{rows}</table>"
            f"<span class='wb-prediction-source' style='color:var(--jp-content-font-color2, #555)'>predicted from "
            f"{html.escape(prediction['source'])}{html.escape(which)}</span></div>")


def _rank_times_html(times: dict[int, dict]) -> str:
    """Each rank's newest step time, wall and CPU, and how much slower the slowest rank is."""
    if not times:
        return ""

    def ms(seconds) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"

    cells = "".join(f"<span style='margin-right:14px;white-space:nowrap'>rank {r}: {ms(t['wall'])} "
                    f"<span style='color:var(--jp-content-font-color2, #777)'>(CPU {ms(t['cpu'])})</span></span>" for r, t in sorted(times.items()))
    walls = {r: t["wall"] for r, t in times.items()}
    slowest, fastest = max(walls, key=walls.__getitem__), min(walls.values())
    spread = (f"; slowest rank {slowest}: {walls[slowest] / fastest:.2f}x the fastest"
              if len(walls) > 1 and fastest > 0 else "")
    steps = sorted({t["step"] for t in times.values()})
    at = f"step {steps[-1]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    return (f"<div class='wb-rank-times' style='font-size:12px;margin:4px 0'><b>Step time per rank</b> ({at}"
            f"{spread})<div style='display:flex;flex-wrap:wrap'>{cells}</div></div>")


def _log_html(events: list[dict]) -> str:
    lines = []
    for e in events:
        if e.get("event") in _LOGGED:
            rest = {k: v for k, v in e.items() if k != "event"}
            text = rest.pop("message", None) or ", ".join(f"{k}={v}" for k, v in rest.items())
            lines.append(f"[{e['event']}] {text}")
    if not lines:
        return ""
    body = html.escape("\n".join(lines[-200:]))
    count = "1 line" if len(lines) == 1 else f"{len(lines)} lines"
    return (f"<details class='wb-run-log'><summary style='font-size:12px'>run log: {count}</summary>"
            f"<pre style='max-height:180px;overflow:auto;font-size:11px;background:var(--jp-layout-color2, #f7f7f7);"
            f"color:var(--jp-content-font-color1, #222);padding:6px;white-space:pre-wrap'>{body}</pre></details>")


def _rank_output_html(kinds: dict[str, str]) -> str:
    """One rank's stdout and stderr tails, each in a scrolling block ('' when both are empty)."""
    pre = ("max-height:160px;overflow:auto;font-size:11px;background:var(--jp-layout-color2, #f7f7f7);"
           "color:var(--jp-content-font-color1, #222);padding:6px;margin:2px 0;white-space:pre-wrap")
    return "".join(f"<div style='font-size:11px'>{kind}</div><pre style='{pre}'>{html.escape(text)}</pre>"
                   for kind, text in kinds.items() if text)


def _with_run_id(start, run_id: str | None):
    """`start` (workbench.launch.start) that gives the job `run_id` as its WORKBENCH_RUN_ID: the local
    backend reads it when the job is made and hands it to every rank, whose checkpoints record it."""
    def started(spec, **kwargs):
        with _RUN_ID_LOCK, _env(_RUN_ID_VAR, run_id):
            return start(spec, **kwargs)
    return started


@contextlib.contextmanager
def _env(name: str, value: str | None):
    before = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _ray_started() -> bool:
    import sys

    ray = sys.modules.get("ray")
    return bool(ray and ray.is_initialized())


def _continued(events: list[dict], from_step: int | None) -> list[dict]:
    """The events of the shown run up to the checkpoint a resume starts from, so that the resumed
    run's curves continue them; none when the shown run did not reach that step (the checkpoint
    came from elsewhere: its curve starts at the checkpoint)."""
    if from_step is None or not any(e.get("event") == "step" and e["step"] == from_step for e in events):
        return []
    return [e for e in events if e.get("event") in ("step", "eval", "restart") and e.get("step", 0) <= from_step]


def _kept_events(uri: str, run_id: str) -> list[dict]:
    """The events a run kept beside its checkpoints (`_keep_metrics`); none when it kept none or the
    folder is not on this machine."""
    from workbench.ui.runs import metrics_name, read_events

    path = Path(uri).expanduser() / metrics_name(run_id)
    if "://" in uri or not path.is_file():
        return []
    try:
        return read_events(path)
    except ConfigError:
        return []


def _device_bytes(gpu: str) -> int | None:
    from workbench.catalog import DEVICES

    device = DEVICES.get(gpu)
    return device.memory_bytes if device else None
