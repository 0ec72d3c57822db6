"""Compare panel: runs of other sessions, read from metrics JSONL files and checkpoint folders,
picked to overlay the Training chart (`runs.load_runs`); `.widget` to display, `picked()` to draw."""
from __future__ import annotations

from collections.abc import Callable

import ipywidgets as w

from workbench.ui.live import note_html
from workbench.ui.runs import load_runs


class ComparePanel:
    """A path or glob, **Add**, and the loaded runs to tick; `on_change()` is called when the picked
    runs change (the run panel redraws its chart)."""

    def __init__(self, on_change: Callable[[], None]):
        self.runs: dict[str, dict] = {}  # by path, in the order they were added
        self._on_change = on_change
        self.path = w.Text(placeholder="runs/*.jsonl or a checkpoint folder", continuous_update=False,
                           layout=w.Layout(flex="1 1 220px", min_width="160px"),
                           tooltip="A metrics file (workbench run --metrics-out FILE), a checkpoint folder, or a glob")
        self.path.add_class("wb-compare-path")
        self.add_button = w.Button(description="Add runs", icon="plus", layout=w.Layout(width="auto", flex="0 0 auto"))
        self.pick = w.SelectMultiple(options=[], rows=4, layout=w.Layout(width="100%", display="none"))
        self.pick.add_class("wb-compare-pick")
        self.note = w.HTML()
        self.add_button.on_click(lambda _: self.add(self.path.value))
        self.pick.observe(lambda _: self._on_change(), names="value")
        self.widget = w.VBox([
            w.HTML("<b style='font-size:13px'>Compare runs</b> <span style='font-size:12px;color:var("
                   "--jp-content-font-color2, #666)'>(other sessions: overlaid dotted, legend with each layout)</span>"),
            w.HBox([self.path, self.add_button], layout=w.Layout(flex_flow="row wrap", grid_gap="6px")),
            self.pick, self.note], layout=w.Layout(max_width="100%", margin="6px 0"))

    def add(self, pattern: str) -> list[dict]:
        """Load every run `pattern` names and tick them; problems are listed under the box. Returns the runs read."""
        pattern = (pattern or "").strip()
        if not pattern:
            self.note.value = note_html("Give a metrics JSONL file, a checkpoint folder or a glob of them.", "error")
            return []
        runs, problems = load_runs(pattern)
        for run in runs:
            self.runs[run["path"]] = run
        lines = [f"{run['label']}: {run['note']}" for run in runs if run["note"]] + problems
        self.note.value = note_html("\n".join(lines), "error" if problems else "info") if lines else ""
        self.pick.options = [(self._option(r), p) for p, r in self.runs.items()]
        self.pick.layout.display = "" if self.runs else "none"
        self.pick.value = tuple(dict.fromkeys([*self.pick.value, *(r["path"] for r in runs)]))
        return runs

    @staticmethod
    def _option(run: dict) -> str:
        steps = [e["step"] for e in run["events"] if e.get("event") == "step"]
        span = f"steps {steps[0]}-{steps[-1]}" if steps else f"checkpoints {run['checkpoints'] or 'none'}"
        return f"{run['label']} · {span}"

    def picked(self) -> list[dict]:
        """The ticked runs as the run chart's other runs (`figures.run_figure(history=...)`)."""
        return [{"label": self.runs[p]["label"], "events": self.runs[p]["events"], "group": "compared runs"}
                for p in self.pick.value if p in self.runs]
