"""Pure chart builders: memory estimates and metrics events in, plotly ``go.Figure`` out.

No widgets here, so every chart is tested without Jupyter and reused by the HTML report. The
widgets draw each fresh figure whole (``workbench.ui.live.FigureBox``).
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import plotly.graph_objects as go
from plotly.subplots import make_subplots

GiB = 2**30
# One color per memory component, the same in every panel and in the report.
COMPONENTS = ("params", "grads", "master", "optimizer", "activations", "buffers")
COLORS = {
    "params": "#4C78A8", "grads": "#F58518", "master": "#54A24B", "optimizer": "#B279A2",
    "activations": "#72B7B2", "buffers": "#9D755D",
    "loss": "#4C78A8", "tokens_per_s": "#54A24B", "step_time_s": "#F58518", "val_loss": "#E45756", "lr": "#B279A2",
    "device": "#222222", "overflow": "#D62728", "F": "#4C78A8", "B": "#F58518", "W": "#54A24B",
}
_PAST = ("#9e9e9e", "#bcbd22", "#17becf", "#e377c2")  # earlier runs' loss, beneath the current one
_RANK_COLORS = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6", "#9D755D")
_FONT = dict(family="DejaVu Sans, Arial, sans-serif", size=12)
# Above this many ranks, identical (pp, tp) positions are drawn once with a count.
MAX_BARS = 32
NO_CPU_MFU = ("No MFU for CPU devices: MFU is the share of a GPU's tensor-core peak a run reaches, "
              "and a CPU has no meaningful peak to divide by.")


def is_cpu(device: str | None) -> bool:
    """True for the CPU "device" (resources.gpu == "cpu"), which has no MFU."""
    return str(device or "").lower() == "cpu"


def mfu_text(mfu: float | None, device: str | None) -> str:
    """MFU as a percentage, or "-" where there is none (CPU devices, no number)."""
    return "-" if is_cpu(device) or mfu is None else f"{mfu:.0%}"


@lru_cache(maxsize=1)
def template() -> go.layout.Template:
    """plotly's "plotly_white" as these figures use it: its layout, and its defaults for the only trace
    types they draw (bar, scatter). Set by name, the whole template (24 trace types) was validated
    again for each figure: 15-20 ms of the kernel's time per figure, twice the JSON sent."""
    import plotly.io as pio

    white = pio.templates["plotly_white"]
    return go.layout.Template(layout=white.layout, data={"bar": white.data.bar, "scatter": white.data.scatter})


def _base_layout(fig: go.Figure, title: str, height: int) -> go.Figure:
    # The title on top of the box, the panels' titles under it, and the legend at the foot, across the
    # figure: plotly.js makes room for its rows under the x axes' titles, so the panels give up the
    # height a long legend takes and the figure keeps its own. In the band above the panels, a legend
    # wrapped to more rows in a narrow column lay over the title and the panels' titles (#34).
    # Transparent backgrounds: the page's own (JupyterLab's light or dark theme; app.py's CSS sets the
    # text and grid colors of the dark one). The mode bar stands upright on the right, over no title.
    fig.update_layout(title=dict(text=title, x=0.01, y=0.99, yref="container", yanchor="top", font=dict(size=14)),
                      height=height, font=_FONT, template=template(), margin=dict(l=60, r=36, t=56, b=40),
                      paper_bgcolor="rgba(0,0,0,0)", plot_bgcolor="rgba(0,0,0,0)", modebar=dict(orientation="v"),
                      legend=dict(orientation="h", yref="container", y=0, yanchor="bottom", x=0, xanchor="left"))
    return fig


def _rank_groups(per_rank: list[dict]) -> list[tuple[str, dict, list[int]]]:
    """(label, breakdown, ranks) per bar: one per rank, or per (pp, tp) position for big worlds."""
    if len(per_rank) <= MAX_BARS:
        return [(f"rank {r['rank']}", r, [r["rank"]]) for r in per_rank]
    groups: dict[tuple, list[dict]] = {}
    for r in per_rank:
        c = r.get("coords", {})
        groups.setdefault((c.get("pp", 0), c.get("tp", 0)), []).append(r)
    out = []
    for (pp, tp), rows in sorted(groups.items()):
        worst = max(rows, key=lambda r: r["total"])
        out.append((f"pp{pp} tp{tp} ×{len(rows)}", worst, [r["rank"] for r in rows]))
    return out


