"""Figures of the benchmark results (bench/results/*.json -> docs/img/bench_*.png), matplotlib Agg.

Each function takes one benchmark's result dict and a path, so the figures are rebuilt from the
JSON alone: `python -m bench.plots` redraws them without rerunning anything.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from bench.common import NOT_AVAILABLE, ROOT, mib, read_result

IMG = ROOT / "docs" / "img"
DPI = 90


def _fig(w: float = 6.4, h: float = 3.6):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=(w, h))


def _save(plt, fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


THROUGHPUT_LABELS = {"workbench": "workbench run (local Ray)", "runtime": "per-rank runtime under torchrun",
                     "torchrun": "plain DDP under torchrun"}


def plot_throughput(r: dict, path: Path) -> Path:
    plt, fig, ax = _fig()
    arms = list(r["tokens_per_s"])
    width = 0.8 / len(arms)
    xs = range(len(r["tokens_per_s"][arms[0]]))
    for i, arm in enumerate(arms):
        ax.bar([x + (i - (len(arms) - 1) / 2) * width for x in xs], r["tokens_per_s"][arm], width,
               label=THROUGHPUT_LABELS.get(arm, arm))
    ax.set_xticks(list(xs), [str(x + 1) for x in xs])
    ax.set_xlabel("round (arms alternated)")
    ax.set_ylim(0, 1.35 * max(v for arm in arms for v in r["tokens_per_s"][arm]))
    ax.set_ylabel("steady-state tokens/s")
    ratio = ax.twinx()  # each round's ratio, against the goal
    ratio.plot(list(xs), r["ratios"]["workbench / torchrun"], "k.", label="workbench run / plain torchrun")
    ratio.axhline(r["goal"], color="k", linestyle="--", linewidth=0.8)
    ratio.set_ylim(0, 1.6)
    ratio.set_ylabel("ratio (dots; dashed: goal)")
    c = r["config"]
    ax.set_title(f"{c['model']}, dp={c['dp']}: median ratio {r['ratio']['workbench / torchrun']['median']:.3f} "
                 f"(goal >= {r['goal']})")
    ax.legend(loc="upper center", ncol=3, fontsize=7)
    return _save(plt, fig, path)


def plot_cpu_share(r: dict, path: Path) -> Path:
    """Where the machine's cores went in the steady window, per arm, stacked by process group."""
    plt, fig, ax = _fig(6.4, 2.8)
    arms = list(r["arms"])
    left = [0.0] * len(arms)
    for group in r["arms"][arms[0]]["cores"]:
        values = [r["arms"][a]["cores"][group] for a in arms]
        ax.barh(range(len(arms)), values, left=left, label=group)
        left = [x + v for x, v in zip(left, values)]
    ax.set_yticks(range(len(arms)), [THROUGHPUT_LABELS.get(a, a) for a in arms])
    ax.set_xlabel("cores (median of rounds; the machine has 2)")
    ax.set_title(f"{r['config']['model']}, dp={r['config']['dp']}: CPU over steps "
                 f"{r['config']['window'][0]}..{r['config']['window'][1]}")
    ax.set_xlim(0, 1.6 * max(left))
    ax.legend(loc="center right", fontsize=7)
    return _save(plt, fig, path)


