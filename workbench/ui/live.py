"""Small helpers shared by the panels: figure boxes and inline notes.

A panel rebuilds a figure with a pure builder from the state and `FigureBox.show` draws it whole, so
builders stay testable and no view is ever patched from an earlier one; the live run charts use
`LiveFigure`, which copies each new figure into one FigureWidget so that a zoom survives updates.
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


class LiveFigure(w.VBox):
    """One plotly ``FigureWidget`` kept across redraws, so that a zoom or pan survives live updates.

    `show(fig)` copies a freshly built figure into the widget: while its traces are the same ones (the
    same count, types and names: each new step of a run) their data and the layout are updated in
    place in one `batch_update`, and every axis range the person set in the browser (plotly.js sends
    it back as a relayout) is kept unless the axis now measures something else (its title changed);
    otherwise the widget's traces are replaced (deleted, then the new ones added) and its layout set
    with those ranges, so no trace or shape of an earlier figure is left behind. `show(None)` hides
    the widget until the next figure. The widget itself is never swapped for another: each new
    `FigureWidget` sends the page plotly's whole 5 MB bundle, and swapped in quick succession (a new
    run's first redraws, or the hosts' chart dropped and drawn again at each run's start) the page was
    left without the chart for seconds, or for good (browser test, #34). Safe to call from a
    background thread.
    """

    def __init__(self, **kwargs):
        super().__init__(layout=w.Layout(width="100%", max_width="100%"), **kwargs)
        self.figure: go.Figure | None = None  # the newest figure shown (what the builders made)
        self.widget: go.FigureWidget | None = None
        self._pushed: dict = {}  # the axis ranges and titles of the newest figure shown, as we set them
        self._shown: str | None = None

    def show(self, fig: go.Figure | None) -> None:
        """Draw `fig` (None: hide the chart), keeping the ranges a person zoomed to."""
        key = fig.to_json() if fig is not None else None
        if key == self._shown:
            return  # the same figure again (the refresher redraws each second): nothing to send
        before = self.figure
        self.figure, self._shown = fig, key
        if fig is None:
            self.layout.display = "none"
            self._pushed = {}
            return
        hidden = self.layout.display == "none" and self.widget is not None
        self.layout.display = None
        layout = fig.layout.to_plotly_json()
        kept = self.zoomed(layout)
        for axis, rng in kept.items():
            layout[axis] = {**layout.get(axis, {}), "range": list(rng), "autorange": False}
        # What the earlier figure set and this one does not is cleared; never what the browser set on its
        # own: plotly.js answers each window resize with a relayout {autosize: true} that the widget records,
        # and clearing that (autosize: null) makes plotly.js pin the chart's width as it is then, so the
        # chart stayed that wide in a narrower column (browser test, #34).
        gone = {k: None for k in (before.layout.to_plotly_json() if before is not None else {})
                if k not in layout and k != "template"}
        if self.widget is not None and _same_traces(self.widget.data, fig.data):
            layout.setdefault("shapes", [])
            layout.setdefault("annotations", [])
            with self.widget.batch_update():
                for trace, new in zip(self.widget.data, fig.data):
                    trace.update({k: v for k, v in new.to_plotly_json().items() if k != "type"}, overwrite=True)
                self.widget.update_layout({**gone, **{k: v for k, v in layout.items() if k != "template"}},
                                          overwrite=True)
        elif self.widget is not None:  # other traces: the same widget, its traces replaced
            self.widget.data = ()
            self.widget.add_traces(list(fig.data))
            self.widget.update_layout({**gone, **{k: v for k, v in layout.items() if k != "template"}},
                                      overwrite=True)
        else:
            widget = go.FigureWidget(data=fig.data, layout=layout)
            widget._config = {**widget._config, "responsive": True}  # follow the column's width (plotly.js)
            widget.observe(self._fit_once_drawn, names="_js2py_traceDeltas")
            self.widget = widget
            self.children = (widget,)
        if hidden:
            # plotly.js does not resize a hidden chart: measure the box again, as a window resize does
            # (autosize is already true on this side, so setting it would send nothing)
            self.widget._send_relayout_msg({"autosize": True})
        self._pushed = _axes(fig.layout.to_plotly_json())

    def _fit_once_drawn(self, change) -> None:
        """Have plotly.js measure the chart's box again once the chart is on the page.

        A new widget's view draws its chart before JupyterLab attaches it, into a box with no width
        yet: plotly.js falls back to its default 700 px and keeps that width (wider than a 638 px
        column at a 1400 px window) until the window is next resized (browser test, #34). The view
        reports its traces once drawn (its layout report goes to a trait plotly's Python side does
        not observe, `_js2py_widget_layoutDelta`), so by the time that report reaches the kernel the
        chart is on the page; the answer is what a window resize sends, a relayout {autosize: true},
        sent once.
        """
        widget = change["owner"]
        if change["new"]:
            widget.unobserve(self._fit_once_drawn, names="_js2py_traceDeltas")
            widget.layout.autosize = True

    def zoomed(self, new_layout: dict) -> dict[str, tuple]:
        """{axis: range} of the shown widget's axes whose range differs from the one the newest figure
        set (a person zoomed or panned) and that measure the same thing in `new_layout`."""
        if self.widget is None:
            return {}
        now = _axes(self.widget.layout.to_plotly_json())
        out = {}
        for axis, (rng, title) in now.items():
            before = self._pushed.get(axis, (None, title))
            if rng is not None and rng != before[0] and _axis_title(new_layout.get(axis, {})) == before[1]:
                out[axis] = rng
        return out


def _axes(layout: dict) -> dict[str, tuple]:
    """{axis name: (range as a tuple or None, its title)} of a layout's x and y axes."""
    return {k: (tuple(v["range"]) if v.get("range") is not None and v.get("autorange") is not True else None,
                _axis_title(v))
            for k, v in layout.items() if (k.startswith("xaxis") or k.startswith("yaxis")) and isinstance(v, dict)}


def _axis_title(axis: dict) -> str | None:
    title = axis.get("title")
    return title.get("text") if isinstance(title, dict) else title


def _same_traces(old, new) -> bool:
    return len(old) == len(new) and all(
        (a.type, a.name, getattr(a, "xaxis", None), getattr(a, "yaxis", None)) ==
        (b.type, b.name, getattr(b, "xaxis", None), getattr(b, "yaxis", None)) for a, b in zip(old, new))
