"""The per-rank loop on one CUDA device: same code path, allocator-measured peak."""
import pytest

from workbench.runtime.loop import train

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_loop_trains_on_cuda(dtype):
    events = []
    train({"model": {"preset": "gpt-tiny"}, "train": {"steps": 5}, "precision": {"dtype": dtype},
           "resources": {"gpu": "h100-80gb"}}, events.append)
    steps = [e for e in events if e["event"] == "step"]
    assert steps[-1]["loss"] < steps[0]["loss"]
    peak = [e["measured"]["peak"] for e in events if e["event"] == "memory"]
    assert min(peak) > 0
