"""Small helpers shared by the panels: live FigureWidgets and inline notes.

A panel rebuilds a figure with a pure builder and `sync_figure` copies it into the widget in
one batched message, so builders stay testable and the browser sees one update per refresh.
"""
from __future__ import annotations

import html
import json

import ipywidgets as w
import plotly.graph_objects as go


def figure_widget(fig: go.Figure) -> go.FigureWidget:
    return go.FigureWidget(fig)


def show_figure(box: w.Box, fig: go.Figure | None) -> None:
    """Make `box` show `fig` (None: nothing), drawn from `fig` alone, never from what it showed.

    Only a figure that differs from the shown one in trace data alone (a live run growing) is
    patched in place; any other change gets a new FigureWidget and the old one is closed. Patching
    layouts left stale parts behind (the red "does not fit" shading under a "fits" title) and
    replacing traces of a shown widget broke plotly.js ("Cannot read properties of undefined").
    """
    old = box.children[0] if box.children else None
    if fig is None:
        box.children = []
    elif isinstance(old, go.FigureWidget) and getattr(old, "_wb_frame", None) == _frame(fig):
        sync_figure(old, fig)
        return
    else:
        new = figure_widget(fig)
        new._wb_frame, new._wb_last = _frame(fig), fig.to_json()
        box.children = [new]
    if old is not None:
        old.close()


def _frame(fig: go.Figure) -> str:
    """Everything of a figure but its traces' data and its title text (a live run's step count)."""
    layout = fig.layout.to_plotly_json()
    layout.get("title", {}).pop("text", None)
    return json.dumps(layout, sort_keys=True, default=str) + repr([(t.type, t.name) for t in fig.data])


def sync_figure(widget: go.FigureWidget, fig: go.Figure) -> None:
    """Make `widget` show `fig`: values in one batch_update; traces re-created only if their kinds changed.
    (`show_figure` is the safe way to follow a changing figure; this patches a shown widget.)

    An unchanged figure sends nothing: an update that reaches plotly.js while it is still drawing
    the widget's first view leaves the plot blank, and most spec edits do not change a chart.
    """
    key = fig.to_json()
    if getattr(widget, "_wb_last", None) == key:
        return
    widget._wb_last = key
    same = len(widget.data) == len(fig.data) and all(a.type == b.type for a, b in zip(widget.data, fig.data))
    if not same:
        widget.data = ()
        widget.add_traces(list(fig.data))
        widget.layout = fig.layout
        return
    with widget.batch_update():
        for old, new in zip(widget.data, fig.data):
            old.update(new.to_plotly_json(), overwrite=True)
        widget.layout.update(fig.layout.to_plotly_json(), overwrite=True)


def note_html(text: str | None, kind: str = "info") -> str:
    """A boxed message for inline errors and notes (ConfigError text is shown verbatim, never a traceback)."""
    if not text:
        return ""
    colors = {"error": ("#fdecea", "#D62728"), "info": ("#eef4fb", "#4C78A8"), "ok": ("#edf7ed", "#54A24B")}
    bg, border = colors[kind]
    body = html.escape(text).replace("\n", "<br>")
    return (f"<div class='wb-note wb-note-{kind}' style='background:{bg};border-left:4px solid {border};"
            f"padding:6px 10px;margin:4px 0;font-size:13px;line-height:1.4;white-space:normal'>{body}</div>")


def fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def labeled(widget: w.Widget, label: str, width: str = "110px") -> w.HBox:
    """A widget with a fixed-width label on its left, so forms line up."""
    return w.HBox([w.Label(label, layout=w.Layout(width=width)), widget])


def section(title: str, *children: w.Widget) -> w.VBox:
    return w.VBox([w.HTML(f"<b style='font-size:13px'>{html.escape(title)}</b>"), *children],
                  layout=w.Layout(margin="0 0 8px 0"))