def memory_figure(estimate: dict | None, measured: dict[int, dict] | None = None,
                  device_memory: int | None = None, height: int = 360) -> go.Figure:
    """Predicted memory per rank as stacked bars against the device's memory.

    Args:
        estimate: ``estimate_memory(spec).to_dict()`` (the contract in docs/architecture.md; sizes in bytes), or
            None to draw the measured memory alone.
        measured: optional ``{rank: measured}`` from the run's memory events; drawn as a second
            stacked bar beside each rank's prediction, with its measured peak as a marker.
        device_memory: the device's bytes when there is no estimate (the estimate carries its own).
        height: figure height in pixels.
    Returns:
        A go.Figure in GiB; ranks predicted not to fit are shaded red and marked in their label.
    """
    if estimate is None:
        estimate = _measured_as_estimate(measured or {}, device_memory)
        kinds = ["measured"]
    else:
        kinds = ["predicted", "measured"] if measured else ["predicted"]
    groups = _rank_groups(estimate["per_rank"])
    top_bytes = max([g[1]["total"] for g in groups] + [m.get("peak", 0) for m in (measured or {}).values()])
    # GiB as everywhere, except MiB for small (CPU) runs where GiB would read 0.00.
    unit, scale = ("GiB", GiB) if top_bytes >= GiB / 2 else ("MiB", 2**20)
    device = estimate["device_memory"] / scale
    fits = [g[1]["total"] <= estimate["device_memory"] for g in groups] if "predicted" in kinds else [True] * len(groups)
    labels = [lab if ok else f"{lab} ✗" for (lab, _, _), ok in zip(groups, fits)]
    x = [[lab for lab in labels for _ in kinds], kinds * len(labels)] if len(kinds) > 1 else labels
    fig = go.Figure()
    for comp in COMPONENTS:
        columns = {"predicted": [g[1][comp] for g in groups],
                   "measured": [(measured or {}).get(g[2][0], {}).get(comp) for g in groups]}
        y = [None if v is None else v / scale for i in range(len(groups)) for v in (columns[k][i] for k in kinds)]
        fig.add_trace(go.Bar(x=x, y=y, name=comp, marker_color=COLORS[comp], legendgroup=comp,
                             hovertemplate=f"{comp}: %{{y:.3g}} {unit}<extra></extra>"))
    if measured:
        peaks = [measured.get(g[2][0], {}).get("peak") for g in groups]
        fig.add_trace(go.Scatter(
            x=[labels, ["measured"] * len(labels)] if len(kinds) > 1 else labels,
            y=[None if p is None else p / scale for p in peaks], mode="markers", name="measured peak",
            marker=dict(symbol="line-ew-open", size=28, color=COLORS["device"], line=dict(width=3)),
            hovertemplate=f"measured peak: %{{y:.3g}} {unit}<extra></extra>"))
    for i, ok in enumerate(fits):
        if not ok:
            fig.add_vrect(x0=i * len(kinds) - 0.5, x1=(i + 1) * len(kinds) - 0.5, fillcolor=COLORS["overflow"],
                          opacity=0.08, line_width=0, layer="below")
    worst = max(g[1]["total"] for g in groups) / scale
    _memory_axis(fig, estimate["device_memory"], device, top_bytes / scale, unit)
    verdict = _verdict(estimate, groups, fits, kinds, f"{worst:.3g} {unit}")
    return _base_layout(fig, f"Memory per rank ({verdict})", height)


def _memory_axis(fig: go.Figure, device_bytes: int, device: float, top: float, unit: str) -> None:
    """The memory chart's y axis in `unit`, with the device's memory as a dashed line, or zoomed to the
    bars when they are tiny next to it (a CPU run; the title still names the device)."""
    zoomed = device > 0 and top <= 0.05 * device
    if device > 0 and not zoomed:
        fig.add_hline(y=device, line=dict(color=COLORS["device"], dash="dash", width=1.5),
                      annotation_text=f"device memory {device_bytes / GiB:.1f} GiB",
                      annotation_position="top left")
    fig.update_layout(barmode="stack", yaxis_title=unit, bargap=0.25)
    if zoomed:
        fig.update_layout(yaxis_range=[0, top * 1.15])
    elif device > 0:
        fig.update_layout(yaxis_range=[0, max(device, top) * 1.12])


