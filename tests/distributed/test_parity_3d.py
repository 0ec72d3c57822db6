"""Combined layouts on 4 and 8 gloo ranks: dp x tp, dp x pp, tp x pp, ZeRO (FSDP2) with tp/pp,
and one 8-rank dp2 x tp2 x pp2, each reproducing the single-process fp32 run."""
import pytest
import torch
from test_parity_tp_pp import BASE, assert_matches

from tests.helpers.events import losses
from tests.helpers.marks import fast_first
from tests.helpers.reference import reference_run
from workbench.runtime.loop import train_with_state

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

CASES_4 = {
    "dp2-tp2": {"dp": 2, "tp": 2},
    "dp2-pp2-1f1b": {"dp": 2, "pp": 2, "pp_schedule": "1f1b"},
    "tp2-pp2-interleaved-sp": {"tp": 2, "pp": 2, "pp_schedule": "interleaved-1f1b", "sequence_parallel": True},
    "tp2-pp2-1f1b-full-ckpt": {"tp": 2, "pp": 2, "pp_schedule": "1f1b", "activation_checkpointing": "full"},
    "dp2-tp2-zero1": {"dp": 2, "tp": 2, "zero": 1},
    "dp2-tp2-zero3-sp": {"dp": 2, "tp": 2, "zero": 3, "sequence_parallel": True},  # FSDP2 x TP
    "dp2-pp2-zero2-zero-bubble": {"dp": 2, "pp": 2, "zero": 2, "pp_schedule": "zero-bubble"},
    "dp2-pp2-zero3-1f1b": {"dp": 2, "pp": 2, "zero": 3, "pp_schedule": "1f1b"},
    "dp2-tp2-zero1-nvme": {"dp": 2, "tp": 2, "zero": 1, "offload": "nvme"},
}


@pytest.fixture(scope="module")
def reference():
    ref = reference_run(BASE, gather_state=True)
    return ref.losses(), ref.state


@pytest.mark.parametrize("name", fast_first(CASES_4, ["dp2-tp2-zero1", "dp2-tp2-zero3-sp", "tp2-pp2-interleaved-sp",
                                                        "dp2-pp2-zero2-zero-bubble"]))
def test_4_rank_layout_reproduces_single_process(name, spawn_pools, reference, tmp_path):
    layout = {**CASES_4[name], **({"nvme_path": str(tmp_path)} if "nvme" in name else {})}
    events = spawn_pools.get(4).run({**BASE, "layout": layout}, fn=train_with_state, timeout_s=240)
    assert_matches(events, reference, name)
    coords = {tuple(e["coords"].values()) for e in events if e["event"] == "memory"}
    assert len(coords) == 4  # every rank reported its memory, at distinct mesh coordinates


def test_4_rank_fsdp_pipeline_in_bf16_stays_close(spawn_pools, reference):
    # FSDP2 MixedPrecisionPolicy (bf16 compute, fp32 shards as master) under a 1F1B pipeline.
    spec = {**BASE, "layout": {"dp": 2, "pp": 2, "zero": 2}, "precision": {"dtype": "bf16"}}
    events = spawn_pools.get(4).run(spec, timeout_s=240)
    torch.testing.assert_close(losses(events), reference[0], rtol=2e-2, atol=0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_8_rank_dp2_tp2_pp2(spawn_pools, reference):
    # 8 processes on a small machine: one thread each (SpawnPool's default), generous timeout.
    layout = {"dp": 2, "tp": 2, "pp": 2, "pp_schedule": "1f1b", "sequence_parallel": True}
    events = spawn_pools.get(8).run({**BASE, "layout": layout}, fn=train_with_state, timeout_s=480)
    assert_matches(events, reference, "dp2-tp2-pp2")
    assert {e["rank"] for e in events if e["event"] == "timeline"} == set(range(8))


@pytest.mark.parametrize("layout", [pytest.param({"dp": 2, "tp": 2}, marks=pytest.mark.slow),
                                    {"tp": 2, "pp": 2, "pp_schedule": "1f1b"},
                                    pytest.param({"dp": 2, "pp": 2, "zero": 3}, marks=pytest.mark.slow)],
                         ids=["dp2-tp2", "tp2-pp2", "dp2-pp2-zero3"])
def test_gradient_clipping_spans_tensor_and_pipeline_shards(layout, spawn_pools, reference):
    # A clip far below the gradient norm: every step is clipped, so a norm that missed the other
    # tp shards or pp stages would scale the update differently from the single process.
    spec = {**BASE, "train": {**BASE["train"], "grad_clip": 0.05}}
    ref = reference_run(spec, gather_state=True)
    assert ref.losses()[-1] != pytest.approx(reference[0][-1], rel=1e-4)  # clipping is active
    events = spawn_pools.get(4).run({**spec, "layout": layout}, fn=train_with_state, timeout_s=240)
    assert_matches(events, (ref.losses(), ref.state), "grad_clip")
