"""Tensor and pipeline parallel on 2 gloo ranks: tp2 (with and without sequence parallel) and pp2
with every schedule reproduce the single-process fp32 run (losses and final weights), and the
pipeline's measured timeline and activations show what each schedule does."""
import pytest
import torch

from tests.helpers.events import final_state, losses
from tests.helpers.marks import fast_first
from tests.helpers.reference import reference_run
from workbench.runtime.loop import train, train_with_state

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

# 4 micro-batches per step (dp=1): each pipeline schedule has pp x 2 micro-batches to overlap.
BASE = {"model": {"preset": "gpt-tiny"}, "train": {"steps": 5, "global_batch": 8, "micro_batch": 2, "lr": 3e-3}}
CASES = {
    "tp2": {"tp": 2},
    "tp2-sp": {"tp": 2, "sequence_parallel": True},
    "pp2-gpipe": {"pp": 2, "pp_schedule": "gpipe"},
    "pp2-1f1b": {"pp": 2, "pp_schedule": "1f1b"},
    "pp2-interleaved": {"pp": 2, "pp_schedule": "interleaved-1f1b", "virtual_stages": 2},
    "pp2-zero-bubble": {"pp": 2, "pp_schedule": "zero-bubble", "virtual_stages": 2},
}


def assert_matches(events, reference, name):
    ref_losses, ref_state = reference
    torch.testing.assert_close(losses(events), ref_losses, rtol=1e-4, atol=0)
    state = final_state(events)
    assert set(state) == set(ref_state)
    # Compared by norm: Adam divides by sqrt(v), so an element whose gradient is ~0 turns a
    # TP reduction's different summation order into a visible step on that element alone (seen:
    # 1 of 16384 elements off by 7e-5, about lr/40); a wrong weight moves the whole tensor. The
    # norm floor of 1 keeps near-zero tensors (k's bias has a ~0 gradient) to an absolute bound.
    for key, value in ref_state.items():
        err = float((state[key] - value).norm() / value.norm().clamp_min(1.0))
        assert err < 1e-4, f"{name}: {key}: relative error {err:.2e}"
    assert [e for e in events if e["event"] == "end"] == [{"event": "end", "status": "completed", "step": 5}]


@pytest.fixture(scope="module")
def reference():
    ref = reference_run(BASE, gather_state=True)
    return ref.losses(), ref.state


@pytest.fixture(scope="module")
def runs(spawn_pools):
    done = {}

    def run(name):
        if name not in done:
            spec = {**BASE, "layout": CASES[name]}
            done[name] = spawn_pools.get(2).run(spec, fn=train_with_state, timeout_s=240)
        return done[name]

    return run


@pytest.mark.parametrize("name", list(CASES))
def test_layout_reproduces_single_process(name, runs, reference):
    assert_matches(runs(name), reference, name)


