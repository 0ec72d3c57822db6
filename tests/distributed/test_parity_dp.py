"""Data-parallel family on 2 gloo ranks: every ZeRO stage, accumulation, activation checkpointing
and offload reproduce the single-process fp32 run (losses and final weights); mixed precision
stays within its documented tolerance; memory events show the sharding."""
import math

import pytest
import torch

from tests.helpers.events import final_state, losses, measured, of_one_attempt
from tests.helpers.reference import reference_run
from tests.helpers.state import assert_same_state
from workbench import build_model
from workbench.runtime.loop import train_with_state

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

# 2 micro-batches per rank on dp=2 (4 in the single-process reference): gradient accumulation.
BASE = {"model": {"preset": "gpt-tiny"}, "train": {"steps": 5, "global_batch": 8, "micro_batch": 2, "lr": 3e-3}}
CASES = {
    "zero0-every-2": {"zero": 0, "activation_checkpointing": "full", "checkpoint_every": 2},
    "zero1-full": {"zero": 1, "activation_checkpointing": "full"},
    "zero2": {"zero": 2},  # gpt-tiny's 4 blocks in one FSDP2 unit (bucket_mb 25)
    "zero2-unit-per-block": {"zero": 2, "bucket_mb": 0.1},  # a block (0.19 MiB of fp32 gradient) per unit
    "zero3-two-block-units": {"zero": 3, "bucket_mb": 0.4},
    "zero3-full": {"zero": 3, "activation_checkpointing": "full"},
    "zero1-nvme": {"zero": 1, "offload": "nvme"},
    "zero3-cpu": {"zero": 3, "offload": "cpu"},
    "zero3-clip": {"zero": 3},  # with gradient clipping: the norm is summed over the shards
    "zero1-clip": {"zero": 1},
}
CLIP = {"grad_clip": 0.5}  # below the gradient norm of the first steps: clipping is active


def spec_for(layout=None, precision=None, tmp=None, train_extra=None):
    spec = {**BASE, "train": {**BASE["train"], **(train_extra or {})}, "layout": {"dp": 2, **(layout or {})}}
    if tmp is not None and spec["layout"].get("offload") == "nvme":
        spec["layout"]["nvme_path"] = str(tmp)
    if precision:
        spec["precision"] = precision
    return spec


def _reference(train_extra):
    ref = reference_run({**BASE, "train": {**BASE["train"], **train_extra}}, gather_state=True)
    return ref.losses(), ref.state


@pytest.fixture(scope="module")
def reference():
    return _reference({})


@pytest.fixture(scope="module")
def reference_clip():
    return _reference(CLIP)


@pytest.fixture(scope="module")
def runs(spawn_pools, tmp_path_factory):
    """Each case's events, run once per module (the memory test reuses them)."""
    done = {}

    def run(name):
        if name not in done:
            tmp = tmp_path_factory.mktemp(name)
            extra = CLIP if name.endswith("-clip") else None
            spec = spec_for(CASES[name], tmp=tmp, train_extra=extra)
            done[name] = spawn_pools.get(2).run(spec, fn=train_with_state, timeout_s=240)
        return done[name]

    return run


