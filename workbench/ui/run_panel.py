"""Run panel: run the spec on local Ray and watch loss, throughput, step time and memory live.

`workbench.launch.start` runs the job in a background thread and calls `state.add_event` from
there; the state's refresher thread redraws at most every `refresh_s`, so the kernel stays free
for other cells while the job runs.
"""
from __future__ import annotations

import threading

import ipywidgets as w

from workbench.errors import ConfigError, WorkerError
from workbench.ui import figures
from workbench.ui.live import figure_widget, note_html, sync_figure
from workbench.ui.state import WorkbenchState

_DONE_KIND = {"completed": "ok", "stopped": "info", "preempted": "info", "failed": "error"}


class RunPanel:
    """Run/Stop buttons, progress, and the live figures; `.widget` to display."""

    def __init__(self, state: WorkbenchState):
        self.state = state
        self.handle = None
        self._error: str | None = None
        self._stop_requested = False
        self.run_button = w.Button(description="Run", icon="play", button_style="success",
                                   tooltip="Train this spec on local Ray", layout=w.Layout(width="110px"))
        self.stop_button = w.Button(description="Stop", icon="stop", button_style="danger", disabled=True,
                                    layout=w.Layout(width="110px"))
        self.progress = w.IntProgress(value=0, min=0, max=1, bar_style="info", layout=w.Layout(width="320px"))
        self.progress_text = w.Label("idle")
        self.note = w.HTML()
        self.run_fig = figure_widget(figures.run_figure([]))
        self.mem_fig = figure_widget(figures.memory_figure(figures.empty_estimate(), height=320))
        self.timeline_fig = figure_widget(figures.timeline_figure([]))
        self.mem_box = w.Box([])  # gets mem_fig with the first memory event
        self.timeline_box = w.VBox()
        self.run_button.on_click(lambda _: self.run())
        self.stop_button.on_click(lambda _: self.stop())
        self.widget = w.VBox([
            w.HBox([self.run_button, self.stop_button, self.progress, self.progress_text],
                   layout=w.Layout(align_items="center", grid_gap="8px")),
            self.note, self.run_fig, self.mem_box, self.timeline_box])
        state.observe(self._on_state)

    # -- actions -------------------------------------------------------------------------
    def run(self) -> None:
        """Start the spec on local Ray; errors in the spec are shown inline, never raised."""
        st = self.state
        if st.spec is None:
            self.note.value = note_html("Fix the layout first: " + (st.error or ""), "error")
            return
        try:
            from workbench.validate import check_runnable

            check_runnable(st.spec)
            from workbench.launch import start
        except ConfigError as e:
            self.note.value = note_html(str(e), "error")
            return
        except ImportError:
            self.note.value = note_html("Local runs need workbench.launch, which is not installed in this build yet.")
            return
        est = st.estimate
        if est is not None and not est["fits"]:
            self.note.value = note_html(
                f"Predicted not to fit: the largest rank needs {max(r['total'] for r in est['per_rank']) / 2**30:.1f} GiB "
                f"of {est['device_memory'] / 2**30:.1f} GiB. Change the layout (see the Memory tab) before running.",
                "error")
            return
        self._error, self.handle = None, None
        self.progress_text.value = "starting Ray…"
        self.note.value = note_html(f"Starting {st.spec.world_size} worker(s) on local Ray…", "info")
        self.progress.max, self.progress.value = st.spec.train.steps, 0
        st.start_events()
        self.run_button.disabled, self.stop_button.disabled = True, False
        self._stop_requested = False
        # Starting Ray takes seconds: do it off the kernel's thread so the notebook stays usable.
        threading.Thread(target=self._start_and_follow, args=(start, st.spec), name="workbench-ui-run",
                         daemon=True).start()

    def _start_and_follow(self, start, spec) -> None:
        try:
            self.handle = start(spec, on_event=self.state.add_event)
        except Exception as e:  # noqa: BLE001 - on this thread nothing else would show it
            text = str(e) if isinstance(e, (ConfigError, WorkerError)) else f"{type(e).__name__}: {e}"
            self._error = f"the run did not start: {text}"
            self.note.value = note_html(self._error, "error")
            self.state.finish("failed")
            return
        if self._stop_requested:
            self.handle.cancel()
        self._wait(self.handle)

    def stop(self) -> None:
        """Ask the workers to stop after the current step (the run ends "preempted", resumable)."""
        self.stop_button.disabled = True
        self.progress_text.value = "stopping after this step…"
        self._stop_requested = True  # honoured as soon as the job exists, if it is still starting
        if self.handle is not None:
            threading.Thread(target=self.handle.cancel, name="workbench-ui-stop", daemon=True).start()

    def _wait(self, handle) -> None:
        """Follow the job on this thread: it pumps the events into the state until the job ends."""
        try:
            status = handle.wait()
            state, message = status.state.value, status.message
        except Exception as e:  # noqa: BLE001 - shown in the panel, never raised into the kernel
            state, message = "failed", f"{type(e).__name__}: {e}"
        if state == "failed":
            self._error = message or "the run failed (see the Ray logs)"
            self.note.value = note_html(f"Run failed: {self._error}", "error")
        self.state.finish("failed" if state == "failed" else "completed")

    # -- state -> widgets ----------------------------------------------------------------
    def _on_state(self, topic: str) -> None:
        if topic == "events":
            self.redraw(self.state.snapshot())
        elif topic == "run":
            self._show_run_state()
        elif topic == "spec" and self.state.run_state != "running":
            self.run_button.disabled = self.state.spec is None

    def redraw(self, events: list[dict]) -> None:
        """Redraw every live figure from the events so far (one batched message per figure)."""
        sync_figure(self.run_fig, figures.run_figure(events))
        steps = [e for e in events if e.get("event") == "step"]
        if steps:
            self.progress.value = min(steps[-1]["step"], self.progress.max)
            self.progress_text.value = f"step {steps[-1]['step']} / {self.progress.max}"
        measured = figures.latest_measured(events)
        if measured:
            spec = self.state.spec
            device = _device_bytes(spec.resources.gpu) if spec is not None else None
            fig = figures.memory_figure(self.state.estimate, measured, device_memory=device, height=320)
            title = "Memory per rank: measured beside predicted" if self.state.estimate else "Memory per rank: measured"
            fig.update_layout(title_text=title)
            sync_figure(self.mem_fig, fig)
            if not self.mem_box.children:
                self.mem_box.children = [self.mem_fig]  # after the update: a new view draws the final figure
        if any(e.get("event") == "timeline" for e in events):
            sync_figure(self.timeline_fig, figures.timeline_figure(events))
            if not self.timeline_box.children:
                self.timeline_box.children = [self.timeline_fig]
        restarts = [e for e in events if e.get("event") == "restart"]
        if restarts and self.state.run_state == "running":
            self.note.value = note_html(f"Restarted {len(restarts)} time(s); resumed from the last checkpoint.")
        elif steps and self.state.run_state == "running":
            self.note.value = ""

    def _show_run_state(self) -> None:
        state = self.state.run_state
        running = state == "running"
        self.run_button.disabled, self.stop_button.disabled = running or self.state.spec is None, not running
        self.progress.bar_style = {"completed": "success", "failed": "danger"}.get(state, "info")
        if not running and state != "idle":
            step = max((e.get("step", 0) for e in self.state.snapshot() if e.get("event") == "step"), default=0)
            self.progress_text.value = f"{state} at step {step} / {self.progress.max}"
            if self._error is None:
                extra = " Resume it with resume=True / workbench run --resume." if state == "preempted" else ""
                self.note.value = note_html(f"Run {state} after {step} step(s).{extra}", _DONE_KIND.get(state, "info"))


def _device_bytes(gpu: str) -> int | None:
    from workbench.catalog import DEVICES

    device = DEVICES.get(gpu)
    return device.memory_bytes if device else None
