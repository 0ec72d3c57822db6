"""workbench: describe a training job once, know what it costs, run it locally or on the clouds.

`import workbench` stays light: Ray, plotly, ipywidgets and cloud SDKs load only when used.
"""
from workbench.errors import ConfigError, WorkerError
from workbench.spec import JobSpec, load_spec

__all__ = ["ConfigError", "WorkerError", "JobSpec", "load_spec", "build_model", "estimate_memory", "run",
           "dispatch", "Workbench"]
__version__ = "0.1.0"


def __getattr__(name):
    # Lazy public API: each import pulls its heavy dependencies only when first used.
    if name == "build_model":
        from workbench.parallel.materialize import build_model

        return build_model
    if name == "estimate_memory":
        from workbench.memory import estimate_memory

        return estimate_memory
    if name == "run":
        from workbench.launch import run

        return run
    if name == "dispatch":
        from backends import dispatch

        return dispatch
    if name == "Workbench":
        from workbench.ui import Workbench

        return Workbench
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")
