"""Memory panel: predicted per-rank memory for the current spec, and the planner's best layouts.

Redrawn on every spec change; a planner candidate's "Use" button writes its layout back into
the spec, so the Layout form, this chart and the Run panel all follow.
"""
from __future__ import annotations

import html

import ipywidgets as w

from workbench.ui import figures
from workbench.ui.live import figure_widget, note_html, sync_figure
from workbench.ui.state import WorkbenchState

class MemoryPanel:
    """Stacked per-rank memory bars vs the device line, and a planner table; `.widget` to display."""

    def __init__(self, state: WorkbenchState):
        self.state = state
        self.fig = figure_widget(figures.memory_figure(figures.empty_estimate()))
        self.note = w.HTML()
        self.plan_button = w.Button(description="Find layouts that fit", icon="search", button_style="info",
                                    layout=w.Layout(width="200px"))
        self.plan_button.on_click(lambda _: self._plan())
        self.plan_box = w.VBox()
        # The figure leaves the box while there is no estimate. FigureWidgets are shown by adding
        # them to a box, not by display toggling or tabs, which can leave plotly.js views blank.
        self.fig_box = w.Box([])
        self.schedule_box = w.VBox()  # the simulated pipeline schedule, for pp > 1
        self.widget = w.VBox([self.note, self.fig_box, self.schedule_box, w.HBox([self.plan_button]), self.plan_box])
        state.observe(self._on_state)
        self.refresh()

    def _on_state(self, topic: str) -> None:
        if topic == "spec":
            self.refresh()
        elif topic == "plan":
            self._show_plan()

    def refresh(self) -> None:
        st = self.state
        if st.error:
            self.note.value = note_html("Fix the layout to see its memory: " + st.error, "error")
            self.fig_box.children = []
            return
        if st.estimate is None:
            self.note.value = note_html(st.estimate_note or "No estimate.", "info")
            self.fig_box.children = []
            return
        est = st.estimate
        bad = [r["rank"] for r in est["per_rank"] if r["total"] > est["device_memory"]]
        if bad:
            self.note.value = note_html(
                f"{len(bad)} of {est['world_size']} ranks need more than the device's "
                f"{est['device_memory'] / 2**30:.1f} GiB. Try ZeRO 3, activation checkpointing, a smaller "
                "micro-batch, more tp/pp, or \"Find layouts that fit\".", "error")
        else:
            self.note.value = note_html(st.estimate_note, "info")
        sync_figure(self.fig, figures.memory_figure(est))
        if not self.fig_box.children:
            self.fig_box.children = [self.fig]  # after the update: a new view draws the final figure
        self._show_schedule()

    def _show_schedule(self) -> None:
        """For pp > 1: the schedule's order of work per rank (simulated with backward = 2 x forward)."""
        spec = self.state.spec
        lay = spec.layout
        if lay.pp == 1:
            self.schedule_box.children = []
            return
        try:
            from workbench.timeline import bubble_fraction, simulate, timeline_figure
        except ImportError:
            self.schedule_box.children = []
            return
        micro = spec.train.global_batch // (lay.dp * spec.train.micro_batch)
        events = simulate(lay.pp_schedule, lay.pp, micro, lay.virtual_stages)
        title = (f"{lay.pp_schedule} schedule, pp={lay.pp}, {micro} micro-batches: bubble "
                 f"{bubble_fraction(events):.0%} (simulated, time in forward units)")
        fig = timeline_figure(events, title=title)
        fig.update_layout(height=120 + 36 * lay.pp, template="plotly_white", margin=dict(l=60, r=20, t=48, b=40),
                          xaxis_title="time (units of one forward)")
        if self.schedule_box.children:
            sync_figure(self.schedule_box.children[0], fig)
        else:
            self.schedule_box.children = [figure_widget(fig)]

    def _plan(self) -> None:
        self.plan_button.disabled = True
        self.plan_button.description = "Planning…"
        try:
            self.state.run_plan()
        finally:
            self.plan_button.disabled = False
            self.plan_button.description = "Find layouts that fit"

    def _show_plan(self) -> None:
        plan = self.state.plan or {}
        if "note" in plan:
            self.plan_box.children = [w.HTML(note_html(plan["note"], "info"))]
            return
        rows = plan.get("candidates", [])
        if not rows:
            self.plan_box.children = [w.HTML(note_html("The planner found no layout for these resources.", "info"))]
            return
        header = ["layout", "fits", "peak GiB", "tokens/s", "step s", "MFU", "$/h", "spot $/h", ""]
        cells = [w.HTML(f"<b>{h}</b>") for h in header]
        for c in rows:
            ok = "<span style='color:#54A24B'>yes</span>" if c["fits"] else "<span style='color:#D62728'>no</span>"
            values = [html.escape(figures.layout_label(c["layout"], c.get("micro_batch"))), ok,
                      f"{c['peak_bytes'] / 2**30:.1f}", f"{c['tokens_per_s']:,.0f}", f"{c['step_time_s']:.3g}",
                      f"{c.get('mfu', 0):.0%}", f"{c.get('usd_per_hour', 0):.2f}", f"{c.get('usd_per_hour_spot', 0):.2f}"]
            use = w.Button(description="Use", layout=w.Layout(width="60px", height="26px"))
            use.on_click(lambda _, c=c: self.apply(c))
            cells += [w.HTML(v) for v in values] + [use]
        grid = w.GridBox(cells, layout=w.Layout(
            grid_template_columns="minmax(220px, 2.5fr) repeat(7, minmax(60px, 1fr)) 70px", grid_gap="2px 10px"))
        self.plan_box.children = [w.HTML(given_html(plan)), grid, figure_widget(figures.plan_figure(plan))]

    def apply(self, candidate: dict) -> None:
        """Write a planner candidate's layout (and micro-batch) into the spec."""
        overrides = {f"layout.{k}": v for k, v in candidate["layout"].items()}
        if candidate.get("micro_batch"):
            overrides["train.micro_batch"] = candidate["micro_batch"]
        overrides["resources.gpus_per_node"] = None  # the planner keeps the GPU count; let the layout set it
        self.state.update(overrides)


def given_html(plan: dict) -> str:
    """The spec's own layout scored by the planner (`plan --json`'s "given"), one line above the ranking."""
    g = plan.get("given")
    if g is None:
        why = plan.get("given_error")
        return note_html("Your layout could not be scored: " + why, "error") if why else ""
    fits = "fits" if g["fits"] else "does not fit"
    return (f"<p><b>Your layout</b> {html.escape(figures.layout_label(g['layout'], g.get('micro_batch')))}: {fits}, "
            f"peak {g['peak_bytes'] / 2**30:.1f} GiB, {g['tokens_per_s']:,.0f} tokens/s, step {g['step_time_s']:.3g} s, "
            f"MFU {g['mfu']:.0%}, ${g['usd_per_hour']:.2f}/h (spot ${g['usd_per_hour_spot']:.2f}/h)</p>")