@pytest.mark.parametrize("name", list(CASES))
def test_layout_reproduces_single_process(name, runs, request):
    ref_losses, ref_state = request.getfixturevalue("reference_clip" if name.endswith("-clip") else "reference")
    events = runs(name)
    torch.testing.assert_close(losses(events), ref_losses, rtol=1e-4, atol=0)
    state = final_state(events)
    assert set(state) == set(ref_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")
    assert [e for e in events if e["event"] == "end"] == [{"event": "end", "status": "completed", "step": 5}]
    if name.endswith("-clip"):  # clipping really acted
        assert ref_losses[-1] != request.getfixturevalue("reference")[0][-1]
    if name == "zero3-cpu":  # CPU-only machine: the run says the offload does nothing here
        assert any(e["event"] == "note" and "no-op" in e["message"] for e in events)


def test_memory_events_show_the_sharding(runs):
    num = sum(p.numel() for p in build_model(BASE).parameters())
    half = math.ceil(num / 2)
    z0, z1, z3 = measured(runs("zero0-every-2")), measured(runs("zero1-full")), measured(runs("zero3-full"))
    assert z0["params"] == z0["grads"] == 4 * num and z0["master"] == 0
    # zero=1: the flat fp32 master and both Adam moments of exactly half the parameters.
    assert (z1["params"], z1["master"], z1["optimizer"]) == (4 * num, 4 * half, 8 * half)
    # zero=3: params, grads and optimizer are ~1/2 of zero=0's (a little padding per shard).
    for key in ("params", "grads", "optimizer"):
        assert 0.49 < z3[key] / z0[key] < 0.52, (key, z3[key], z0[key])
    zero0_states = z0["params"] + z0["grads"] + z0["optimizer"]
    assert 0.49 < (z3["params"] + z3["grads"] + z3["optimizer"]) / zero0_states < 0.52
    nvme = measured(runs("zero1-nvme"))
    assert nvme["master"] == nvme["optimizer"] == 0
    assert (nvme["master_on_disk"], nvme["optimizer_on_disk"]) == (4 * half, 8 * half)
    assert 0 < nvme["offload_staging"] <= 3 * 4 * half / 4  # staging: a few chunks, not the state


# Mixed precision against the fp32 reference: bf16 rounds to 8 mantissa bits, fp16 to 11.
MIXED = {
    "bf16-zero3": ({"zero": 3}, {"dtype": "bf16"}, 2e-2),
    "fp16-zero1": ({"zero": 1}, {"dtype": "fp16"}, 5e-3),
}


@pytest.mark.parametrize("name", list(MIXED))
def test_mixed_precision_stays_close(name, pool2, reference):
    layout, precision, rtol = MIXED[name]
    events = pool2.run(spec_for(layout, precision), fn=train_with_state, timeout_s=240)
    torch.testing.assert_close(losses(events), reference[0], rtol=rtol, atol=0)
    state, ref_state = final_state(events), reference[1]
    drift = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
    assert drift < 0.05, drift  # lr 3e-3 x 5 steps moves weights by ~1.5e-2: same direction, same size
    m = measured(events)
    if layout["zero"] == 3:  # FSDP2 mixed precision: the fp32 shards are the master
        assert m["params"] == 0 and m["master"] > 0
    else:  # zero=1: fp16 parameters, fp32 master and moments of half the parameters
        assert m["master"] * 2 == m["optimizer"] and m["params"] * 2 > m["master"] * 1.9


def test_fp16_overflow_skips_the_step_and_lowers_the_scale(pool2):
    # A loss scale far beyond fp16's range: the first steps overflow, are skipped, and halve the scale.
    spec = spec_for({"zero": 3}, {"dtype": "fp16", "initial_loss_scale": 2.0**40})
    steps = of_one_attempt(pool2.run(spec, timeout_s=240))
    assert steps[0]["skipped"] is True and steps[0]["loss_scale"] == 2.0**40
    assert steps[1]["loss_scale"] == 2.0**39
    assert all(b["loss_scale"] == a["loss_scale"] / 2 for a, b in zip(steps, steps[1:]) if a["skipped"])


def _stepped_master(params, group, steps=3):
    """A MasterOptimizer over `params` after `steps` adamw steps on fixed gradients."""
    from workbench.parallel.master import MasterOptimizer, MemoryStore
    from workbench.parallel.step import functional_update

    update, moments = functional_update("adamw", lr=1e-2, weight_decay=0.1)
    master = MasterOptimizer(params, group, MemoryStore, chunk=50)
    master.bind(moments)
    for k in range(steps):
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, 0.1 * (i + 1) * (-1) ** k)
        master.step(update, 1.0)
    return master


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((13, 7), (5,), (101,))]


def _save_zero1_master(checkpoint_dir, sink):
    """On 2 ranks: zero=1 master (half the flat range each), saved with DCP."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    params = _params(0)
    master = _stepped_master(params, mesh.get_group())
    dcp.save({"master": master}, checkpoint_id=checkpoint_dir)
    sink({"event": "params", "rank": dist.get_rank(), "values": [p.detach().clone() for p in params]})


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_zero1_master_checkpoint_reshards_to_one_rank(pool2, tmp_path):
    import torch.distributed.checkpoint as dcp

    ckpt = str(tmp_path / "ckpt")
    events = pool2.run(ckpt, fn=_save_zero1_master, timeout_s=120)
    dp2_params = [e["values"] for e in events if e["event"] == "params"]
    single = _stepped_master(_params(0), None)  # the same steps, unsharded, in this process
    loaded_params = _params(7)
    loaded = _stepped_master(loaded_params, None, steps=0)
    dcp.load({"master": loaded}, checkpoint_id=ckpt)
    assert loaded.num_steps == 3
    assert_same_state(loaded.state_dict(), single.state_dict())
    for values in dp2_params:  # both dp ranks ended with the single-process weights
        for a, b in zip(values, single.flat.params):
            assert torch.equal(a, b)
    for a, b in zip(loaded_params, single.flat.params):
        assert torch.equal(a, b)
