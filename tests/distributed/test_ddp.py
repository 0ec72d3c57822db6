"""DDP on 2 gloo ranks reproduces the single-process loss trajectory and final weights."""
import pytest
import torch

from tests.helpers.events import losses
from tests.helpers.reference import reference_run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

BASE = {"model": {"preset": "gpt-tiny"}, "train": {"steps": 6, "global_batch": 16, "micro_batch": 2, "lr": 3e-3}}


@pytest.fixture(scope="module")
def reference():
    return reference_run(BASE).losses()


def test_ddp_matches_single_process(pool2, reference):
    spec = {**BASE, "layout": {"dp": 2, "bucket_mb": 0.05}}  # small buckets: several all-reduces overlap backward
    events = pool2.run(spec)
    torch.testing.assert_close(losses(events), reference, rtol=1e-4, atol=0)
    assert reference[-1] < reference[0]
    end = [e for e in events if e["event"] == "end"]
    assert end == [{"event": "end", "status": "completed", "step": 6}]
    memory = [e for e in events if e["event"] == "memory" and e["step"] == 1]
    assert sorted(e["rank"] for e in memory) == [0, 1]
    m = memory[0]["measured"]
    assert set(m) >= {"params", "grads", "master", "optimizer", "activations", "peak"}
    assert 0 <= m["optimizer"] - 2 * m["params"] < 1024  # two Adam moments + step counters
    assert m["grads"] == m["params"] and m["activations"] > 0


def test_gradient_accumulation_is_invisible(pool2, reference):
    # dp=2 with one micro-batch per rank vs four: the same global batch, the same losses.
    events = pool2.run({**BASE, "layout": {"dp": 2}, "train": {**BASE["train"], "micro_batch": 8}})
    torch.testing.assert_close(losses(events), reference, rtol=1e-4, atol=0)
