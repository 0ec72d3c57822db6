"""Memory panel: predicted per-rank memory for the current spec, and the planner's best layouts.

Redrawn on every spec change; a planner candidate's "Use" button writes its layout back into
the spec, so the Layout form, this chart and the Run panel all follow.
"""
from __future__ import annotations

import html

import ipywidgets as w

from workbench.parallelism import Parallelism
from workbench.report import figures
from workbench.ui.live import FigureBox, note_html
from workbench.ui.state import WorkbenchState


class MemoryPanel:
    """Stacked per-rank memory bars vs the device line, and a planner table; `.widget` to display.

    `render` draws every part from the state alone (note, chart, schedule, planner table, button),
    so no sequence of edits can leave a part showing an earlier spec.
    """

    def __init__(self, state: WorkbenchState):
        self.state = state
        self.note = w.HTML()
        self.details = w.HTML()
        self.plan_button = w.Button(description="Find layouts that fit", icon="search", button_style="info",
                                    layout=w.Layout(width="200px", flex="0 0 auto"))
        self.plan_button.on_click(lambda _: self._plan())
        self.plan_box = w.VBox(layout=w.Layout(max_width="100%", overflow="auto"))
        self.plan_fig_box = FigureBox()
        self.fig_box = FigureBox()
        self.fig_box.add_class("wb-memory-chart")
        self.schedule_box = FigureBox()  # the simulated pipeline schedule, pp > 1
        self.widget = w.VBox([self.note, self.fig_box, self.details, self.schedule_box, w.HBox([self.plan_button]),
                              self.plan_box, self.plan_fig_box], layout=w.Layout(max_width="100%"))
        state.observe(self._on_state)
        self.render()

    def _on_state(self, topic: str) -> None:
        if topic in ("spec", "plan"):
            self.render()

    def render(self) -> None:
        st = self.state
        est = st.estimate if st.spec is not None else None
        self.plan_button.disabled = st.spec is None
        self.plan_button.tooltip = "Fix the layout first" if st.spec is None else "Ask the planner for layouts"
        if st.spec is None:
            self.note.value = note_html("No memory chart while the form shows an error (see the form).", "info")
        elif est is None:
            self.note.value = note_html(st.estimate_note or "No estimate.", "info")
        else:
            self.note.value = self._verdict_note(est)
        self.fig_box.show(figures.memory_figure(est) if est is not None else None)
        self.details.value = _details(est) if est is not None else ""
        self.schedule_box.show(self._schedule_figure() if st.spec is not None else None)
        self._show_plan()

    def _verdict_note(self, est: dict) -> str:
        bad = [r["rank"] for r in est["per_rank"] if r["total"] > est["device_memory"]]
        if not bad:
            return note_html(self.state.estimate_note, "info")
        return note_html(
            f"{len(bad)} of {est['world_size']} ranks need more than the device's "
            f"{est['device_memory'] / 2**30:.1f} GiB. Try ZeRO 3, activation checkpointing, a smaller "
            "micro-batch, more tp/pp, or \"Find layouts that fit\".", "error")

    def _schedule_figure(self):
        """For pp > 1: the schedule's order of work per rank (simulated with backward = 2 x forward)."""
        spec = self.state.spec
        lay = spec.layout
        if lay.pp == 1:
            return None
        try:
            from workbench.timeline import bubble_fraction, simulate, timeline_figure
        except ImportError:
            return None
        micro = Parallelism.from_spec(spec).num_micro
        events = simulate(lay.pp_schedule, lay.pp, micro, lay.virtual_stages)
        # two short lines: one long line was cut at 800-1400 px (#34)
        title = (f"{lay.pp_schedule}, pp={lay.pp}, {micro} micro-batches<br>"
                 f"<span style='font-size:12px'>bubble {bubble_fraction(events):.0%} (simulated)</span>")
        fig = timeline_figure(events, title=title)
        fig.update_layout(height=140 + 36 * lay.pp, template=figures.template(), margin=dict(l=60, r=36, t=64, b=40),
                          paper_bgcolor="rgba(0,0,0,0)", plot_bgcolor="rgba(0,0,0,0)", modebar=dict(orientation="v"),
                          xaxis_title="time (units of one forward)")
        return fig

    def _plan(self) -> None:
        self.plan_button.disabled = True
        self.plan_button.description = "Planning…"
        try:
            self.state.run_plan()
        finally:
            self.plan_button.description = "Find layouts that fit"
            self.plan_button.disabled = self.state.spec is None

    def _show_plan(self) -> None:
        plan = self.state.plan
        if plan is None:  # none asked for, or the job changed since
            self.plan_box.children = []
            self.plan_fig_box.show(None)
            return
        rows = plan.get("candidates", [])
        if "note" in plan or not rows:
            text = plan.get("note") or "The planner found no layout for these resources."
            self.plan_box.children = [w.HTML(note_html(text, "info"))]
            self.plan_fig_box.show(None)
            return
        cpu = figures.is_cpu(plan.get("device"))
        no_mfu = html.escape(figures.NO_CPU_MFU, quote=True)
        header = ["layout", "fits", "peak GiB", "tokens/s", "step s", "MFU", "$/h", "spot $/h", ""]
        cells = [w.HTML(f"<b title='{no_mfu}'>MFU</b>" if h == "MFU" and cpu else f"<b>{h}</b>")
                 for h in header]  # headers wrap at their spaces
        mfu_cell = f"<span class='wb-no-mfu' title='{no_mfu}'>-</span>"
        for c in rows:
            ok = "<span style='color:#54A24B'>yes</span>" if c["fits"] else "<span style='color:#D62728'>no</span>"
            refused = c.get("not_runnable") if c.get("runnable") is False else None
            label = html.escape(figures.layout_label(c["layout"], c.get("micro_batch")))
            if refused:
                label += f"<br><span style='color:var(--jp-content-font-color2, #888);font-size:11px'>plan only: {html.escape(refused)}</span>"
            values = [label, ok, gib_text(c["peak_bytes"]), f"{c['tokens_per_s']:,.0f}",
                      f"{c['step_time_s']:.3g}", mfu_cell if cpu else figures.mfu_text(c.get("mfu"), None),
                      f"{c.get('usd_per_hour', 0):.2f}",
                      f"{c.get('usd_per_hour_spot', 0):.2f}"]
            use = w.Button(description="Use", layout=w.Layout(width="52px", height="26px"),
                           tooltip=f"Cannot run here: {refused}" if refused else "Write this layout into the form")
            use.on_click(lambda _, c=c: self.apply(c))
            cells += [w.HTML(values[0])] + [w.HTML(f"<span style='white-space:nowrap'>{v}</span>") for v in values[1:]]
            cells.append(use)  # 52 px and its 2 px margins: a 56 px column
        # Numbers take their own width (they never wrap), the layout label the rest (it wraps at its
        # spaces): the table fits a 560 px column without a cell running into the next.
        grid = w.GridBox(cells, layout=w.Layout(
            grid_template_columns="minmax(84px, 1fr) repeat(7, auto) 56px", grid_gap="2px 8px", max_width="100%"))
        grid.add_class("wb-plan-table")
        self.plan_box.children = [w.HTML(source_html(plan)), w.HTML(given_html(plan)), grid]
        self.plan_fig_box.show(figures.plan_figure(plan))

    @staticmethod
    def _overrides(candidate: dict) -> dict:
        """Every setting of the candidate's layout; the ones it does not name (virtual stages of a
        schedule without them) go back to their defaults, so nothing of the form's earlier layout stays."""
        overrides = {"layout.virtual_stages": None, "layout.sequence_parallel": None}
        overrides.update({f"layout.{k}": v for k, v in candidate["layout"].items()})
        if candidate.get("micro_batch"):
            overrides["train.micro_batch"] = candidate["micro_batch"]
        return overrides

    def apply(self, candidate: dict) -> None:
        """Write a planner candidate's layout (and micro-batch) into the spec."""
        overrides = self._overrides(candidate)
        overrides["resources.gpus_per_node"] = None  # the planner keeps the GPU count; let the layout set it
        self.state.update(overrides)


