"""The layout panel draws the spec's learning-rate schedule and follows edits of it."""
import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from workbench.schedule import lr_curve  # noqa: E402
from workbench.ui.layout_panel import LayoutPanel  # noqa: E402
from workbench.ui.state import WorkbenchState  # noqa: E402


def test_layout_panel_redraws_the_schedule_when_the_spec_changes():
    state = WorkbenchState({"train": {"steps": 30}})
    panel = LayoutPanel(state)
    assert list(panel.lr_box.figure.data[0].y) == [3e-4] * 30
    state.update({"train.schedule": "wsd", "train.warmup_steps": 3, "train.min_lr": 1e-5})
    assert list(panel.lr_box.figure.data[0].y) == pytest.approx(lr_curve(state.spec.train))
    assert "wsd" in panel.lr_box.figure.layout.title.text
