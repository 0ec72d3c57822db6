"""Pipeline schedules simulated: which pp rank runs which micro-batch's F / B / W, and when.

`simulate` replays a schedule's per-rank order (GPipe, 1F1B, interleaved 1F1B, zero bubble)
with data dependencies between stages, so bubbles appear where a rank waits. The result can be
drawn (`timeline_figure`, plotly imported lazily), printed (`timeline_text`) and overlaid with
measured timings ({rank, microbatch, kind, start_s, end_s}) from a real run.
"""
from __future__ import annotations

from functools import lru_cache

from workbench.parallelism import is_multi_stage


def _interleaved_order(pp: int, m: int, v: int, rank: int) -> list[tuple[str, int, int]]:
    # Megatron / torch Interleaved1F1B: micro-batches go in rounds of pp through chunk 0, then
    # chunk 1, ...; backward visits chunks in reverse. Warm-up fills the deeper pipeline.
    def order(reverse: bool) -> list[tuple[int, int]]:
        chunks = range(v - 1, -1, -1) if reverse else range(v)
        return [(c, j) for g in range(0, m, pp) for c in chunks for j in range(g, min(g + pp, m))]

    fwd, bwd = order(False), order(True)
    total = m * v
    warmup = min(total, (pp - rank - 1) * 2 + (v - 1) * pp)
    steady = total - warmup  # one F then one B each
    ops = [("F", j, c) for c, j in fwd[:warmup]]
    for (fc, fj), (bc, bj) in zip(fwd[warmup:], bwd[:steady]):
        ops += (("F", fj, fc), ("B", bj, bc))
    ops += [("B", j, c) for c, j in bwd[steady:]]
    return ops


def rank_order(schedule: str, pp: int, m: int, rank: int, v: int = 1) -> list[tuple[str, int, int]]:
    """The (kind, micro-batch, chunk) operations rank `rank` runs, in order."""
    if schedule == "gpipe":
        return [("F", j, 0) for j in range(m)] + [("B", j, 0) for j in range(m)]
    if is_multi_stage(schedule) and v > 1:
        # InterleavedZeroBubble keeps Interleaved1F1B's F/B order (it splits B into B and W).
        return _interleaved_order(pp, m, v, rank)
    # 1F1B order (zero bubble runs the same F/B order and fills waits with W, see simulate).
    warmup = min(m, pp - rank - 1)
    ops = [("F", j, 0) for j in range(warmup)]
    for j in range(warmup, m):
        ops += [("F", j, 0), ("B", j - warmup, 0)]
    ops += [("B", j, 0) for j in range(m - warmup, m)]
    return ops


@lru_cache(maxsize=1024)
def max_in_flight(schedule: str, pp: int, m: int, rank: int, v: int = 1) -> tuple[int, ...]:
    """Peak number of micro-batches whose activations a rank holds, per chunk, at one time.

    Returns the per-chunk counts at the moment the total is highest (the activation peak).
    """
    v = v if is_multi_stage(schedule) else 1
    held = [0] * v
    best, best_total, total = tuple(held), 0, 0
    for kind, _, c in rank_order(schedule, pp, m, rank, v):
        if kind == "F":
            held[c] += 1
            total += 1
            if total > best_total:
                best, best_total = tuple(held), total
        elif kind == "B":
            held[c] -= 1
            total -= 1
    return best


def simulate(schedule: str, pp: int, m: int, v: int = 1, f: float = 1.0, b: float = 2.0,
             w_share: float = 0.5, p2p: float = 0.0) -> list[dict]:
    """Times of every operation when each rank runs its order as soon as its inputs arrive.

    Args:
        schedule: gpipe | 1f1b | interleaved-1f1b | zero-bubble.
        pp, m, v: pipeline ranks, micro-batches, chunks per rank (interleaved only).
        f, b: seconds of one micro-batch's forward / backward through one whole pp rank.
        w_share: zero-bubble only: the part of b that is the weight gradient (W).
        p2p: seconds to send an activation or gradient to the next rank.
    Returns:
        [{rank, microbatch, chunk, kind, start_s, end_s}] sorted by start time.
    """
    v = v if schedule == "interleaved-1f1b" else 1
    cost = {"F": f / v, "B": b / v, "W": 0.0}
    if schedule == "zero-bubble":
        cost = {"F": f, "B": b * (1 - w_share), "W": b * w_share}
    orders = [rank_order(schedule, pp, m, r, v) for r in range(pp)]
    zb = schedule == "zero-bubble"
    pos, free, done, pending = [0] * pp, [0.0] * pp, {}, [[] for _ in range(pp)]
    last_vs = pp * v - 1
    out = []

    def run(r: int, kind: str, j: int, c: int, start: float) -> None:
        end = start + cost[kind]
        done[(kind, c * pp + r, j)] = free[r] = end
        out.append({"rank": r, "microbatch": j, "chunk": c, "kind": kind, "start_s": start, "end_s": end})
        if zb and kind == "B":
            pending[r].append(j)

    while any(pos[r] < len(orders[r]) or pending[r] for r in range(pp)):
        for r in sorted(range(pp), key=lambda q: free[q]):
            if pos[r] == len(orders[r]):
                if pending[r]:
                    run(r, "W", pending[r].pop(0), 0, free[r])
                    break
                continue
            kind, j, c = orders[r][pos[r]]
            vs = c * pp + r
            dep = (("F", vs - 1, j) if vs > 0 else None) if kind == "F" else \
                (("B", vs + 1, j) if vs < last_vs else ("F", vs, j))
            ready = 0.0 if dep is None else done.get(dep)
            if ready is not None and dep is not None and dep[1] != vs:
                ready += p2p
            # ZB-H1 (Qi et al. 2023, arXiv:2401.10241): backward is split into B (input gradient,
            # on the critical path) and W (weight gradient), run whenever the rank would wait.
            if pending[r] and (ready is None or ready > free[r]):
                run(r, "W", pending[r].pop(0), 0, free[r])
                break
            if ready is None:
                continue
            run(r, kind, j, c, max(free[r], ready))
            pos[r] += 1
            break
        else:
            raise RuntimeError(f"schedule {schedule} pp={pp} m={m} v={v} deadlocked")  # a bug in rank_order
    return sorted(out, key=lambda e: (e["start_s"], e["rank"]))


