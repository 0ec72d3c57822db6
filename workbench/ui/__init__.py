"""The notebook UI: `Workbench(spec)` displays the layout form, memory, run and dispatch panels.

`Workbench` loads ipywidgets on first use, so `workbench.ui.report` and `workbench.ui.figures`
(plotly only) work without the widget stack, e.g. for `workbench run --report`.
"""
__all__ = ["Workbench"]


def __getattr__(name):
    if name == "Workbench":
        from workbench.ui.app import Workbench

        return Workbench
    raise AttributeError(f"module 'workbench.ui' has no attribute {name!r}")