def _verdict(estimate: dict, groups: list, fits: list[bool], kinds: list[str], peak: str) -> str:
    if "predicted" not in kinds:
        return "measured"
    device = f"{estimate['device_memory'] / GiB:.1f} GiB"
    n_bad = sum(len(g[2]) for g, ok in zip(groups, fits) if not ok)
    if n_bad:
        return f"does not fit: {n_bad} of {estimate['world_size']} ranks over {device}, peak {peak}"
    return f"fits: peak {peak} of {device}"


def _measured_as_estimate(measured: dict[int, dict], device_memory: int | None) -> dict:
    """Shape measured breakdowns like an estimate so one chart draws both."""
    rows = []
    for rank in sorted(measured) or [0]:
        m = measured.get(rank, {})
        row = {c: m.get(c, 0) for c in COMPONENTS}
        rows.append({"rank": rank, "coords": m.get("coords", {}), **row, "total": m.get("peak", sum(row.values()))})
    return {"world_size": len(rows), "device_memory": device_memory or 0, "fits": True, "per_rank": rows}


def latest_measured(events: list[dict]) -> dict[int, dict]:
    """The newest ``measured`` breakdown per rank from a run's memory events."""
    out: dict[int, dict] = {}
    for e in events:
        if e.get("event") == "memory":
            out[int(e["rank"])] = {**e["measured"], "coords": e.get("coords", {})}
    return out


def latest_rank_times(events: list[dict]) -> dict[int, dict]:
    """The newest step time per rank (a memory event's `step_time_s` and `cpu_s`): {rank: {step, wall, cpu}}."""
    out: dict[int, dict] = {}
    for e in events:
        if e.get("event") == "memory" and "step_time_s" in e:
            out[int(e["rank"])] = {"step": e["step"], "wall": e["step_time_s"], "cpu": e.get("cpu_s")}
    return out


def smoothed(values: Sequence[float | None], weight: float) -> list[float | None]:
    """Exponential moving average (TensorBoard's smoothing): weight 0 keeps the values; a None (no
    value at that point) stays None and does not reset the average."""
    out: list[float | None] = []
    avg = None
    for v in values:
        if v is not None:
            avg = v if avg is None else weight * avg + (1 - weight) * v
        out.append(None if v is None else avg)
    return out


X_AXES = {"step": "step", "time": "wall time (s)", "tokens": "tokens"}  # run_figure's x_axis: its title
_X_HOVER = {"step": "step %{x}", "time": "%{x:.1f} s", "tokens": "%{x:,.0f} tokens"}


def step_x(steps: list[dict], x_axis: str = "step") -> list[float]:
    """The x of each step event on the chosen axis.

    Args:
        steps: a run's "step" events, in order.
        x_axis: "step" (the optimizer step), "time" (wall seconds since the run's first step began:
            the events' "time" when they all carry it, else the summed step times) or "tokens" (tokens
            trained so far: each step's tokens_per_s x step_time_s, summed; a run that starts after
            step 1, a resume, counts its earlier steps at its first step's tokens).
    Returns:
        One x per step event.
    Raises:
        ValueError: an unknown x_axis.
    """
    if x_axis == "step":
        return [e["step"] for e in steps]
    if x_axis == "tokens":
        out: list[float] = []
        for e in steps:
            tokens = round(e.get("tokens_per_s", 0.0) * e.get("step_time_s", 0.0))
            out.append((out[-1] if out else tokens * (e["step"] - 1)) + tokens)
        return out
    if x_axis == "time":
        if steps and all("time" in e for e in steps):
            t0 = steps[0]["time"] - steps[0].get("step_time_s", 0.0)
            return [e["time"] - t0 for e in steps]
        out, total = [], 0.0
        for e in steps:
            total += e.get("step_time_s", 0.0)
            out.append(total)
        return out
    raise ValueError(f"x_axis is {x_axis!r}; use one of {', '.join(X_AXES)}")


def _x_of(steps: list[dict], xs: list[float], x_axis: str):
    """step -> x for events other than steps (eval, restart, memory): the step event's x, or, for a
    step without one, the step scaled by the first step's x per step."""
    at = {e["step"]: x for e, x in zip(steps, xs)}
    per_step = xs[0] / steps[0]["step"] if steps and steps[0]["step"] else 1.0

    def x_of(step: int) -> float:
        return step if x_axis == "step" else at.get(step, step * per_step)
    return x_of


