"""The notebook's chart builders: estimates and metrics events in, plotly figures out (no Jupyter)."""
import pytest

pytest.importorskip("plotly")

from workbench.report import figures  # noqa: E402

GiB = 2**30


def estimate(totals_gib, device_gib=1.0, coords=None):
    """A contract-shaped estimate whose rank r has the given total, split over the components."""
    rows = []
    for r, total in enumerate(totals_gib):
        parts = {"params": 0.1, "grads": 0.1, "master": 0.2, "optimizer": 0.4, "buffers": 0.05}
        parts = {k: int(v * GiB) for k, v in parts.items()}
        parts["activations"] = int(total * GiB) - sum(parts.values())
        rows.append({"rank": r, "coords": (coords or {}).get(r, {"dp": r, "tp": 0, "pp": 0}), **parts,
                     "total": sum(parts.values())})
    return {"world_size": len(rows), "device_memory": int(device_gib * GiB),
            "fits": all(r["total"] <= device_gib * GiB for r in rows), "per_rank": rows}


def step(k, loss, tps=1000.0, dt=0.5):
    return {"event": "step", "step": k, "loss": loss, "tokens_per_s": tps, "step_time_s": dt}


def measured(rank, acts=0.3, peak=1.0):
    return {"event": "memory", "step": 1, "rank": rank, "coords": {"dp": rank, "tp": 0, "pp": 0},
            "measured": {"params": int(0.1 * GiB), "grads": int(0.1 * GiB), "master": int(0.2 * GiB),
                         "optimizer": int(0.4 * GiB), "activations": int(acts * GiB), "peak": int(peak * GiB)}}


def test_memory_figure_stacks_components_in_gib_with_fixed_colors():
    fig = figures.memory_figure(estimate([0.9, 0.95], device_gib=1.0))
    names = [t.name for t in fig.data]
    assert names == list(figures.COMPONENTS)
    assert fig.layout.barmode == "stack"
    assert fig.layout.yaxis.title.text == "GiB"
    opt = fig.data[names.index("optimizer")]
    assert opt.marker.color == figures.COLORS["optimizer"]
    assert opt.y == pytest.approx((0.4, 0.4), rel=1e-6)
    assert list(fig.data[0].x) == ["rank 0", "rank 1"]
    # the device line sits at 1 GiB and the verdict is in the title
    assert [s.y0 for s in fig.layout.shapes if s.type == "line"] == [pytest.approx(1.0)]
    assert fig.layout.title.text.startswith("Memory per rank (fits")


def test_memory_figure_marks_and_shades_ranks_that_do_not_fit():
    fig = figures.memory_figure(estimate([0.5, 1.5, 0.7, 2.0], device_gib=1.0))
    assert list(fig.data[0].x) == ["rank 0", "rank 1 ✗", "rank 2", "rank 3 ✗"]
    rects = [s for s in fig.layout.shapes if s.type == "rect"]
    assert sorted((r.x0, r.x1) for r in rects) == [(0.5, 1.5), (2.5, 3.5)]
    assert "does not fit: 2 of 4 ranks" in fig.layout.title.text
    assert fig.layout.yaxis.range[1] >= 2.0  # the tallest bar is in view


def test_memory_figure_puts_measured_beside_predicted():
    events = [measured(0, acts=0.2, peak=0.9), measured(1, acts=0.4, peak=1.1)]
    fig = figures.memory_figure(estimate([0.9, 0.95]), figures.latest_measured(events))
    acts = fig.data[list(figures.COMPONENTS).index("activations")]
    assert [list(a) for a in acts.x] == [["rank 0", "rank 0", "rank 1", "rank 1"],
                                         ["predicted", "measured", "predicted", "measured"]]
    assert acts.y[1] == pytest.approx(0.2) and acts.y[3] == pytest.approx(0.4)
    peak = fig.data[-1]
    assert peak.name == "measured peak" and peak.y == pytest.approx((0.9, 1.1))
    # buffers are not measured: the measured slot is empty, not zero
    buffers = fig.data[list(figures.COMPONENTS).index("buffers")]
    assert buffers.y[1] is None and buffers.y[0] == pytest.approx(0.05, rel=1e-3)


