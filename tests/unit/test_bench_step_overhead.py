"""bench/bench_step_overhead.py (#35): the per-step figures from step events, and its report
section and summary rows from the committed result (the quick run itself starts Ray: not here)."""
from bench.bench_step_overhead import ARMS, _steady, section, summary_rows
from bench.common import read_result


def test_steady_steps_give_the_interval_and_the_gap_between_steps():
    events = [{"event": "note"}] + [{"event": "step", "step": s, "time": 10.0 + 0.5 * s + (0.1 if s == 4 else 0.0),
                                     "step_time_s": 0.4} for s in range(1, 6)]
    r = _steady(events, skip=1)  # pairs (2, 3), (3, 4), (4, 5)
    assert r["steps"] == 5
    assert [round(x, 6) for x in r["interval"]] == [0.5, 0.6, 0.4]
    assert [round(x, 6) for x in r["gap"]] == [0.1, 0.2, 0.0]


def test_the_section_and_summary_render_the_committed_result():
    r = read_result("step_overhead")
    assert r is not None, "bench/results/step_overhead.json: run python -m bench.bench_step_overhead"
    md = section(r)
    assert md.startswith("## m) Per-step overhead")
    for preset in r["ack"]["models"]:
        assert f"{preset}:" in md
        assert all(arm in md for arm in ARMS)
    assert f"N + {r['ack']['stop_within_steps']} at the latest" in md
    rows = summary_rows(r)
    assert len(rows) == 2 * len(r["ack"]["models"]) + 2
    assert all(isinstance(row[2], float) for row in rows)
    assert section({}).endswith("not run\n")
