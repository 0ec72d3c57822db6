"""The notebook UI: `Workbench(spec)` displays the layout form, memory, run and dispatch panels.

`Workbench` loads ipywidgets on first use. The charts and the HTML report it shows live below it,
in `workbench.report` (plotly only), which `workbench run --report` uses without any widget.
"""
__all__ = ["Workbench"]


def __getattr__(name):
    if name == "Workbench":
        from workbench.ui.app import Workbench

        return Workbench
    raise AttributeError(f"module 'workbench.ui' has no attribute {name!r}")
