"""The notebook UI: `Workbench(spec)` displays the layout form, memory, run and dispatch panels.

Imports ipywidgets and plotly, so `import workbench` never imports this package (see
`workbench.__getattr__`); chart builders for reports live in `workbench.ui.figures`.
"""
from workbench.ui.app import Workbench

__all__ = ["Workbench"]