# GPT-2's tied embeddings: the head uses the embedding's weight. A layout must keep the one
# parameter (sharded over the vocabulary for both uses under TP), not train an untied model;
# a pipeline keeps a copy on the last stage whose gradient is summed with the embedding's.
TIED = {**BASE, "model": {"preset": "gpt-tiny", "tie_embeddings": True}}
TIED_CASES = {  # name: (world, layout)
    "tp2-tied": (2, {"tp": 2}),
    "tp2-sp-tied": (2, {"tp": 2, "sequence_parallel": True}),
    **{f"pp2-{s}-tied": (2, {"pp": 2, "pp_schedule": s}) for s in ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")},
    "pp4-1f1b-tied": (4, {"pp": 4, "pp_schedule": "1f1b"}),  # first and last stage: a sub-group of pp
    "tp2-pp2-sp-tied": (4, {"tp": 2, "pp": 2, "sequence_parallel": True}),
    "dp2-pp2-zero3-tied": (4, {"dp": 2, "pp": 2, "zero": 3}),
}


@pytest.fixture(scope="module")
def tied_reference():
    ref = reference_run(TIED, gather_state=True)
    return ref.losses(), ref.state


@pytest.mark.parametrize("name", fast_first(TIED_CASES, ["tp2-sp-tied", "pp2-interleaved-1f1b-tied", "pp4-1f1b-tied",
                                                          "tp2-pp2-sp-tied", "dp2-pp2-zero3-tied"]))
def test_tied_embeddings_stay_tied(name, spawn_pools, tied_reference, reference):
    assert "head.weight" not in tied_reference[1]  # one parameter in the single process
    assert tied_reference[0][0] != pytest.approx(reference[0][0], rel=1e-4)  # and another model than untied
    world, layout = TIED_CASES[name]
    events = spawn_pools.get(world).run({**TIED, "layout": layout}, fn=train_with_state, timeout_s=240)
    assert_matches(events, tied_reference, name)


def test_tied_pipeline_clips_the_shared_gradient_once(spawn_pools):
    # Clipped every step: counting the last stage's copy in the norm would clip harder.
    spec = {**TIED, "train": {**TIED["train"], "grad_clip": 0.05}}
    ref = reference_run(spec, gather_state=True)
    events = spawn_pools.get(2).run({**spec, "layout": {"pp": 2}}, fn=train_with_state, timeout_s=240)
    assert_matches(events, (ref.losses(), ref.state), "pp2-tied-clipped")


def timeline(events, rank):
    (event,) = [e for e in events if e["event"] == "timeline" and e["rank"] == rank]
    return event


@pytest.mark.parametrize("name", ["pp2-1f1b", "pp2-zero-bubble"])
def test_timeline_has_every_micro_batch(name, runs):
    events = runs(name)
    for rank in (0, 1):
        event = timeline(events, rank)
        assert event["step"] == 2
        items = event["items"]
        kinds = {(i["stage"], i["microbatch"], i["kind"]) for i in items}
        stages = {i["stage"] for i in items}
        expected = {"F", "B", "W"} if name == "pp2-zero-bubble" else {"F", "B"}
        assert kinds == {(s, mb, k) for s in stages for mb in range(4) for k in expected}
        assert all(0 <= i["start_s"] <= i["end_s"] for i in items)
        # A micro-batch's backward on a stage starts after its forward there ended.
        ends = {(i["stage"], i["microbatch"]): i["end_s"] for i in items if i["kind"] == "F"}
        assert all(i["start_s"] >= ends[i["stage"], i["microbatch"]] for i in items if i["kind"] == "B")
    if name == "pp2-1f1b":  # 1F1B on the first stage: the second backward starts before the last forward
        items = timeline(events, 0)["items"]
        b1 = next(i for i in items if i["kind"] == "B" and i["microbatch"] == 0)
        f3 = next(i for i in items if i["kind"] == "F" and i["microbatch"] == 3)
        assert b1["start_s"] < f3["start_s"]


def peak_activations(events, rank):
    return max(e["measured"]["activations"] for e in events if e["event"] == "memory" and e["rank"] == rank)


def test_1f1b_holds_fewer_activations_than_gpipe(runs):
    # GPipe keeps all 4 micro-batches' activations on the first stage; 1F1B at most pp = 2.
    gpipe, one_f_one_b = peak_activations(runs("pp2-gpipe"), 0), peak_activations(runs("pp2-1f1b"), 0)
    assert one_f_one_b > 0
    assert gpipe == pytest.approx(2 * one_f_one_b, rel=0.05)


def test_sequence_parallel_saves_activations(runs):
    assert peak_activations(runs("tp2-sp"), 0) < peak_activations(runs("tp2"), 0)


# Mixed precision against the fp32 reference (the dp tests' tolerances): bf16 rounds to 8
# mantissa bits, fp16 to 11; fp32 master weights keep the update exact.
MIXED = {
    "pp2-1f1b-bf16": ({"pp": 2, "pp_schedule": "1f1b"}, {"dtype": "bf16"}, 2e-2),
    "pp2-interleaved-fp16": ({"pp": 2, "pp_schedule": "interleaved-1f1b"}, {"dtype": "fp16"}, 5e-3),
}


@pytest.mark.parametrize("name", list(MIXED))
def test_mixed_precision_pipeline_stays_close(name, spawn_pools, reference):
    layout, precision, rtol = MIXED[name]
    events = spawn_pools.get(2).run({**BASE, "layout": layout, "precision": precision}, timeout_s=240)
    torch.testing.assert_close(losses(events), reference[0], rtol=rtol, atol=0)
    steps = [e for e in events if e["event"] == "step"]
    if precision["dtype"] == "fp16":  # loss scaling is on, and no step overflowed here
        assert all(e["loss_scale"] > 1 and not e["skipped"] for e in steps)


def test_llama_tp2_sequence_parallel_with_grouped_kv_heads(spawn_pools):
    # RMSNorm under SequenceParallel, rotary embeddings, SwiGLU's w3, and 2 kv heads: 1 per rank.
    model = {"family": "llama", "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 256, "seq_len": 64}
    spec = {**BASE, "model": model, "train": {**BASE["train"], "steps": 3}}
    ref = reference_run(spec, gather_state=True)
    events = spawn_pools.get(2).run({**spec, "layout": {"tp": 2, "sequence_parallel": True}}, fn=train_with_state,
                                    timeout_s=240)
    torch.testing.assert_close(losses(events), ref.losses(), rtol=1e-4, atol=0)
    state = final_state(events)
    # atol 5e-5: Adam divides by sqrt(v), so an element whose gradient is ~0 turns the TP
    # all-reduce's different summation order into a visible step (seen: 1 of 16384, 2.2e-5).
    for key, value in ref.state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=5e-5, msg=lambda m, key=key: f"{key}: {m}")


def _count_collectives(spec, emit):
    """Train `spec`, then report how many collectives of each kind this rank issued (DTensor's and c10d's)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    kinds = {torch.ops._c10d_functional.all_reduce.default: "all_reduce", torch.ops.c10d.allreduce_.default: "all_reduce",
             torch.ops._c10d_functional.all_gather_into_tensor.default: "all_gather",
             torch.ops.c10d._allgather_base_.default: "all_gather",
             torch.ops._c10d_functional.reduce_scatter_tensor.default: "reduce_scatter",
             torch.ops.c10d._reduce_scatter_base_.default: "reduce_scatter"}
    counted = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in kinds:
                counted[kinds[func]] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        train(spec, emit)
    emit({"event": "collectives", "count": counted["all_reduce"], **counted})


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_tensor_parallel_all_reduces_twice_forward_and_twice_backward_per_block(family, pool2):
    # Megatron's count (and steptime.py's): per block, attention's and the MLP's row-parallel output
    # forward, and their column-parallel input backward, once each however many linears share the
    # input (wq/wk/wv; w1/w3). Two depths, one micro-batch: the difference is the blocks' share.
    def count(layers):
        model = {"family": family, "layers": layers, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 64}
        spec = {"model": model, "layout": {"tp": 2}, "train": {"steps": 1, "global_batch": 2, "micro_batch": 2}}
        (event, _) = [e for e in pool2.run(spec, fn=_count_collectives, timeout_s=240) if e["event"] == "collectives"]
        return event["count"]

    per_block = (count(4) - count(2)) / 2
    assert per_block == 4, f"{family}: {per_block} tp all-reduces per block and micro-batch, Megatron's count is 4"


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_sequence_parallel_sums_partial_gradients_once_per_step(family, pool2):
    # Per block and micro-batch: forward all-reduces attention's and the MLP's row-parallel outputs
    # (each rank keeps its sequence shard for autograd and the full rows beside it, from which the
    # next norm's full output is computed instead of all-gathered); backward all-reduces each
    # region's input gradient (gloo's reduce-scatter is one) together with the previous region's
    # saved shards, and computes the previous region's output gradient on the full rows, so no
    # region but the last all-gathers (sequence_parallel.BackwardRows). 4 collectives, as plain TP,
    # where Megatron's sequence parallel issues 10 (2 more all-gathers forward, 2 + 2 backward).
    # The gradients its norms (and row-parallel biases) get from one shard are summed over tp in one
    # all-reduce per step, however deep the model (DTensor's SequenceParallel all-reduced each norm
    # parameter's gradient on every micro-batch: 4 per GPT-2 block). Two depths, two micro-batches:
    # the difference is the blocks'.
    def per_block(dtype="fp32", **layout):
        def count(layers):
            model = {"family": family, "layers": layers, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 64}
            spec = {"model": model, "layout": {"tp": 2, "sequence_parallel": True, **layout},
                    "train": {"steps": 1, "global_batch": 4, "micro_batch": 2}, "precision": {"dtype": dtype}}
            (event, _) = [e for e in pool2.run(spec, fn=_count_collectives, timeout_s=240) if e["event"] == "collectives"]
            return event

        deep, shallow = count(4), count(2)
        got = {k: (deep[k] - shallow[k]) / (2 * 2) for k in ("all_reduce", "all_gather", "reduce_scatter")}
        return got["all_reduce"] + got["reduce_scatter"], got["all_gather"]

    assert per_block() == (4, 0), f"{family}: {per_block()}"
    assert per_block("bf16") == (4, 0), family  # the GPU default (autocast), here on gloo
    # recomputed: the forward's 2 all-reduces again and the block input's all-gather, and backward
    # all-gathers at each region's exit as without the backward rows
    assert per_block(activation_checkpointing="full") == (6, 3), family


def test_sequence_parallel_clips_the_summed_gradients(spawn_pools):
    # Clipped every step: the norm's partial gradients must be summed over tp before the global
    # norm is taken (a rank clipping its half would clip differently and drift from one process).
    spec = {**BASE, "train": {**BASE["train"], "grad_clip": 0.05}}
    ref = reference_run(spec, gather_state=True)
    events = spawn_pools.get(2).run({**spec, "layout": {"tp": 2, "sequence_parallel": True}}, fn=train_with_state,
                                    timeout_s=240)
    assert_matches(events, (ref.losses(), ref.state), "tp2-sp-clipped")