def run_figure(events: list[dict], height: int = 320, *, history: list[dict] = (), smooth: float = 0.0,
               log_loss: bool = False, predicted: dict | None = None, x_axis: str = "step") -> go.Figure:
    """Loss, throughput (tokens/s) and step time (s) against the step, the wall time or the tokens.

    Args:
        events: metrics events (the contract in docs/architecture.md); only "step", "eval", "restart" and "checkpoint" are read.
        height: figure height in pixels.
        history: other runs, ``{"label": str, "events": [...]}`` (earlier runs of the session, or runs
            loaded from files with ``"group": "compared runs"``), drawn thin and dotted beneath on all
            three panels, one legend entry each.
        smooth: exponential-moving-average weight for every curve (0: raw).
        log_loss: draw the loss on a log axis.
        predicted: the prediction for the running layout (`run_panel.predict_run`): its tokens/s
            and step time are drawn as dashed "predicted" lines on those panels, the source in
            their hover text.
        x_axis: "step", "time" or "tokens" (`step_x`), the same for every run drawn.
    Returns:
        A go.Figure with three side-by-side panels; three traces (one per panel, the first ones),
        empty before the first step, then the held-out loss (dashed, on the loss panel) once there
        are "eval" events, then three traces per other run (loss, tokens/s, step time), then the
        two "predicted" lines.
    """
    steps = [e for e in events if e.get("event") == "step"]
    xs = step_x(steps, x_axis)
    x_of = _x_of(steps, xs, x_axis)
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.07,
                        subplot_titles=("loss", "tokens/s", "step time (s)"))
    _add_run_curves(fig, steps, xs, smooth, x_axis)
    evals = [e for e in events if e.get("event") == "eval"]
    if evals:  # held-out loss beside the training loss, on the same panel
        fig.add_trace(go.Scatter(x=[x_of(e["step"]) for e in evals], y=smoothed([e["loss"] for e in evals], smooth),
                                 mode="lines+markers", name="val_loss",
                                 line=dict(color=COLORS["val_loss"], width=2, dash="dash"),
                                 marker=dict(size=7, symbol="diamond"), showlegend=False,
                                 customdata=[e["perplexity"] for e in evals],
                                 hovertemplate=_X_HOVER[x_axis] + "<br>val loss: %{y:.4g}<br>perplexity: "
                                               "%{customdata:.4g}<extra></extra>"), row=1, col=1)
    _add_history(fig, history, smooth, x_axis)
    if predicted and predicted.get("step_time_s"):
        _add_predicted(fig, predicted, [1, max(xs[-1] if xs else 1, 2)] if x_axis == "step" else
                       [0, xs[-1] if xs else 1])
    if log_loss:
        fig.update_yaxes(type="log", row=1, col=1)
    for e in events:
        if e.get("event") == "restart":  # the step it restarted from (the contract's "from_step")
            fig.add_vline(x=x_of(e.get("from_step", e.get("step", 0))), line=dict(color=COLORS["overflow"], dash="dot"))
    if not steps and not history:
        fig.update_xaxes(range=[0, 10])
        fig.update_yaxes(showticklabels=False)
    if not steps:
        fig.add_annotation(text="no steps yet: press Run", xref="paper", yref="paper", x=0.5, y=0.45,
                           showarrow=False, font=dict(size=14, color="#888"))
    return _base_layout(fig, _run_title(steps, evals), height)


def _add_run_curves(fig: go.Figure, steps: list[dict], xs: list[float], smooth: float, x_axis: str) -> None:
    """The run's own loss, tokens/s and step time, one panel each (the figure's first three traces)."""
    for col, key in enumerate(("loss", "tokens_per_s", "step_time_s"), start=1):
        y = smoothed([e.get(key) for e in steps], smooth)
        fig.add_trace(go.Scatter(x=xs, y=y, mode="lines+markers", name=key,
                                 line=dict(color=COLORS[key], width=2), marker=dict(size=4), showlegend=False,
                                 hovertemplate=f"{_X_HOVER[x_axis]}<br>{key}: %{{y:.4g}}<extra></extra>"),
                      row=1, col=col)
        fig.update_xaxes(title_text=X_AXES[x_axis], row=1, col=col, rangemode="tozero")
    fig.update_yaxes(rangemode="tozero", row=1, col=2)
    fig.update_yaxes(rangemode="tozero", row=1, col=3)


