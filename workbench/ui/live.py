"""Small helpers shared by the panels: figure boxes and inline notes.

A panel rebuilds a figure with a pure builder from the state and `FigureBox.show` draws it, so
builders stay testable and no view is ever patched from an earlier one.
"""
from __future__ import annotations

import html

import ipywidgets as w
import numpy  # noqa: F401  (see below)
import plotly.graph_objects as go
import plotly.io as pio

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
              "ok": ("rgba(84,162,75,0.13)", "#54A24B")}
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
