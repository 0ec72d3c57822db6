"""Pure chart builders (`figures`) and the self-contained HTML run report (`run_report`).

Torch-free and widget-free: metrics events and memory estimates in, plotly figures and HTML out
(plotly imported by the modules that draw). The driver (`workbench run --report`) and the
notebook UI both use it, so it sits below them (docs/architecture.md, the layer table).
"""
