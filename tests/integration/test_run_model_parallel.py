"""`workbench run` on the embedded local Ray cluster accepts a tensor x pipeline layout and gives
the single-process loss curve; unsupported combinations are refused before any worker starts."""
import subprocess
import sys

import pytest
import torch

import workbench
from tests.helpers.reference import reference_run

CLI = [sys.executable, "-m", "workbench.cli"]
SPEC = {"name": "tp2-pp2", "model": {"preset": "gpt-tiny"}, "data": {"source": "synthetic", "seed": 0},
        "train": {"steps": 4, "global_batch": 8, "micro_batch": 2, "lr": 3e-3},
        "layout": {"tp": 2, "pp": 2, "pp_schedule": "interleaved-1f1b", "sequence_parallel": True},
        "resources": {"gpu": "cpu", "gpus_per_node": 4}}


@pytest.mark.ray
@pytest.mark.slow  # tp2 x pp2 parity itself is a fast gloo test (test_parity_3d.py); this is the Ray route
@pytest.mark.timeout(420)
def test_tp2_pp2_through_ray_matches_single_process():
    result = workbench.run(SPEC, progress=False)
    assert result.status == "completed"
    single = {**SPEC, "layout": {}, "resources": {"gpu": "cpu", "gpus_per_node": 1}}
    torch.testing.assert_close(result.losses, reference_run(single).losses(), rtol=1e-4, atol=0)
    assert {e["rank"] for e in result.events if e["event"] == "timeline"} == {0, 1, 2, 3}


@pytest.mark.timeout(120)
def test_unsupported_combination_is_refused_before_any_worker():
    proc = subprocess.run(CLI + ["run", "examples/pp2-1f1b.yaml", "--set", "layout.dp=2", "--set", "layout.zero=3",
                                 "--set", "layout.pp_schedule=zero-bubble", "--set", "resources.gpus_per_node=4"],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "zero=3 with pp_schedule=zero-bubble" in proc.stderr and "Use zero=2" in proc.stderr