def test_memory_figure_draws_measured_alone_in_mib_for_small_runs():
    events = [measured(r, acts=0.001, peak=0.002) for r in range(2)]
    events = [{**e, "measured": {k: v // 512 for k, v in e["measured"].items()}} for e in events]
    fig = figures.memory_figure(None, figures.latest_measured(events), device_memory=16 * GiB)
    assert fig.layout.yaxis.title.text == "MiB"
    assert fig.layout.title.text == "Memory per rank (measured)"
    params = fig.data[0]
    assert params.y == pytest.approx((0.2, 0.2), rel=1e-3)  # 0.1 GiB / 512 = 0.2 MiB
    assert fig.layout.yaxis.range[1] < 1.0  # zoomed to the bars, not to the far-away 16 GiB line
    assert not fig.layout.shapes


def test_memory_figure_groups_large_worlds_by_pipeline_and_tensor_position():
    coords = {r: {"dp": r // 8, "tp": r % 2, "pp": (r // 2) % 4} for r in range(64)}
    totals = [0.5 + 0.01 * r for r in range(64)]
    fig = figures.memory_figure(estimate(totals, device_gib=2.0, coords=coords))
    labels = list(fig.data[0].x)
    assert len(labels) == 8 and labels[0] == "pp0 tp0 ×8"
    # each group shows its worst rank: pp0 tp0 holds ranks 0, 8, ..., 56; the largest total is rank 56
    assert sum(t.y[0] for t in fig.data) == pytest.approx(totals[56], rel=1e-6)


def test_run_figure_plots_loss_throughput_and_step_time_against_step():
    events = [step(1, 5.0, 800, 0.9), {"event": "memory", "rank": 0, "step": 1, "measured": {}},
              step(2, 4.0, 1000, 0.7), step(3, 3.5, 1100, 0.65)]
    fig = figures.run_figure(events)
    assert [t.name for t in fig.data] == ["loss", "tokens_per_s", "step_time_s"]
    assert list(fig.data[0].x) == [1, 2, 3] and list(fig.data[0].y) == [5.0, 4.0, 3.5]
    assert list(fig.data[1].y) == [800, 1000, 1100]
    assert list(fig.data[2].y) == [0.9, 0.7, 0.65]
    assert "step 3" in fig.layout.title.text and "1,100 tokens/s" in fig.layout.title.text
    assert [a.text for a in fig.layout.annotations] == ["loss", "tokens/s", "step time (s)"]


def test_run_figure_is_empty_before_the_first_step_and_marks_restarts():
    empty = figures.run_figure([])
    assert len(empty.data) == 3 and all(len(t.x) == 0 for t in empty.data)
    fig = figures.run_figure([step(1, 5.0), {"event": "restart", "attempt": 0, "from_step": 1}, step(2, 4.5)])
    assert [s.x0 for s in fig.layout.shapes if s.type == "line"] == [1, 1, 1]  # one per panel


def test_measured_timeline_figure_draws_forward_and_backward_per_rank():
    items = [{"microbatch": 0, "kind": "F", "start_s": 10.0, "end_s": 10.1},
             {"microbatch": 0, "kind": "B", "start_s": 10.3, "end_s": 10.5}]
    later = [{"microbatch": 0, "kind": "F", "start_s": 10.1, "end_s": 10.2},
             {"microbatch": 0, "kind": "B", "start_s": 10.2, "end_s": 10.3}]
    events = [{"event": "timeline", "step": 2, "rank": 0, "items": items},
              {"event": "timeline", "step": 2, "rank": 1, "items": later}]
    fig = figures.measured_timeline_figure(events)
    fwd, bwd = fig.data
    assert fwd.name == "forward" and list(fwd.y) == ["rank 0", "rank 1"]
    assert fwd.base == pytest.approx((0.0, 0.1)) and fwd.x == pytest.approx((0.1, 0.1))
    assert bwd.base == pytest.approx((0.3, 0.2)) and bwd.marker.color == figures.COLORS["B"]
    assert fig.layout.title.text == "Pipeline timeline (step 2)"


def test_plan_figure_splits_candidates_by_fit():
    def cand(dp, tp, fits, peak):
        return {"layout": {"dp": dp, "tp": tp, "pp": 1, "zero": 3}, "micro_batch": 2, "fits": fits,
                "peak_bytes": int(peak * GiB), "step_time_s": 1.0, "tokens_per_s": 1e4 * dp, "mfu": 0.4,
                "usd_per_hour": 30.0, "usd_per_hour_spot": 12.0}
    plan = {"candidates": [cand(8, 1, True, 60), cand(4, 2, True, 40), cand(1, 8, False, 90)],
            "device": "h100-80gb", "source": "catalog defaults (h100-80gb)"}
    fits, nofit = figures.plan_figure(plan).data
    assert fits.x == pytest.approx((60, 40)) and list(fits.text) == ["dp8 tp1 pp1 zero3 mb=2", "dp4 tp2 pp1 zero3 mb=2"]
    assert nofit.marker.color == figures.COLORS["overflow"] and nofit.y == (1e4,)
    assert "predicted from catalog defaults (h100-80gb)" in fits.hovertemplate  # every number says its source
    assert [list(c) for c in fits.customdata] == [["30.00", "40%"], ["30.00", "40%"]]
    cpu = figures.plan_figure({**plan, "device": "cpu"}).data[0]
    assert [c[1] for c in cpu.customdata] == ["-", "-"]  # no MFU on CPU devices


def test_layout_label_shows_sequence_parallel_and_virtual_stages():
    lay = {"dp": 2, "tp": 2, "pp": 2, "zero": 1, "pp_schedule": "interleaved-1f1b", "virtual_stages": 4,
           "sequence_parallel": True}
    assert figures.layout_label(lay, 1) == "dp2 tp2 pp2 zero1 sp interleaved-1f1b v4 mb=1"
    assert figures.layout_label({**lay, "pp_schedule": "1f1b", "sequence_parallel": False}) == "dp2 tp2 pp2 zero1 1f1b"


def test_layout_label_names_only_what_is_set():
    assert figures.layout_label({"dp": 2, "tp": 1, "pp": 1, "zero": 0, "offload": "none"}) == "dp2 tp1 pp1"
    assert figures.layout_label({"dp": 1, "tp": 2, "pp": 4, "zero": 1, "activation_checkpointing": "full",
                                 "pp_schedule": "1f1b", "offload": "cpu"}, 1) == \
        "dp1 tp2 pp4 zero1 offload=cpu ckpt=full 1f1b mb=1"


def test_run_figure_draws_the_held_out_loss_beside_the_training_loss():
    evals = [{"event": "eval", "step": 2, "loss": 4.2, "perplexity": 66.7}, {"event": "eval", "step": 3, "loss": 3.9, "perplexity": 49.4}]
    fig = figures.run_figure([step(1, 5.0), step(2, 4.0), evals[0], step(3, 3.5), evals[1]])
    assert [t.name for t in fig.data] == ["loss", "tokens_per_s", "step_time_s", "val_loss"]
    val = fig.data[3]
    assert list(val.x) == [2, 3] and list(val.y) == [4.2, 3.9] and list(val.customdata) == [66.7, 49.4]
    assert val.xaxis == fig.data[0].xaxis and val.yaxis == fig.data[0].yaxis  # the loss panel
    assert "val loss 3.9000" in fig.layout.title.text


def test_lr_figure_draws_the_schedule_and_the_runs_rates():
    from workbench.schedule import lr_curve
    from workbench.spec import load_spec

    train = load_spec({"train": {"steps": 50, "lr": 1e-3, "schedule": "cosine", "warmup_steps": 5, "min_lr": 1e-4}}).train
    fig = figures.lr_figure(train)
    assert list(fig.data[0].x) == list(range(1, 51)) and list(fig.data[0].y) == pytest.approx(lr_curve(train))
    assert "cosine" in fig.layout.title.text and "warmup 5" in fig.layout.title.text
    ran = figures.lr_figure(train, [{"event": "step", "step": 1, "loss": 1.0, "lr": 2e-4}])
    assert list(ran.data[1].y) == [2e-4]
    big = load_spec({"train": {"steps": 10**7, "schedule": "wsd"}}).train
    assert len(figures.lr_figure(big).data[0].x) <= 402  # sampled, not one point per step


def test_earlier_runs_have_a_legend_and_the_charts_follow_the_page_theme():
    events = [{"event": "step", "step": 1, "loss": 2.0, "tokens_per_s": 10.0, "step_time_s": 0.1}]
    fig = figures.run_figure(events, history=[{"label": "run 1", "events": events},
                                              {"label": "run 2", "events": events}])
    past = [t for t in fig.data if t.name in ("run 1", "run 2")]  # loss, tokens/s and step time of each
    assert [t.showlegend for t in past] == [True, False, False] * 2
    assert past[0].hovertemplate.startswith("run 1 (earlier runs)")  # the group: in the hover, not a legend title
    # the legend at the foot, across the figure: above the panels it lay over their titles (#34)
    assert (fig.layout.legend.yref, fig.layout.legend.y, fig.layout.legend.orientation) == ("container", 0, "h")
    assert fig.layout.paper_bgcolor == fig.layout.plot_bgcolor == "rgba(0,0,0,0)"
    assert fig.layout.modebar.orientation == "v"