def bubble_fraction(events: list[dict]) -> float:
    """Idle share of the ranks' time between the first start and the last end."""
    ranks = {e["rank"] for e in events}
    span = max(e["end_s"] for e in events) - min(e["start_s"] for e in events)
    busy = sum(e["end_s"] - e["start_s"] for e in events)
    return 1.0 - busy / (span * len(ranks)) if span > 0 else 0.0


def timeline_text(events: list[dict], width: int = 100) -> str:
    """The schedule as text: one line per rank, F/B/W cells labelled by micro-batch, '.' idle."""
    if not events:
        return "(no operations)"
    t0 = min(e["start_s"] for e in events)
    span = max(e["end_s"] for e in events) - t0
    ranks = sorted({e["rank"] for e in events})
    scale = width / span if span > 0 else 1.0
    lines = []
    for r in ranks:
        row = ["."] * width
        for e in (e for e in events if e["rank"] == r):
            a = int(round((e["start_s"] - t0) * scale))
            z = max(a + 1, int(round((e["end_s"] - t0) * scale)))
            label = e["kind"] + str(e["microbatch"])
            label = e["kind"].lower() + str(e["microbatch"]) if e.get("chunk", 0) % 2 else label
            cell = (label + "-" * (z - a))[: z - a]
            row[a:z] = list(cell)
        lines.append(f"pp{r:<3}|" + "".join(row[:width]) + "|")
    bubble = bubble_fraction(events)
    lines.append(f"      F = forward, B = backward (input grad), W = weight grad; lower case = odd chunk; "
                 f"'.' idle ({bubble:.0%} bubble)")
    return "\n".join(lines)


_COLORS = {"F": "#4C78A8", "B": "#F58518", "W": "#54A24B"}


def timeline_figure(events: list[dict], measured: list[dict] | None = None, title: str | None = None):
    """A plotly Figure: one row per pp rank, a bar per operation (simulated, and measured below it).

    Args:
        events: simulated operations from `simulate`.
        measured: optional [{rank, microbatch, kind: F|B|W, start_s, end_s}] from a real run,
            drawn on the same time axis in a second row per rank.
        title: figure title.
    Returns:
        plotly.graph_objects.Figure.
    """
    import plotly.graph_objects as go

    fig = go.Figure()
    series = [("simulated", events, 1.0)] + ([("measured", measured, 0.55)] if measured else [])
    for label, evs, opacity in series:
        for kind in ("F", "B", "W"):
            sel = [e for e in evs if e["kind"] == kind]
            if not sel:
                continue
            fig.add_trace(go.Bar(
                name=f"{kind} ({label})", orientation="h", opacity=opacity,
                base=[e["start_s"] for e in sel], x=[e["end_s"] - e["start_s"] for e in sel],
                y=[f"pp{e['rank']}" + (" measured" if label == "measured" else "") for e in sel],
                text=[str(e["microbatch"]) for e in sel], textposition="inside",
                marker_color=_COLORS[kind], hovertemplate="mb %{text}: %{base:.4f}s + %{x:.4f}s",
            ))
    fig.update_layout(barmode="overlay", title=title, xaxis_title="time (s)",
                      yaxis={"autorange": "reversed"}, legend_title="operation")
    return fig


def measured_from_events(events: list[dict], pp: int, dp: int = 1, tp: int = 1) -> list[dict]:
    """Measured operations from the runtime's `timeline` events, ready for `timeline_figure`.

    The runtime emits, per rank, {"event": "timeline", "rank", "items": [{microbatch, kind,
    stage, start_s, end_s}]} with times from that rank's step start (clocks are per process, so
    ranks line up to within the step's start skew). Only the dp=0, tp=0 replica is kept; the
    global stage index gives the pp rank (looped placement: stage % pp) and the chunk.
    """
    keep = {k * dp * tp: k for k in range(pp)}  # rank of (pp=k, dp=0, tp=0)
    out = []
    for e in events:
        if e.get("event") != "timeline" or e.get("rank") not in keep:
            continue
        for item in e["items"]:
            stage = item.get("stage", keep[e["rank"]])
            out.append({"rank": stage % pp, "chunk": stage // pp, "microbatch": item["microbatch"],
                        "kind": item["kind"], "start_s": item["start_s"], "end_s": item["end_s"]})
    return sorted(out, key=lambda x: (x["start_s"], x["rank"]))
