"""The fp32-master paths on one CUDA device: fp16 with loss scaling, nvme offload (CUDA grads,
host staging), activation checkpointing; each tracks the fp32 run."""
import pytest
import torch

from tests.helpers.events import losses
from workbench.runtime.loop import train

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
BASE = {"model": {"preset": "gpt-tiny"}, "train": {"steps": 5, "global_batch": 8, "micro_batch": 4, "lr": 3e-3},
        "resources": {"gpu": "h100-80gb"}}


def run(extra, tmp_path=None):
    layout = dict(extra.get("layout", {}))
    if layout.get("offload") == "nvme":
        layout["nvme_path"] = str(tmp_path)
    events = []
    train({**BASE, "layout": layout, "precision": extra.get("precision", {"dtype": "fp32"})}, events.append)
    return losses(events), [e["measured"] for e in events if e["event"] == "memory"]


@pytest.mark.parametrize("extra,rtol", [
    ({"precision": {"dtype": "fp16"}}, 5e-3),
    ({"layout": {"offload": "nvme", "activation_checkpointing": "full"}}, 1e-4),
    ({"layout": {"offload": "nvme"}, "precision": {"dtype": "bf16"}}, 2e-2),
])
def test_master_paths_track_fp32_on_cuda(extra, rtol, tmp_path):
    ref, _ = run({})
    got, memory = run(extra, tmp_path)
    torch.testing.assert_close(got, ref, rtol=rtol, atol=0)
    if extra.get("layout", {}).get("offload") == "nvme":
        assert memory[-1]["optimizer"] == 0 and memory[-1]["optimizer_on_disk"] > 0