def plot_memory(r: dict, path: Path) -> Path:
    plt, fig, ax = _fig()
    rows = r["rows"]
    base = next((x["measured_state"] for x in rows if x["dp"] == 1 and x["zero"] == 0
                 and isinstance(x["measured_state"], int)), None)
    for i, zero in enumerate(sorted({x["zero"] for x in rows})):
        color = f"C{i}"
        pts = [(x["dp"], x["measured_state"]) for x in rows if x["zero"] == zero and isinstance(x["measured_state"], int)]
        pred = [(x["dp"], x["predicted_state"]) for x in rows if x["zero"] == zero and isinstance(x["predicted_state"], int)]
        if base is not None and zero > 0:  # at dp=1 every stage holds the whole state
            pts = [(1, base)] + [p for p in pts if p[0] != 1]
        if pts:
            ax.plot([p[0] for p in pts], [mib(p[1]) for p in pts], "o-", color=color, label=f"zero {zero} measured")
        if pred:
            ax.plot([p[0] for p in pred], [mib(p[1]) for p in pred], "x--", color=color, alpha=0.7,
                    label=f"zero {zero} predicted")
    ax.set_xscale("log", base=2)
    ax.set_xticks(r["config"]["dps"], [str(d) for d in r["config"]["dps"]])
    ax.set_xlabel("dp (ranks)")
    ax.set_ylabel("state per rank (MiB)\nparams+grads+master+optimizer")
    ax.set_title(f"{r['config']['preset']}, {r['config']['dtype']}, AdamW: model states per rank")
    ax.legend(fontsize=7, ncol=2)
    return _save(plt, fig, path)


def plot_pipeline(r: dict, path: Path) -> Path:
    plt, fig, ax = _fig()
    p = r["config"]["pp"]
    ms = list(range(1, max(r["config"]["ms"]) + 1))
    ax.plot(ms, [(p - 1) / (m + p - 1) for m in ms], "k-", label="(p-1)/(m+p-1)")
    for i, schedule in enumerate(r["config"]["schedules"]):
        pts = sorted((x["m"], x["measured"]) for x in r["rows"]
                     if x["schedule"] == schedule and isinstance(x["measured"], dict))
        if not pts:
            continue
        ax.errorbar([m for m, _ in pts], [s["median"] for _, s in pts],
                    yerr=[[s["median"] - s["min"] for _, s in pts], [s["max"] - s["median"] for _, s in pts]],
                    fmt="o-", color=f"C{i}", capsize=2, label=f"{schedule} measured")
    v = max((x["virtual_stages"] for x in r["rows"]), default=1)
    if v > 1:
        ax.plot(ms, [(p - 1) / (v * m + p - 1) for m in ms], "k:", label=f"(p-1)/({v}m+p-1)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches per step (m)")
    ax.set_ylabel("bubble (idle share of the step)")
    ax.set_title(f"pipeline bubble, p={p} stages ({r['config']['preset']})")
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def plot_timeline(r: dict, path: Path, schedule: str = "1f1b") -> Path | None:
    """A Gantt chart of one measured step: when each rank ran F/B/W of each micro-batch."""
    rows = [x for x in r["rows"] if x["schedule"] == schedule and "timeline" in x]
    if not rows:
        return None
    row = max(rows, key=lambda x: x["m"] if x["m"] <= 8 else 0)
    plt, fig, ax = _fig(6.4, 2.4)
    colors = {"F": "C0", "B": "C1", "W": "C2"}
    for rank, items in row["timeline"].items():
        for it in items:
            ax.barh(int(rank), it["end_s"] - it["start_s"], left=it["start_s"], color=colors[it["kind"]],
                    edgecolor="white")
    ax.set_yticks([int(k) for k in row["timeline"]], [f"rank {k}" for k in row["timeline"]])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from step start")
    ax.set_title(f"{schedule}, m={row['m']}: F (blue), B (orange), W (green)")
    return _save(plt, fig, path)


