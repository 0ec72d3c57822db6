"""`workbench.run` accepts a sharded mixed-precision layout on the embedded local Ray cluster."""
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import workbench

pytestmark = [pytest.mark.ray, pytest.mark.timeout(400)]
CLI = [sys.executable, "-m", "workbench.cli"]


@pytest.mark.slow  # zero3 bf16 parity itself is a fast gloo test (test_parity_dp.py); this is the Ray route
def test_zero3_bf16_runs_through_ray():
    # In this process: it shares the embedded cluster with the other local-Ray tests (the CLI's own
    # path, a process and a cluster of its own, is test_run_local's).
    spec = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "zero3-bf16.yaml").read_text())
    spec["train"]["steps"] = 6
    events = workbench.run(spec, progress=False).events
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 7)) and steps[-1]["loss"] < steps[0]["loss"]
    memory = [e["measured"] for e in events if e["event"] == "memory" and e["step"] == 6]
    assert len(memory) == 2
    for m in memory:  # FSDP2 mixed precision: the fp32 shards are the master, Adam moments twice its size
        assert m["params"] == 0 and 1.9 < m["optimizer"] / m["master"] < 2.1
    assert events[-1] == {"event": "end", "status": "completed", "step": 6}


def test_unsupported_layout_is_refused_before_any_worker():
    proc = subprocess.run(CLI + ["run", "examples/zero3-bf16.yaml", "--set", "layout.offload=cpu",
                                 "--set", "layout.zero=1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "offload=cpu with zero=1" in proc.stderr and "Use zero=2 or zero=3 with offload=cpu" in proc.stderr
