"""bench/gpu/run_all.py on the CUDA devices present, with a tiny model: every arm that can run does,
its allocator figures are consistent, and with one GPU zero3/tp say they need two."""
import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def test_run_all_on_cuda(tmp_path):
    from bench.gpu import run_all

    out = tmp_path / "gpu.json"
    run_all.main(["--device", "cuda", "--preset", "gpt-tiny", "--steps", "6", "--warmup", "2", "--reps", "1",
                  "--global-batch", "4", "--micro-batch", "2", "--calibrate", "quick", "--out", str(out), "--no-doc"])
    arms = json.loads(out.read_text())["arms"]
    single = arms["single"]
    assert single["status"] == "ok", single
    runtime = single["variants"]["runtime"]
    assert runtime["mfu"]["median"] > 0 and runtime["reserved_gib"] >= runtime["peak_gib"] > 0
    assert arms["calibrate"]["status"] == "ok" and arms["calibrate"]["profile"]["device"] != "cpu", arms["calibrate"]
    for name in ("ckpt", "llama"):
        a = arms[name]
        assert a["status"] == "ok" and a["step_time_s"]["predicted_calibrated"] > 0, a
        assert 0.5 < a["memory"][0]["measured_over_predicted"] < 2, (name, a["memory"])
    if torch.cuda.device_count() < 2:
        for name in ("zero3", "tp"):
            assert arms[name]["status"] == "skipped" and arms[name]["reason"].startswith("needs >= 2 GPUs")
        return
    for name in ("zero3", "tp"):
        a = arms[name]
        assert a["status"] == "ok", a
        assert a["mfu"] > 0 and a["predicted"]["mfu"] > 0
        for m in a["memory"]:
            assert m["reserved"] >= m["allocated_peak"] > 0
            assert 0.5 < m["measured_over_predicted"] < 2, (name, m)
