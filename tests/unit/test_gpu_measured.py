"""The memory and step-time models against what a real GPU measured: bench/results/gpu.json, written
by bench/gpu/run_all.py on a lent H200 (a device no constant was fitted on: docs/planning.md). Each
prediction is recomputed here with today's models for exactly the spec each arm ran, so a change to
either model that moves it away from the measurement fails here, without a GPU."""
import json

import pytest

from bench.gpu.repredict import RESULT, repredict


def _arms() -> dict:
    result = repredict(json.loads(RESULT.read_text()))
    assert result["config"]["catalog_gpu"] == "h200" and result["machine"]["gpu"] == "NVIDIA H200"
    return {n: a for n, a in result["arms"].items() if a["status"] == "ok" and "step_time_s" in a}


def test_gpu_result_has_the_one_gpu_arms():
    assert set(_arms()) == {"single", "ckpt", "llama"}


@pytest.mark.parametrize("name", ["single", "ckpt", "llama"])
def test_allocated_peak_within_10_percent_of_the_h200s(name):
    a = _arms()[name]
    if "variants" in a:
        ratio = a["variants"]["runtime"]["peak_gib"] / a["predicted_peak_gib"]
    else:
        ratio = a["memory"][0]["measured_over_predicted"]
    assert 0.9 <= ratio <= 1.1, (name, ratio)


@pytest.mark.parametrize("name", ["single", "ckpt", "llama"])
def test_catalog_step_time_within_25_percent_of_the_h200s(name):
    st = _arms()[name]["step_time_s"]
    assert 0.8 <= st["measured_over_predicted"] <= 1.25, (name, st)
    assert 0.8 <= st["measured_over_calibrated"] <= 1.25, (name, st)