def _add_history(fig: go.Figure, history: list[dict], smooth: float, x_axis: str) -> None:
    """Other runs beneath the current one: thin dotted curves on every panel, one legend entry per run
    (its label carries its layout for runs loaded from files); the hover names its group (earlier or
    compared runs). No legend group titles: in a legend across the figure they stack its entries one
    per row."""
    for i, run in enumerate(history):
        past = [e for e in run["events"] if e.get("event") == "step"]
        xs, group = step_x(past, x_axis), run.get("group", "earlier runs")
        color = run.get("color") or _PAST[i % len(_PAST)]
        for col, key in enumerate(("loss", "tokens_per_s", "step_time_s"), start=1):
            fig.add_trace(go.Scatter(
                x=xs, y=smoothed([e.get(key) for e in past], smooth), mode="lines", name=run["label"],
                showlegend=col == 1, opacity=0.55, legendgroup=f"{group}:{i}",
                line=dict(color=color, width=1.2, dash="dot"),
                hovertemplate=f"{run['label']} ({group})<br>{_X_HOVER[x_axis]}<br>{key} %{{y:.4g}}<extra></extra>"),
                row=1, col=col)


def _add_predicted(fig: go.Figure, predicted: dict, ends: list[float]) -> None:
    source = str(predicted["source"]).replace("%{", "% {")
    for col, key, fmt in ((2, "tokens_per_s", ",.0f"), (3, "step_time_s", ".4g")):
        fig.add_trace(go.Scatter(x=ends, y=[predicted[key]] * 2, mode="lines", name="predicted",
                                 showlegend=False, line=dict(color=COLORS[key], width=1.5, dash="dash"),
                                 hovertemplate=f"predicted {key}: %{{y:{fmt}}}<br>{source}<extra></extra>"),
                      row=1, col=col)


def _run_title(steps: list[dict], evals: list[dict]) -> str:
    last = steps[-1] if steps else None
    title = "Training" if last is None else (
        f"Training: step {last['step']}, loss {last['loss']:.4f}, {last['tokens_per_s']:,.0f} tokens/s")
    if evals:
        title += f", val loss {evals[-1]['loss']:.4f} (dashed)"
    return title


def host_series(events: list[dict]) -> dict[int, list[dict]]:
    """Per rank, what its memory events say about the host and the GPU, in step order:
    ``{"step", "cpu_percent" (the process's CPU time over the step's wall time), "rss_bytes",
    "gpu_util_percent", "gpu_memory_bytes"}``, each None where the event does not carry it."""
    out: dict[int, list[dict]] = {}
    for e in events:
        if e.get("event") != "memory":
            continue
        wall, cpu = e.get("step_time_s"), e.get("cpu_s")
        host, gpu = e.get("host") or {}, e.get("gpu") or {}
        out.setdefault(int(e["rank"]), []).append({
            "step": e["step"], "cpu_percent": 100.0 * cpu / wall if cpu is not None and wall else None,
            "rss_bytes": host.get("rss_bytes"), "gpu_util_percent": gpu.get("util_percent"),
            "gpu_memory_bytes": gpu.get("memory_used_bytes")})
    return out


# (series, name, unit: None for bytes, in GiB or MiB; divisor). A panel's title is its name over its
# unit, 12 px: four one-line titles overlapped at an 800 px window (a 370 px column).
_HOST_PANELS = (("cpu_percent", "host CPU", "%", 1), ("rss_bytes", "host memory", None, GiB),
                ("gpu_util_percent", "GPU busy", "%", 1), ("gpu_memory_bytes", "GPU memory", None, GiB))