def plot_overlap(r: dict, path: Path) -> Path:
    plt, fig, ax = _fig()
    names = list(r["variants"])
    med = [r["variants"][n]["step_s"]["median"] for n in names]
    lo = [m - r["variants"][n]["step_s"]["min"] for n, m in zip(names, med)]
    hi = [r["variants"][n]["step_s"]["max"] - m for n, m in zip(names, med)]
    ax.barh(names, med, xerr=[lo, hi], color="C0", capsize=2)
    compute, comm = r["compute_s"]["median"], r["allreduce_s"]["median"]
    ax.axvline(compute, color="k", ls="--", label=f"backward, no comm ({compute:.3f} s)")
    ax.axvline(compute + comm, color="C3", ls=":", label=f"+ all-reduce alone ({compute + comm:.3f} s)")
    ax.invert_yaxis()
    ax.set_xlabel("forward + backward + gradient sync (s), dp=2")
    ax.set_title(f"DDP overlap ({r['config']['preset']}, {mib(r['config']['grad_bytes']):.0f} MiB of gradients)")
    ax.legend(fontsize=7, loc="lower right")
    return _save(plt, fig, path)


def plot_activation_ckpt(r: dict, path: Path) -> Path | None:
    modes = {k: v for k, v in r["modes"].items() if "step_s" in v}
    if not modes:
        return None
    plt, fig, ax = _fig()
    for i, (mode, v) in enumerate(modes.items()):
        ax.errorbar(mib(v["activations"]), v["step_s"]["median"] * 1e3,
                    yerr=[[(v["step_s"]["median"] - v["step_s"]["min"]) * 1e3], [(v["step_s"]["max"] - v["step_s"]["median"]) * 1e3]],
                    fmt="o", color=f"C{i}", capsize=3, label=mode)
        if isinstance(v.get("predicted_activations"), int):
            ax.plot(mib(v["predicted_activations"]), v["step_s"]["median"] * 1e3, "x", color=f"C{i}")
    ax.set_xlabel("activations saved for backward (MiB; x = predicted)")
    ax.set_ylabel("CPU ms per step")
    ax.set_title(f"activation checkpointing ({r['config']['preset']})")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_overhead(r: dict, path: Path) -> Path:
    plt, fig, ax = _fig()
    cpu = r["whole"]["cpu_mean_step_s"]
    names = list(cpu)
    med = [cpu[n]["median"] * 1e3 for n in names]
    err = [[m - cpu[n]["min"] * 1e3 for n, m in zip(names, med)], [cpu[n]["max"] * 1e3 - m for n, m in zip(names, med)]]
    ax.barh(names, med, xerr=err, color=["C0", "C0", "C2", "C1"][: len(names)], capsize=2)
    ax.invert_yaxis()
    ax.set_xlabel("CPU ms per step (mean over steady steps; bars: median of rounds)")
    o = r["metrics_overhead"]
    ax.set_title(f"runtime vs plain loop: {o:+.1%} (goal < {r['goal_metrics']:.0%})")
    return _save(plt, fig, path)


PLOTS = {
    "throughput": [("bench_throughput.png", plot_throughput)],
    "cpu_share": [("bench_cpu_share.png", plot_cpu_share)],
    "memory": [("bench_memory.png", plot_memory)],
    "pipeline": [("bench_pipeline.png", plot_pipeline), ("bench_pipeline_timeline.png", plot_timeline)],
    "overlap": [("bench_overlap.png", plot_overlap)],
    "activation_ckpt": [("bench_activation_ckpt.png", plot_activation_ckpt)],
    "overhead": [("bench_overhead.png", plot_overhead)],
}


def plot_all(results_dir: Path | None = None, img_dir: Path | None = None) -> dict[str, list[Path]]:
    """Draw every figure whose result JSON exists; returns benchmark name -> written images."""
    out: dict[str, list[Path]] = {}
    for name, figures in PLOTS.items():
        result = read_result(name, results_dir)
        if result is None or result.get("status") == NOT_AVAILABLE:
            continue
        for filename, fn in figures:
            path = fn(result, Path(img_dir or IMG) / filename)
            if path is not None:
                out.setdefault(name, []).append(path)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--results", type=Path, help="results folder (default bench/results)")
    ap.add_argument("--img", type=Path, help="image folder (default docs/img)")
    args = ap.parse_args()
    for name, paths in plot_all(args.results, args.img).items():
        print(name, *[str(p) for p in paths])
