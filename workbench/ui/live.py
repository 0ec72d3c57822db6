"""Small helpers shared by the panels: figure boxes and inline notes.

A panel rebuilds a figure with a pure builder from the state and `FigureBox.show` draws it whole, so
builders stay testable and no view is ever patched from an earlier one; the live run charts use
`LiveFigure`, which copies each new figure into one FigureWidget so that a zoom survives updates.
"""
from __future__ import annotations

import html
import threading

import anywidget
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


# The browser half of `LiveFigure`.
# Width: a FigureWidget's view draws its chart when it renders, and it renders before the page has
# placed it (plotly.js then takes its default 700 px, whatever the column) and plotly.js follows only
# window resizes after that. This watches the box of the LiveFigure it sits in (ResizeObserver: called
# once it is laid out and on every change of its size, a chart put in it included, not after a delay)
# and resizes each plotly chart there to the box, through the handler plotly.js itself installs for
# `responsive: true` (which does nothing for a hidden chart).
# A dead chart: anywidget gives a widget's script 2 s to load and initialise (plotly's is 5 MB; under
# load it took longer) and then drops every message to that widget for good, so its view draws the
# state the widget was opened with: no data and an empty layout (a chart without title or template,
# whatever the kernel sends later; #34). Every figure the kernel draws has a template, so a chart
# drawn without one is reported to the kernel ({stale: true}), which draws the figure in a new widget.
_FIT_ESM = """
function fit(box) {
  for (const gd of box.querySelectorAll(".js-plotly-plot")) {
    if (typeof gd._responsiveChartHandler === "function") gd._responsiveChartHandler();
  }
}
export default {
  render({ model, el }) {
    let box = null;
    const reported = new WeakSet();
    function check() {  // a chart drawn from a widget that never got the kernel's figure
      for (const gd of box.querySelectorAll(".js-plotly-plot")) {
        if (gd.layout && gd._fullLayout && !gd.layout.template && !reported.has(gd)) {
          reported.add(gd);
          model.send({ stale: true });
        }
      }
    }
    const added = new MutationObserver(() => check());
    // The box, not each chart: a chart's own box may change while it is resized, and watching it could
    // resize it again and again.
    const sizes = new ResizeObserver(() => {
      if (!box) {
        box = el.closest(".wb-live-figure");
        if (!box) return;
        sizes.observe(box);
        added.observe(box, { childList: true, subtree: true });
      }
      check();
      fit(box);
    });
    el.style.height = "1px";
    sizes.observe(el);
    return () => { sizes.disconnect(); added.disconnect(); };
  },
};
"""


class _FitWidth(anywidget.AnyWidget):
    """Sized 1 px high and drawn nowhere: fits the plotly charts of its LiveFigure to their box and
    reports a chart drawn from a dead widget (`_FIT_ESM`)."""

    _esm = _FIT_ESM


class LiveFigure(w.VBox):
    """One plotly ``FigureWidget`` kept across redraws, so that a zoom or pan survives live updates.

    `show(fig)` copies a freshly built figure into the widget: while its traces are the same ones (the
    same count, types and names: each new step of a run) their data and the layout are updated in
    place in one `batch_update`, and every axis range the person set in the browser (plotly.js sends
    it back as a relayout) is kept unless the axis now measures something else (its title changed);
    otherwise the widget's traces are replaced (deleted, then the new ones added) and its layout set
    with those ranges, so no trace or shape of an earlier figure is left behind. The widget is made
    with the first figure and closed when nothing is shown (None): a widget taken off the page and
    shown again lost its traces' list in the page's model ("Error setting state" on every update,
    browser test). It is never swapped for another but then and when the page reports it dead
    (below). Safe to call from a background thread.

    A chart whose widget never got the kernel's messages (anywidget gave up on its script under load:
    the chart drew empty, #34) is reported by the page and drawn again in a new widget, at most
    `RENEW_AT_MOST` times. The chart fills its box from its first draw and follows
    it (`_FitWidth`).
    """

    RENEW_AT_MOST = 5

    def __init__(self, **kwargs):
        super().__init__(layout=w.Layout(width="100%", max_width="100%"), **kwargs)
        self.add_class("wb-live-figure")
        self.fit = _FitWidth(layout=w.Layout(width="100%", height="1px"))
        self.fit.on_msg(self._on_page_msg)
        self.children = (self.fit,)
        self.renewed = 0  # widgets made again because the page reported theirs dead
        self._lock = threading.RLock()  # show (the refresher's thread) and a renewal (the kernel's)
        self.figure: go.Figure | None = None  # the newest figure shown (what the builders made)
        self._drawn: go.Figure | None = None  # the newest figure drawn into the widget
        self.widget: go.FigureWidget | None = None  # made with the first figure
        self._pushed: dict = {}  # the axis ranges and titles of the newest figure shown, as we set them
        self._shown: str | None = None

    def show(self, fig: go.Figure | None) -> None:
        """Draw `fig` (None: nothing), keeping the ranges a person zoomed to."""
        with self._lock:
            self._show(fig)

    def _on_page_msg(self, _widget, content, _buffers) -> None:
        """The page drew a chart from a widget that never got the kernel's figure: draw it in a new one."""
        if not (isinstance(content, dict) and content.get("stale")):
            return
        with self._lock:
            if self.figure is None or self.renewed >= self.RENEW_AT_MOST:
                return
            self.renewed += 1
            dead, fig = self.widget, self.figure
            self.widget, self._shown = None, None
            self._show(fig)
            if dead is not None:
                dead.close()

    def _show(self, fig: go.Figure | None) -> None:
        key = fig.to_json() if fig is not None else None
        if key == self._shown and (fig is None or self.widget is not None):
            return  # the same figure again (the refresher redraws each second): nothing to send
        before = self._drawn
        self.figure, self._shown = fig, key
        if fig is None:  # the chart goes from the page, with its widget
            self.children = (self.fit,)
            if self.widget is not None:
                self.widget.close()
            self.widget, self._drawn, self._pushed = None, None, {}
            return
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
            self.widget = _figure_widget(data=fig.data, layout=layout)
        self._drawn = fig
        self._pushed = _axes(fig.layout.to_plotly_json())
        if self.children != (self.fit, self.widget):
            self.children = (self.fit, self.widget)

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


def _figure_widget(**figure) -> go.FigureWidget:
    widget = go.FigureWidget(**figure)
    widget._config = {**widget._config, "responsive": True}  # follow the column's width (plotly.js)
    return widget


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