def host_figure(events: list[dict], height: int = 260, *, smooth: float = 0.0, x_axis: str = "step") -> go.Figure:
    """Host CPU and memory per rank, and GPU utilisation and memory per rank where the memory events
    carry them (NVML on GPU ranks), against the same x as the run chart.

    Args:
        events: metrics events; "memory" events are drawn ("step" events place them on the x axis).
        height: figure height in pixels.
        smooth: exponential-moving-average weight for every curve (0: raw).
        x_axis: "step", "time" or "tokens" (`step_x`).
    Returns:
        A go.Figure with one panel per figure that any rank reports (CPU first), one line per rank.
    """
    steps = [e for e in events if e.get("event") == "step"]
    x_of = _x_of(steps, step_x(steps, x_axis), x_axis)
    series = host_series(events)
    panels = []
    for key, name, unit, scale in _HOST_PANELS:
        values = [row[key] for rows in series.values() for row in rows if row[key] is not None]
        if values and unit is None:  # bytes: GiB, or MiB where GiB would read 0.00
            unit, scale = ("GiB", GiB) if max(values) >= GiB / 2 else ("MiB", 2**20)
        if values:
            panels.append((key, f"{name} ({unit})", scale))
    fig = make_subplots(rows=1, cols=max(len(panels), 1), horizontal_spacing=0.08,
                        subplot_titles=[t.replace(" (", "<br>(") for _, t, _ in panels] or ["host"])
    fig.update_annotations(font_size=12)
    for col, (key, title, div) in enumerate(panels, start=1):
        for j, rank in enumerate(sorted(series)):
            rows = [r for r in series[rank] if r[key] is not None]
            fig.add_trace(go.Scatter(x=[x_of(r["step"]) for r in rows], y=smoothed([r[key] / div for r in rows], smooth),
                                     mode="lines+markers", name=f"rank {rank}", legendgroup=f"rank {rank}",
                                     showlegend=col == 1, marker=dict(size=4),
                                     line=dict(color=_RANK_COLORS[j % len(_RANK_COLORS)], width=1.5),
                                     hovertemplate=f"rank {rank}<br>{_X_HOVER[x_axis]}<br>{title}: %{{y:.3g}}"
                                                   "<extra></extra>"), row=1, col=col)
        fig.update_xaxes(title_text=X_AXES[x_axis], row=1, col=col, rangemode="tozero")
        fig.update_yaxes(rangemode="tozero", row=1, col=col)
    return _base_layout(fig, "Hosts and GPUs per rank" if panels else "Hosts and GPUs per rank: no figures yet", height)


