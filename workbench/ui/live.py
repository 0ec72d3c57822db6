"""Small helpers shared by the panels: figure boxes and inline notes.

A panel rebuilds a figure with a pure builder from the state and `FigureBox.show` draws it whole, so
builders stay testable and no view is ever patched from an earlier one; the live run charts use
`LiveFigure`, which draws each new figure again in the same plotly.js chart so that a zoom survives
updates.
"""
from __future__ import annotations

import functools
import html
import json
from pathlib import Path

import anywidget
import ipywidgets as w
import numpy  # noqa: F401  (see below)
import plotly
import plotly.graph_objects as go
import plotly.io as pio
import traitlets

# numpy is imported here, on the kernel's thread: plotly reads figures through
# sys.modules["numpy"], and a run's thread importing it first (Ray does) leaves it half
# initialised for a moment ("partially initialized module 'numpy' has no attribute 'ndarray'").


class FigureBox(w.Output):
    """Shows one plotly figure, drawn whole from each new `go.Figure` by JupyterLab's plotly
    renderer (the jupyterlab-plotly extension that ships with plotly).

    Never patched from what it showed: a FigureWidget patched in place kept stale parts (the red
    "does not fit" shading under a "fits" title), broke in plotly.js when its traces changed
    ("Cannot read properties of undefined") and drew blank or 700 px wide inside a Box. The
    renderer fits its column and follows resizes. Safe to call from a background thread.
    """

    def __init__(self, **kwargs):
        super().__init__(layout=w.Layout(width="100%", max_width="100%"), **kwargs)
        self.figure: go.Figure | None = None
        self._shown: str | None = None

    def show(self, fig: go.Figure | None) -> None:
        """Draw `fig` (None: nothing); an identical figure sends nothing."""
        key = fig.to_json() if fig is not None else None
        if key == self._shown:
            return
        self.figure, self._shown = fig, key
        data = {} if fig is None else pio.renderers["plotly_mimetype"].to_mimebundle(fig)
        self.outputs = ({"output_type": "display_data", "data": data, "metadata": {}},) if data else ()


def note_html(text: str | None, kind: str = "info") -> str:
    """A boxed message for inline errors and notes (ConfigError text is shown verbatim, never a traceback)."""
    if not text:
        return ""
    # Translucent tints over the page and the theme's own text color: readable in JupyterLab's light and
    # dark themes alike (an opaque pastel under the dark theme's light text read at 1.1:1, #34).
    colors = {"error": ("rgba(214,39,40,0.13)", "#D62728"), "info": ("rgba(76,120,168,0.13)", "#4C78A8"),
              "ok": ("rgba(84,162,75,0.13)", "#54A24B"), "warning": ("rgba(242,142,43,0.15)", "#F28E2B")}
    bg, border = colors[kind]
    body = html.escape(text).replace("\n", "<br>")
    return (f"<div class='wb-note wb-note-{kind}' style='background:{bg};color:var(--jp-content-font-color1, inherit);border-left:4px solid {border};"
            f"padding:6px 10px;margin:4px 0;font-size:13px;line-height:1.4;white-space:normal'>{body}</div>")


def labeled(widget: w.Widget, label: str, width: str = "110px") -> w.HBox:
    """A widget with a fixed-width label on its left, so forms line up."""
    return w.HBox([w.Label(label, layout=w.Layout(width=width)), widget])


def section(title: str, *children: w.Widget) -> w.VBox:
    return w.VBox([w.HTML(f"<b style='font-size:13px'>{html.escape(title)}</b>"), *children],
                  layout=w.Layout(margin="0 0 8px 0"))


class _Figures(w.Widget):
    """Where a LiveFigure's figures travel: a plain ipywidgets model (no view), which the page
    updates in order whatever befalls the chart's own anywidget model (see LiveFigure)."""

    figure = traitlets.Unicode().tag(sync=True)  # the figure's JSON, with its uirevisions


class LiveFigure(anywidget.AnyWidget):
    """A live chart that keeps what a person did to it (a zoom, a pan, a trace hidden from the
    legend) while new figures come: each `show(fig)` sends the whole figure, and the page draws it
    again in the same plotly.js chart with `Plotly.react` (live_figure.js). The figure carries
    uirevisions: one for the chart, and one per axis that is the axis's title, so a zoom goes when
    its axis comes to measure something else (the x axis switched from step to tokens) and stays
    otherwise. The chart follows its box's width (a ResizeObserver), also a change made while it was hidden.

    Not plotly's `FigureWidget`: anywidget gives a model 2 s to load its module, and a model whose
    module loads later never hears from the kernel again. FigureWidget's module is all of plotly.js
    (5 MB); under load its chart stayed blank (no title) and fixed at its first width for good (CI,
    browser test; reproduced by shortening anywidget's deadline). So nothing this chart needs comes
    to its own model after it is made: plotly.js (the copy the plotly package ships, evaluated once
    per page) is in its first state, and the figures go through a plain ipywidgets model,
    `_Figures`, which the page hears whatever happened to the anywidget one (browser test: every
    anywidget model's deadline passed before its module loads). `show(None)` hides the chart until the next figure. Safe to call
    from a background thread.
    """

    _esm = Path(__file__).with_name("live_figure.js")
    _plotly_js = traitlets.Unicode().tag(sync=True)
    _plotly_version = traitlets.Unicode().tag(sync=True)
    _figures = anywidget.WidgetTrait().tag(sync=True)  # the page reads it with host.getModel

    def __init__(self, **kwargs):
        super().__init__(_plotly_js=_plotly_js(), _plotly_version=plotly.__version__, _figures=_Figures(),
                         layout=w.Layout(width="100%", max_width="100%", display="none"), **kwargs)
        self.figure: go.Figure | None = None  # the newest figure shown (what the builders made)
        self._shown: str | None = None

    def show(self, fig: go.Figure | None) -> None:
        """Draw `fig` (None: hide the chart), keeping what a person did to the chart."""
        key = fig.to_json() if fig is not None else None
        if key == self._shown:
            return  # the same figure again (the refresher redraws each second): nothing to send
        self.figure, self._shown = fig, key
        if key is None:
            self.layout.display = "none"
            return
        self._figures.figure = with_uirevisions(key)
        self.layout.display = None


def with_uirevisions(figure_json: str) -> str:
    """The figure with a uirevision for the chart and one per axis: the axis's title."""
    figure = json.loads(figure_json)
    layout = figure.setdefault("layout", {})
    layout["uirevision"] = "live"
    for name, axis in layout.items():
        if name.startswith(("xaxis", "yaxis")) and isinstance(axis, dict):
            axis["uirevision"] = str(_axis_title(axis))
    return json.dumps(figure)


@functools.cache
def _plotly_js() -> str:
    """plotly.js as the installed plotly package ships it (the same as its renderer's)."""
    return (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_text(encoding="utf-8")


def _axis_title(axis: dict) -> str | None:
    title = axis.get("title")
    return title.get("text") if isinstance(title, dict) else title
