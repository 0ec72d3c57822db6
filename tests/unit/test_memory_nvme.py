"""offload=nvme in the memory model, the planner and the file-traffic model (issue 37): host and
disk bytes per rank are separate quantities; the planner turns to ZeRO-Infinity only when nothing
else fits."""
import math

import pytest

from workbench import build_model
from workbench.memory import estimate_memory
from workbench.memory.nvme import nvme_traffic, nvme_transfer_s
from workbench.planner import plan

TINY = {"model": {"preset": "gpt-tiny"}, "train": {"global_batch": 8, "micro_batch": 2}}


@pytest.mark.parametrize("zero,dtype", [(2, "fp32"), (3, "fp32"), (3, "bf16")])
def test_zero_infinity_keeps_shards_and_moments_in_files_and_gradients_in_host_memory(zero, dtype):
    spec = {**TINY, "layout": {"dp": 2, "zero": zero, "offload": "nvme"}, "precision": {"dtype": dtype}}
    rank = estimate_memory(spec).to_dict()["per_rank"][0]
    shard = math.ceil(sum(p.numel() for p in build_model(TINY).parameters()) / 2)
    assert rank["params"] == rank["grads"] == rank["master"] == rank["optimizer"] == 0  # nothing on the device
    assert abs(rank["disk_bytes"] - 12 * shard) < 0.01 * 12 * shard  # fp32 shard + 2 moments
    assert rank["host_bytes"] > 4 * shard * 0.99  # the fp32 gradient shard (CPUOffloadPolicy) + staging
    assert rank["offloaded_bytes"] == rank["host_bytes"] + rank["disk_bytes"]


def test_zero1_nvme_has_no_host_bytes_and_its_range_on_disk():
    rank = estimate_memory({**TINY, "layout": {"dp": 2, "zero": 1, "offload": "nvme"}}).to_dict()["per_rank"][0]
    shard = math.ceil(sum(p.numel() for p in build_model(TINY).parameters()) / 2)
    assert rank["disk_bytes"] == 12 * shard and rank["host_bytes"] == 0


def test_planner_turns_to_nvme_only_when_nothing_else_fits():
    big = {"model": {"preset": "llama-70b", "seq_len": 1024}, "train": {"global_batch": 8, "micro_batch": 1},
           "resources": {"gpu": "a100-80gb", "gpus_per_node": 8}, "precision": {"dtype": "bf16"}}
    result = plan(big, top=3)
    best = result.candidates[0]
    assert best.fits and best.runnable and best.layout["offload"] == "nvme" and best.layout["zero"] >= 2
    assert any("offload=nvme" in n for n in result.notes)
    small = plan({**big, "model": {"preset": "llama-7b", "seq_len": 1024}}, top=5)
    assert small.candidates[0].fits and all(c.layout["offload"] != "nvme" for c in small.candidates)


def test_file_traffic_per_step():
    # zero 3 reads the shard for forward and for backward's re-gather and for the step; writes it once.
    t3, t2, t1 = nvme_traffic(3, 1000, "adamw"), nvme_traffic(2, 1000, "adamw"), nvme_traffic(1, 1000, "adamw")
    assert (t3.read_bytes, t3.write_bytes) == (20_000, 12_000)
    assert (t2.read_bytes, t2.write_bytes) == (16_000, 12_000)
    assert (t1.read_bytes, t1.write_bytes) == (12_000, 12_000)

    class Lay:
        offload, zero, optimizer = "nvme", 3, "adamw"

    class Dev:
        nvme_bw = 1e9

    assert nvme_transfer_s(Lay, 1e9, Dev) == pytest.approx(32.0)
