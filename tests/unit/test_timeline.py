"""Pipeline schedule simulation: bubbles match the closed forms, dependencies hold, views render."""
import pytest

from workbench.parallelism import PIPELINE_SCHEDULES
from workbench.timeline import bubble_fraction, max_in_flight, simulate, timeline_figure, timeline_text


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (8, 16), (4, 12)])
def test_bubbles_match_closed_forms(pp, m):
    assert bubble_fraction(simulate("gpipe", pp, m)) == pytest.approx((pp - 1) / (m + pp - 1))
    assert bubble_fraction(simulate("1f1b", pp, m)) == pytest.approx((pp - 1) / (m + pp - 1))
    assert bubble_fraction(simulate("interleaved-1f1b", pp, m, v=2)) == pytest.approx((pp - 1) / (2 * m + pp - 1))
    # ZB-H1 with F = B = W: a third of 1F1B's idle time (Qi et al. 2023).
    assert bubble_fraction(simulate("zero-bubble", pp, m)) == pytest.approx((pp - 1) / (3 * m + pp - 1))


@pytest.mark.parametrize("schedule", PIPELINE_SCHEDULES)
def test_every_op_once_and_dependencies_hold(schedule):
    pp, m, v = 4, 8, 2
    ev = simulate(schedule, pp, m, v=v, p2p=0.1)
    chunks = v if schedule == "interleaved-1f1b" else 1
    kinds = ("F", "B", "W") if schedule == "zero-bubble" else ("F", "B")
    assert len(ev) == len(kinds) * pp * chunks * m
    end = {(e["kind"], e["chunk"] * pp + e["rank"], e["microbatch"]): e for e in ev}
    last = pp * chunks - 1
    for (kind, vs, j), e in end.items():
        if kind == "F" and vs > 0:
            assert e["start_s"] >= end[("F", vs - 1, j)]["end_s"] + 0.1 - 1e-9
        if kind == "B":
            dep = end[("B", vs + 1, j)] if vs < last else end[("F", vs, j)]
            assert e["start_s"] >= dep["end_s"] - 1e-9
    for r in range(pp):  # a rank runs one thing at a time
        mine = sorted((e for e in ev if e["rank"] == r), key=lambda e: e["start_s"])
        assert all(a["end_s"] <= b["start_s"] + 1e-9 for a, b in zip(mine, mine[1:]))


def test_in_flight_microbatches():
    assert [max_in_flight("1f1b", 4, 8, r) for r in range(4)] == [(4,), (3,), (2,), (1,)]
    assert max_in_flight("gpipe", 4, 8, 2) == (8,)
    assert max_in_flight("1f1b", 4, 2, 0) == (2,)  # fewer micro-batches than stages
    inter = max_in_flight("interleaved-1f1b", 4, 8, 0, 2)
    assert sum(inter) > 4  # interleaving holds more (smaller) chunks


def test_text_rendering():
    text = timeline_text(simulate("1f1b", 4, 8), width=80)
    lines = text.splitlines()
    assert len(lines) == 5 and lines[0].startswith("pp0") and "27% bubble" in lines[-1]
    assert "F0" in lines[0] and "B7" in lines[3]


def test_figure_with_measured_overlay():
    pytest.importorskip("plotly")
    sim = simulate("1f1b", 2, 4, f=0.01, b=0.02)
    measured = [{**e, "start_s": e["start_s"] * 1.1, "end_s": e["end_s"] * 1.1} for e in sim]
    fig = timeline_figure(sim, measured=measured, title="1f1b")
    names = {t.name for t in fig.data}
    assert {"F (simulated)", "B (simulated)", "F (measured)", "B (measured)"} <= names
    assert sum(len(t.x) for t in fig.data) == 2 * len(sim)


def test_timeline_module_does_not_import_plotly():
    import subprocess
    import sys

    code = "import sys, workbench.timeline, workbench.planner; print('plotly' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_measured_from_runtime_events():
    from workbench.timeline import measured_from_events

    events = [
        {"event": "timeline", "step": 2, "rank": 0, "items": [
            {"microbatch": 0, "kind": "F", "stage": 0, "start_s": 0.0, "end_s": 0.1},
            {"microbatch": 0, "kind": "F", "stage": 2, "start_s": 0.2, "end_s": 0.3}]},
        {"event": "timeline", "step": 2, "rank": 1, "items": [  # dp replica 1 of stage 0: dropped
            {"microbatch": 0, "kind": "F", "stage": 0, "start_s": 0.0, "end_s": 0.1}]},
        {"event": "timeline", "step": 2, "rank": 2, "items": [
            {"microbatch": 0, "kind": "F", "stage": 1, "start_s": 0.1, "end_s": 0.2}]},
        {"event": "step", "step": 2, "loss": 1.0},
    ]
    out = measured_from_events(events, pp=2, dp=2)
    assert [(e["rank"], e["chunk"]) for e in out] == [(0, 0), (1, 0), (0, 1)]
    text = timeline_text(out, width=30)
    assert text.splitlines()[0].startswith("pp0")
