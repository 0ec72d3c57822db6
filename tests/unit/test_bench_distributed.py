"""The multi-process benchmarks at tiny sizes on the session's shared 2-rank gloo pool, and the torchrun peer."""
import json

import pytest
import torch

from bench.common import tiny_spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # the benchmarks' harnesses: the whole suite keeps them from rotting


@pytest.fixture
def pool(spawn_pools):
    return spawn_pools.get(2)


@pytest.mark.timeout(180)
def test_memory_zero3_halves_state_and_matches_prediction(pool):
    from bench import bench_memory

    rows = {(r["dp"], r["zero"]): r for r in bench_memory.run(quick=True, pools={2: pool})["rows"]}
    full, sharded = rows[(2, 0)]["measured_state"], rows[(2, 3)]["measured_state"]
    assert sharded < 0.6 * full
    for r in rows.values():
        if isinstance(r["measured_state"], int):
            assert r["measured_state"] == pytest.approx(r["predicted_state"], rel=0.05)


@pytest.mark.timeout(180)
def test_pipeline_bubbles_are_measured(pool):
    from bench import bench_pipeline

    rows = bench_pipeline.run(quick=True, pool=pool)["rows"]
    assert {r["schedule"] for r in rows} == {"gpipe", "1f1b"}
    for r in rows:
        assert 0 <= r["measured"]["median"] < 1
        assert {i["kind"] for items in r["timeline"].values() for i in items} >= {"F", "B"}


@pytest.mark.timeout(180)
def test_overlap_variants(pool):
    from bench import bench_overlap

    r = bench_overlap.run(quick=True, pool=pool)
    assert {"ddp one bucket", "all-reduce after backward"} <= set(r["variants"])
    assert r["compute_s"]["median"] > 0 and r["allreduce_s"]["median"] > 0


@pytest.mark.timeout(180)
def test_tensor_parallel_arms_train_the_same_model(pool):
    from bench import bench_tp

    r = bench_tp.run(quick=True, pool=pool)
    assert r["loss_rel_diff"] < 1e-4  # the peer is the same model under DTensor's styles
    for arm in bench_tp.ARMS:
        assert r["arms"][arm]["cpu_s"]["median"] > 0 and r["arms"][arm]["wall_s"]["median"] > 0


@pytest.mark.slow  # two torchrun processes of their own (torch import, process group)
@pytest.mark.timeout(240)
def test_plain_torchrun_peer_trains_like_the_runtime(tmp_path):
    """The peer of benchmark (a) does the same work: its losses match the runtime's."""
    from bench.bench_throughput import run_plain
    from tests.helpers.reference import reference_run

    spec = tiny_spec("gpt-tiny", train={"steps": 3, "global_batch": 8, "micro_batch": 2}, layout={"dp": 2})
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    plain = run_plain(path, tmp_path, world=2, timeout_s=200)
    single = {**spec, "layout": {"dp": 1}, "resources": {"gpu": "cpu", "gpus_per_node": 1, "nodes": 1}}
    reference = reference_run(single).losses()
    assert len(plain["times"]) == 3
    torch.testing.assert_close(plain["losses"], reference, rtol=1e-4, atol=1e-5)
