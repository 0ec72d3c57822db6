"""Parallelism: the facts each layout implies, written once and read by the memory model, the
step-time model, the planner, validate and the runtime (which tests/distributed/
test_parallelism_runtime.py holds to these same facts)."""
import pytest

from workbench.memory import Layout, layout_from_spec
from workbench.parallelism import PIPELINE_SCHEDULES, Parallelism
from workbench.spec import LayoutSpec, load_spec

# layout (spec keys + dtype) -> the facts it implies
CASES = [
    ({}, dict(world_size=1, fsdp=False, needs_master=False, params_are_master=False, master_sharded=False,
              grad_sync="none", param_dtype="fp32", chunks=1, num_stages=1, offload_to=None, loss_parallel=False)),
    ({"dtype": "bf16"}, dict(needs_master=True, master_sharded=False, param_dtype="bf16", compute_dtype="bf16")),
    ({"dp": 4}, dict(world_size=4, grad_sync="ddp", needs_master=False, shards_optimizer_state=False)),
    ({"dp": 4, "zero": 1}, dict(needs_master=True, master_sharded=True, shards_optimizer_state=True,
                                param_dtype="fp32", grad_sync="ddp", fsdp=False)),
    ({"dp": 2, "zero": 1, "offload": "nvme"}, dict(needs_master=True, master_sharded=True, offload_to="files")),
    ({"offload": "nvme"}, dict(needs_master=True, master_sharded=False, offload_to="files")),
    ({"dp": 2, "zero": 2, "dtype": "bf16"}, dict(fsdp=True, reshard_after_forward=False, params_are_master=True,
                                                 needs_master=False, param_dtype="fp32", grad_sync="fsdp")),
    ({"dp": 2, "zero": 3}, dict(fsdp=True, reshard_after_forward=True, params_are_master=False, needs_master=False,
                                init_on_host=False)),
    ({"dp": 2, "zero": 3, "offload": "cpu", "dtype": "fp16"}, dict(init_on_host=True, offload_to="host memory",
                                                                   params_are_master=True)),
    ({"dp": 2, "tp": 2}, dict(world_size=4, grad_sync="all-reduce", loss_parallel=True)),
    ({"dp": 2, "pp": 2, "zero": 1, "dtype": "fp16"}, dict(grad_sync="all-reduce", master_sharded=True)),
    ({"pp": 4, "pp_schedule": "1f1b", "virtual_stages": 3}, dict(multi_stage=False, chunks=1, num_stages=4)),
    ({"pp": 2, "pp_schedule": "interleaved-1f1b"}, dict(multi_stage=True, chunks=2, num_stages=4)),
    ({"pp": 2, "pp_schedule": "zero-bubble"}, dict(multi_stage=True, chunks=2, num_stages=4)),
    ({"pp": 1, "pp_schedule": "zero-bubble"}, dict(multi_stage=False, chunks=1, num_stages=1)),
    ({"activation_checkpointing": "selective"}, dict(checkpointing=True)),
]


def _spec(knobs: dict):
    knobs = dict(knobs)
    dtype = knobs.pop("dtype", "fp32")
    world = knobs.get("dp", 1) * knobs.get("tp", 1) * knobs.get("pp", 1)
    return load_spec({"model": {"preset": "gpt-tiny"}, "layout": knobs, "precision": {"dtype": dtype},
                      "train": {"global_batch": 8 * world, "micro_batch": 1, "steps": 2},
                      "resources": {"gpus_per_node": world}})


@pytest.mark.parametrize("knobs,facts", CASES, ids=[str(k) for k, _ in CASES])
def test_facts_per_layout(knobs, facts):
    par = Parallelism.from_spec(_spec(knobs))
    got = par.facts()
    assert {k: got[k] for k in facts} == facts


def test_from_spec_keeps_every_knob():
    spec = _spec({"dp": 2, "tp": 2, "zero": 1, "offload": "nvme", "sequence_parallel": True,
                  "activation_checkpointing": "full", "checkpoint_every": 2, "dtype": "fp16"})
    par = Parallelism.from_spec(spec)
    lay = spec.layout
    assert (par.dp, par.tp, par.pp, par.zero, par.offload, par.sequence_parallel, par.dtype) == \
        (lay.dp, lay.tp, lay.pp, lay.zero, lay.offload, lay.sequence_parallel, spec.precision.dtype)
    assert (par.activation_checkpointing, par.checkpoint_every, par.nvme_path, par.bucket_mb) == \
        ("full", 2, lay.nvme_path, lay.bucket_mb)


def test_the_memory_layout_is_the_same_parallelism():
    """The memory model's Layout extends Parallelism: built from a spec, its facts are the spec's."""
    spec = _spec({"dp": 2, "pp": 2, "zero": 2, "pp_schedule": "interleaved-1f1b", "dtype": "bf16"})
    lay = layout_from_spec(spec)
    assert isinstance(lay, Parallelism)
    assert lay.facts() == Parallelism.from_spec(spec).facts()
    assert Layout(pp=2, pp_schedule="zero-bubble", virtual_stages=4).chunks == 4


def test_needs_a_master_exactly_where_the_memory_model_counts_one():
    """The memory model's master bytes come from the same fact: nonzero iff a master exists apart
    from the parameters (ours, or FSDP2's fp32 shard under mixed precision)."""
    from workbench.memory import estimate_memory

    for knobs in [k for k, _ in CASES if "pp_schedule" not in k]:
        spec = _spec(knobs)
        par = Parallelism.from_spec(spec)
        master = estimate_memory(spec).per_rank[0].stage.master
        offloaded = par.offload_to is not None  # cpu/nvme move the master off the device
        assert (master > 0) == ((par.needs_master or par.params_are_master) and not offloaded), knobs


def test_schedule_names_are_the_specs():
    assert PIPELINE_SCHEDULES == ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
    assert LayoutSpec.model_fields["pp_schedule"].annotation.__args__ == PIPELINE_SCHEDULES
