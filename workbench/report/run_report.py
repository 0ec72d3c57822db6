"""A run as one self-contained HTML file: summary, spec, loss (and held-out loss)/throughput, memory,
learning rate, timeline.

plotly.js is inlined once, so the file opens offline and can be mailed or attached to a ticket.
`workbench run SPEC --report run.html` calls `write_report` after the run.
"""
from __future__ import annotations

import html
import statistics
from datetime import datetime, timezone
from pathlib import Path

from workbench.errors import ConfigError
from workbench.report import figures

_CSS = """body{font-family:'DejaVu Sans',Arial,sans-serif;margin:24px auto;max-width:1200px;color:#222}
h1{font-size:22px;margin-bottom:4px} h2{font-size:16px;margin-top:28px;border-bottom:1px solid #ddd}
table.summary td{padding:2px 14px 2px 0} .muted{color:#666;font-size:13px}
pre{background:#f7f7f7;padding:10px;font-size:12px;overflow:auto}"""


def summarize(events: list[dict]) -> dict:
    """Headline numbers of a run: status, steps, final loss, median tokens/s and step time.

    The median skips step 1 when there are more steps, since it includes warm-up.
    """
    steps = [e for e in events if e.get("event") == "step"]
    end = next((e for e in reversed(events) if e.get("event") == "end"), None)
    steady = steps[1:] if len(steps) > 1 else steps
    return {
        "status": end["status"] if end else ("running" if steps else "no steps"),
        "steps": steps[-1]["step"] if steps else 0,
        "first_loss": steps[0]["loss"] if steps else None,
        "final_loss": steps[-1]["loss"] if steps else None,
        "tokens_per_s": statistics.median(e["tokens_per_s"] for e in steady) if steady else None,
        "step_time_s": statistics.median(e["step_time_s"] for e in steady) if steady else None,
        "checkpoints": sum(1 for e in events if e.get("event") == "checkpoint"),
        "restarts": sum(1 for e in events if e.get("event") == "restart"),
        "val_loss": next((e["loss"] for e in reversed(events) if e.get("event") == "eval"), None),
    }


def write_report(events: list[dict], spec, path: str | Path) -> Path:
    """Write a self-contained offline HTML report of a run.

    Args:
        events: the run's metrics events (the contract in docs/architecture.md), e.g. ``RunResult.events``.
        spec: the JobSpec (or dict / YAML path) that ran.
        path: where to write the HTML file.
    Returns:
        The path written.
    Raises:
        ConfigError: `spec` is invalid.
    """
    from workbench.spec import load_spec

    spec = load_spec(spec)
    summary = summarize(events)
    estimate = _estimate(spec)
    measured = figures.latest_measured(events)
    sections = [("Training", figures.run_figure(events))]
    if estimate is not None or measured:
        from workbench.catalog import DEVICES

        device = DEVICES[spec.resources.gpu].memory_bytes
        title = "measured beside predicted" if estimate and measured else ("predicted" if estimate else "measured")
        fig = figures.memory_figure(estimate, measured or None, device_memory=device)
        fig.update_layout(title_text=f"Memory per rank ({title})")
        sections.append(("Memory per rank", fig))
    if spec.train.schedule != "constant" or spec.train.warmup_steps:  # a flat line says nothing
        sections.append(("Learning rate", figures.lr_figure(spec.train, events, height=260)))
    if any(e.get("event") == "timeline" for e in events):
        sections.append(("Pipeline timeline", figures.measured_timeline_figure(events)))
    parts = [_header(spec, summary)]
    for i, (title, fig) in enumerate(sections):
        # plotly.js goes into the first figure only; the others reuse it.
        body = fig.to_html(full_html=False, include_plotlyjs=(i == 0), config={"displaylogo": False})
        parts.append(f"<h2>{html.escape(title)}</h2>{body}")
    parts.append(f"<h2>Spec</h2><pre>{html.escape(spec.to_yaml())}</pre>")
    doc = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>workbench report: {html.escape(spec.name)}"
           f"</title><style>{_CSS}</style></head><body>{''.join(parts)}</body></html>")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc, encoding="utf-8")
    return path


def _estimate(spec) -> dict | None:
    try:
        from workbench.memory import estimate_memory
    except ImportError:
        return None
    try:
        return estimate_memory(spec).to_dict()
    except ConfigError:  # e.g. a factory model that planning may not run (workbench/factory.py)
        return None


def _header(spec, s: dict) -> str:
    def num(v, fmt):
        return "–" if v is None else format(v, fmt)

    lay = spec.layout
    rows = [
        ("status", s["status"]), ("steps", f"{s['steps']} of {spec.train.steps}"),
        ("loss", f"{num(s['first_loss'], '.4f')} → {num(s['final_loss'], '.4f')}"),
        ("held-out loss", f"{num(s['val_loss'], '.4f')} (last eval)"),
        ("throughput", f"{num(s['tokens_per_s'], ',.0f')} tokens/s (median)"),
        ("step time", f"{num(s['step_time_s'], '.3f')} s (median)"),
        ("layout", f"{lay.world_size} ranks: dp {lay.dp} × tp {lay.tp} × pp {lay.pp}, ZeRO {lay.zero}, "
                   f"{spec.precision.dtype}, on {spec.resources.nodes} × {spec.resources.gpus_per_node} "
                   f"{spec.resources.gpu}"),
        ("checkpoints / restarts", f"{s['checkpoints']} / {s['restarts']}"),
    ]
    table = "".join(f"<tr><td class='muted'>{k}</td><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"<h1>workbench run: {html.escape(spec.name)}</h1><div class='muted'>report written {when}</div>"
            f"<table class='summary'>{table}</table>")