def lr_figure(train, events: list[dict] | None = None, height: int = 180, max_points: int = 400) -> go.Figure:
    """The learning-rate schedule of a spec's `train` section against the step, and the rates
    the run reported so far (step events' "lr") as markers.

    Args:
        train: a TrainSpec (steps, lr, schedule, warmup_steps, min_lr).
        events: optional metrics events of a run of it.
        height: figure height in pixels.
        max_points: the curve is sampled at most this often (specs may have millions of steps).
    Returns:
        A go.Figure with the schedule's line (and the run's markers when there are step events).
    """
    from workbench.schedule import lr_for

    stride = max(1, -(-train.steps // max_points))
    x = sorted(set(range(1, train.steps + 1, stride)) | {min(train.warmup_steps, train.steps) or 1, train.steps})
    fig = go.Figure(go.Scatter(x=x, y=[lr_for(train, k) for k in x], mode="lines", name="schedule",
                               line=dict(color=COLORS["lr"], width=2),
                               hovertemplate="step %{x}<br>lr: %{y:.3g}<extra></extra>"))
    ran = [e for e in events or [] if e.get("event") == "step" and "lr" in e]
    if ran:
        fig.add_trace(go.Scatter(x=[e["step"] for e in ran], y=[e["lr"] for e in ran], mode="markers", name="run",
                                 marker=dict(color=COLORS["loss"], size=5)))
    fig.update_xaxes(title_text="step", rangemode="tozero")
    fig.update_yaxes(rangemode="tozero", exponentformat="e")
    warm = f", warmup {train.warmup_steps}" if train.warmup_steps else ""
    floor = f" → {train.min_lr:.2g}" if train.schedule != "constant" else ""
    return _base_layout(fig, f"Learning rate: {train.schedule}, {train.lr:.2g}{floor}{warm}", height)


def measured_timeline_figure(events: list[dict], height: int = 260) -> go.Figure:
    """A run's measured pipeline timeline: per rank, forward (F), backward (B) and weight-gradient
    (W) work (`workbench.timeline.timeline_figure` draws the simulated schedule).

    Args:
        events: metrics events; the newest "timeline" event per rank is drawn.
        height: figure height in pixels.
    Returns:
        A go.Figure of horizontal bars (time in s from the step's start), one row per rank.
    """
    latest: dict[int, dict] = {}
    for e in events:
        if e.get("event") == "timeline":
            latest[int(e["rank"])] = e
    fig = go.Figure()
    t0 = min((it["start_s"] for e in latest.values() for it in e["items"]), default=0.0)
    kinds = ("F", "B") + (("W",) if any(it["kind"] == "W" for e in latest.values() for it in e["items"]) else ())
    names = {"F": "forward", "B": "backward", "W": "weight grad"}
    for kind in kinds:
        y, base, width, text = [], [], [], []
        for rank in sorted(latest):
            for it in latest[rank]["items"]:
                if it["kind"] == kind:
                    y.append(f"rank {rank}")
                    base.append(it["start_s"] - t0)
                    width.append(max(it["end_s"] - it["start_s"], 1e-6))
                    text.append(str(it["microbatch"]))
        fig.add_trace(go.Bar(y=y, x=width, base=base, orientation="h", name=names[kind],
                             marker_color=COLORS[kind], text=text, textposition="inside", insidetextanchor="middle",
                             hovertemplate="micro-batch %{text}: %{base:.3f}–%{x:.3f} s<extra></extra>"))
    step = max((e.get("step", 0) for e in latest.values()), default=0)
    _base_layout(fig, f"Pipeline timeline (step {step})" if latest else "Pipeline timeline", height)
    fig.update_layout(barmode="overlay", xaxis_title="s", yaxis=dict(autorange="reversed", type="category"))
    return fig


def plan_figure(plan: dict, height: int = 320) -> go.Figure:
    """Planner candidates: throughput against peak memory, colored by whether they fit.

    Args:
        plan: ``plan(spec).to_dict(top=N)`` (the contract in docs/architecture.md).
        height: figure height in pixels.
    Returns:
        A go.Figure; hover shows the layout and the cost per hour.
    """
    fig = go.Figure()
    source = plan["source"]  # where the numbers come from: PlanResult.source
    device = plan.get("device")
    for ok, color, name in ((True, COLORS["master"], "fits"), (False, COLORS["overflow"], "does not fit")):
        rows = [c for c in plan["candidates"] if bool(c["fits"]) == ok]
        fig.add_trace(go.Scatter(
            x=[c["peak_bytes"] / GiB for c in rows], y=[c["tokens_per_s"] for c in rows], mode="markers",
            name=name, marker=dict(color=color, size=10, line=dict(width=1, color="white")),
            text=[layout_label(c["layout"], c.get("micro_batch")) for c in rows],
            customdata=[[f"{c.get('usd_per_hour', 0.0):.2f}", mfu_text(c.get("mfu"), device)] for c in rows],
            hovertemplate="%{text}<br>peak %{x:.1f} GiB, %{y:,.0f} tokens/s<br>"
                          "MFU %{customdata[1]}, $%{customdata[0]}/h<br>predicted from "
                          + source.replace("%{", "% {") + "<extra></extra>"))
    _base_layout(fig, "Planner: candidate layouts", height)
    fig.update_layout(xaxis_title="peak memory per rank (GiB)", yaxis_title="tokens/s (predicted)")
    return fig


def layout_label(layout: dict, micro_batch: int | None = None) -> str:
    """A short human label for a layout, e.g. ``dp4 tp2 pp2 zero1 sp interleaved-1f1b v4 mb=2``.

    Every setting that can tell two planner rows apart is in it: sequence parallel ("sp") under
    tp, and the virtual stages per pipeline rank ("v4") of an interleaved or zero-bubble schedule.
    """
    from workbench.parallelism import is_multi_stage

    parts = [f"dp{layout.get('dp', 1)}", f"tp{layout.get('tp', 1)}", f"pp{layout.get('pp', 1)}"]
    if layout.get("zero"):
        parts.append(f"zero{layout['zero']}")
    if layout.get("offload", "none") != "none":
        parts.append(f"offload={layout['offload']}")
    if layout.get("activation_checkpointing", "none") != "none":
        parts.append(f"ckpt={layout['activation_checkpointing']}")
    if layout.get("tp", 1) > 1 and layout.get("sequence_parallel"):
        parts.append("sp")
    if layout.get("pp", 1) > 1 and layout.get("pp_schedule"):
        parts.append(layout["pp_schedule"])
        if is_multi_stage(layout["pp_schedule"]) and layout.get("virtual_stages"):
            parts.append(f"v{layout['virtual_stages']}")
    if micro_batch:
        parts.append(f"mb={micro_batch}")
    return " ".join(parts)
