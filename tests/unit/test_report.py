"""The HTML run report: self-contained (plotly inlined, nothing fetched), with the run's numbers."""
import json
import re

import pytest

pytest.importorskip("plotly")

from workbench.report.run_report import summarize, write_report  # noqa: E402

SPEC = {"name": "report-test", "model": {"preset": "gpt-tiny"}, "train": {"steps": 4, "global_batch": 8,
        "micro_batch": 4}, "layout": {"dp": 2}, "resources": {"gpu": "cpu"}}


def run_events():
    ev = [{"event": "step", "step": k, "loss": 5.5 - k, "tokens_per_s": [400.0, 1000.0, 1200.0, 1100.0][k - 1],
           "step_time_s": [2.0, 0.5, 0.4, 0.45][k - 1]} for k in range(1, 5)]
    ev += [{"event": "memory", "step": 4, "rank": r, "coords": {"dp": r, "tp": 0, "pp": 0},
            "measured": {"params": 1 << 20, "grads": 1 << 20, "master": 0, "optimizer": 2 << 20,
                         "activations": 3 << 20, "peak": 7 << 20}} for r in (0, 1)]
    ev += [{"event": "checkpoint", "step": 4, "uri": "/tmp/ckpt/4"}, {"event": "end", "status": "completed", "step": 4}]
    return ev


def test_summary_skips_the_warm_up_step_in_medians():
    s = summarize(run_events())
    assert s["status"] == "completed" and s["steps"] == 4
    assert s["first_loss"] == 4.5 and s["final_loss"] == 1.5
    assert s["tokens_per_s"] == 1100.0 and s["step_time_s"] == 0.45  # medians of steps 2-4
    assert s["checkpoints"] == 1 and s["restarts"] == 0


def test_report_is_self_contained_and_shows_the_run(tmp_path):
    path = write_report(run_events(), SPEC, tmp_path / "out" / "run.html")
    text = path.read_text()
    assert text.startswith("<!DOCTYPE html>")
    # plotly.js is inlined exactly once; no script or stylesheet is loaded from anywhere
    assert text.count("plotly.js v") >= 1
    assert not re.search(r"<script[^>]+src=", text)
    assert not re.search(r"<link[^>]+href=", text)
    assert "report-test" in text and "1.5000" in text and "1,100 tokens/s" in text
    # the figures carry the real data: loss per step and the measured memory per rank
    specs = [json.loads(m) for m in re.findall(r"Plotly\.newPlot\(\s*\"[^\"]+\",\s*(\[.*?\]),\s*\{", text, re.S)]
    loss = specs[0][0]
    assert loss["x"] == [1, 2, 3, 4] and loss["y"] == [4.5, 3.5, 2.5, 1.5]
    assert len(specs) == 2  # training and memory; no timeline without timeline events
    assert "name: report-test" in text  # the spec as YAML


def test_report_includes_a_pipeline_timeline_when_the_run_recorded_one(tmp_path):
    ev = run_events()
    ev.insert(-1, {"event": "timeline", "step": 4, "rank": 0,
                   "items": [{"microbatch": 0, "kind": "F", "start_s": 0.0, "end_s": 0.1}]})
    text = write_report(ev, SPEC, tmp_path / "run.html").read_text()
    assert "Pipeline timeline" in text


def test_report_plots_the_held_out_loss_and_the_learning_rate(tmp_path):
    ev = run_events()
    ev.insert(-2, {"event": "eval", "step": 4, "loss": 1.75, "perplexity": 5.75})
    spec = {**SPEC, "train": {**SPEC["train"], "schedule": "cosine", "warmup_steps": 1, "min_lr": 0.0}}
    text = write_report(ev, spec, tmp_path / "run.html").read_text()
    specs = [json.loads(m) for m in re.findall(r"Plotly\.newPlot\(\s*\"[^\"]+\",\s*(\[.*?\]),\s*\{", text, re.S)]
    val = next(t for t in specs[0] if t["name"] == "val_loss")
    assert val["x"] == [4] and val["y"] == [1.75]
    assert "Learning rate" in text and "1.7500 (last eval)" in text
    lr = specs[-1][0]
    assert lr["x"] == [1, 2, 3, 4] and lr["y"][-1] == 0.0 and max(lr["y"]) == pytest.approx(3e-4)
