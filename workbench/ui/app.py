"""`Workbench`: the notebook UI. Layout form on the left; memory, run and dispatch on the right.

    from workbench import Workbench
    wb = Workbench("examples/quickstart.yaml")   # or a JobSpec, a dict, or nothing
    wb                                            # display it; wb.spec is the current JobSpec
"""
from __future__ import annotations

from pathlib import Path

import ipywidgets as w

from workbench.errors import ConfigError
from workbench.spec import JobSpec, load_spec
from workbench.ui.dispatch_panel import DispatchPanel
from workbench.ui.import_config import ImportConfig
from workbench.ui.layout_panel import LayoutPanel
from workbench.ui.live import note_html
from workbench.ui.memory_panel import MemoryPanel
from workbench.ui.run_panel import RunPanel
from workbench.ui.state import WorkbenchState

_CSS = """<style>
.wb-root .widget-label { font-size: 13px; }
.wb-root .js-plotly-plot, .wb-root .plot-container, .wb-root .svg-container { max-width: 100%; }
.wb-root .wb-right { min-width: 0; }
.wb-root .wb-section-title { font-size: 15px; font-weight: 600; margin: 10px 0 2px 0;
  border-bottom: 1px solid var(--jp-border-color2, #e0e0e0); padding-bottom: 2px; }
.wb-root .wb-right .widget-textarea, .wb-root .wb-right .widget-html { max-width: 100%; min-width: 0; }
.wb-root .wb-right .widget-textarea textarea { box-sizing: border-box; }
.wb-root .wb-right pre.wb-request { max-width: 100%; box-sizing: border-box; }
/* FileUpload writes "Import config (0)": the count goes, the label stays */
.wb-root .wb-import-config { font-size: 0 !important; }
.wb-root .wb-import-config i { font-size: 13px; margin-right: 4px; }
.wb-root .wb-import-config::after { content: "Import config"; font-size: 13px; }
/* The charts follow JupyterLab's theme: their backgrounds are transparent (figures._base_layout);
   under a dark theme their text, axes and grid take the theme's colors */
body[data-jp-theme-light="false"] .wb-root .main-svg text { fill: var(--jp-ui-font-color1, #ddd) !important; }
body[data-jp-theme-light="false"] .wb-root .main-svg .gridlayer path,
body[data-jp-theme-light="false"] .wb-root .main-svg .zerolinelayer path {
  stroke: var(--jp-border-color2, #555) !important; }
body[data-jp-theme-light="false"] .wb-root .main-svg .legend .bg {
  fill: var(--jp-layout-color1, #111) !important; }
</style>"""


def _title(text: str) -> w.HTML:
    return w.HTML(f"<div class='wb-section-title'>{text}</div>")


class Workbench:
    """The notebook workbench on one spec.

    Args:
        spec: a JobSpec, a spec dict, a YAML path, or None for the quickstart job.
        refresh_s: the most often live plots redraw while a job runs.
    Raises:
        ConfigError: the given spec is invalid (edits made in the UI never raise; they show inline).
    """

    def __init__(self, spec: JobSpec | dict | str | Path | None = None, refresh_s: float = 0.5):
        self.state = WorkbenchState(spec, refresh_s=refresh_s)
        self.layout_panel = LayoutPanel(self.state)
        self.memory_panel = MemoryPanel(self.state)
        self.run_panel = RunPanel(self.state)
        self.dispatch_panel = DispatchPanel(self.state)
        self.name = w.Text(value=self.state.raw.get("name", "job"), layout=w.Layout(width="180px"))
        self.path = w.Text(placeholder="spec.yaml", value=str(spec) if isinstance(spec, (str, Path)) else "",
                           layout=w.Layout(width="260px"))
        self.load_button = w.Button(description="Load", icon="folder-open", layout=w.Layout(width="90px"))
        self.save_button = w.Button(description="Save", icon="save", layout=w.Layout(width="90px"))
        self.message = w.HTML()
        self.import_config = ImportConfig(self.state, self.message, on_loaded=lambda s: setattr(self.name, "value", s.name))
        self.load_button.on_click(lambda _: self._load_clicked())
        self.save_button.on_click(lambda _: self._save_clicked())
        self.name.observe(lambda ch: self.state.update({"name": ch["new"] or "job"}), names="value")
        # One page, no tabs: the memory chart answers each edit of the form at once, and the
        # run's plots sit right under it.
        self.dispatch_toggle = w.ToggleButton(description="Dispatch to a cluster or cloud", icon="cloud",
                                              layout=w.Layout(width="260px"))
        self.dispatch_box = w.VBox([])
        self.dispatch_toggle.observe(lambda ch: self._show_dispatch(ch["new"]), names="value")
        header = w.HBox([w.HTML("<b style='font-size:16px'>workbench</b>", layout=w.Layout(width="110px")),
                         w.Label("name"), self.name, w.Label("YAML"), self.path, self.load_button,
                         self.import_config.widget, self.save_button],
                        layout=w.Layout(align_items="center", grid_gap="6px", flex_flow="row wrap"))
        # The form and the charts side by side; below 330 + 560 px they stack (flex wrap).
        right = w.VBox([_title("Memory"), self.memory_panel.widget, _title("Run"), self.run_panel.widget,
                        _title("Dispatch"), self.dispatch_toggle, self.dispatch_box],
                       layout=w.Layout(flex="1 1 560px", min_width="0", max_width="100%"))
        right.add_class("wb-right")
        body = w.HBox([self.layout_panel.widget, right], layout=w.Layout(width="100%", flex_flow="row wrap"))
        self.widget = w.VBox([w.HTML(_CSS), header, self.message, self.import_config.confirm, body])
        self.widget.add_class("wb-root")

    def _show_dispatch(self, show: bool) -> None:
        self.dispatch_box.children = [self.dispatch_panel.widget] if show else []
        self.dispatch_toggle.icon = "chevron-up" if show else "cloud"

    @property
    def spec(self) -> JobSpec | None:
        """The current valid JobSpec (None while the form shows an error)."""
        return self.state.spec

    def load(self, path: str | Path) -> JobSpec:
        """Replace the spec with a YAML file's. Raises ConfigError if it is invalid."""
        spec = load_spec(path)
        self.state.set_raw(spec.to_dict())
        self.name.value = spec.name
        return spec

    def save(self, path: str | Path) -> Path:
        """Write the current spec as YAML. Raises ConfigError while the form shows an error."""
        if self.state.spec is None:
            raise ConfigError(f"the spec is invalid, nothing saved: {self.state.error}")
        self.state.spec.save(path)
        return Path(path)

    def _load_clicked(self) -> None:
        try:
            spec = self.load(self.path.value.strip())
            self.message.value = note_html(f"Loaded {self.path.value.strip()} ({spec.name}).", "ok")
        except ConfigError as e:
            self.message.value = note_html(str(e), "error")

    def _save_clicked(self) -> None:
        path = self.path.value.strip() or f"{self.state.raw.get('name', 'job')}.yaml"
        try:
            self.path.value = str(self.save(path))
            self.message.value = note_html(f"Saved {path}.", "ok")
        except (ConfigError, OSError) as e:
            self.message.value = note_html(str(e), "error")

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def __repr__(self) -> str:
        return f"Workbench({self.state.spec!r})" if self.state.spec else f"Workbench(invalid: {self.state.error})"