def source_html(plan: dict) -> str:
    """The line above the planner's numbers that says where they come from (`PlanResult.source`)."""
    source = plan["source"]
    text = (f"<div class='wb-plan-source' style='font-size:12px;color:var(--jp-content-font-color2, #444);margin:4px 0'>Predicted step time, "
            f"tokens/s, MFU and cost: <b>{html.escape(source)}</b>")
    if figures.is_cpu(plan.get("device")):
        text += (f". <span title='{html.escape(figures.NO_CPU_MFU, quote=True)}'>No MFU on CPU devices.</span>")
    return text + "</div>"


def given_html(plan: dict) -> str:
    """The spec's own layout scored by the planner (`plan --json`'s "given"), one line above the ranking."""
    g = plan.get("given")
    if g is None:
        why = plan.get("given_error")
        return note_html("Your layout could not be scored: " + why, "error") if why else ""
    fits = "fits" if g["fits"] else "does not fit"
    mfu = "" if figures.is_cpu(plan.get("device")) else f"MFU {figures.mfu_text(g.get('mfu'), None)}, "
    return (f"<p><b>Your layout</b> {html.escape(figures.layout_label(g['layout'], g.get('micro_batch')))}: {fits}, "
            f"peak {gib_text(g['peak_bytes'])} GiB, {g['tokens_per_s']:,.0f} tokens/s, step {g['step_time_s']:.3g} s, "
            f"{mfu}${g['usd_per_hour']:.2f}/h (spot ${g['usd_per_hour_spot']:.2f}/h)</p>")


def gib_text(nbytes: float) -> str:
    """GiB with the precision a row needs: 0.1 GiB steps for big rows, three significant digits for
    small ones (a CPU row of 12 MiB read "0.0", #34)."""
    gib = nbytes / 2**30
    return f"{gib:.1f}" if gib >= 10 else f"{gib:.3g}" if gib >= 0.001 else f"{gib:.2g}"


def _details(est: dict) -> str:
    """What the bars alone do not say: the estimate's notes and bytes offloaded to the host."""
    lines = [html.escape(n) for n in est.get("notes", [])]
    offloaded = max((r.get("offloaded_bytes", 0) for r in est["per_rank"]), default=0)
    if offloaded:
        lines.insert(0, f"<b>{offloaded / 2**30:.2f} GiB per rank offloaded to "
                        f"{html.escape(est.get('offloaded_to', 'host memory'))}</b> (not in the bars)")
    if not lines:
        return ""
    return "<div style='font-size:12px;color:var(--jp-content-font-color2, #555);line-height:1.45'>" + "<br>".join(lines) + "</div>"
