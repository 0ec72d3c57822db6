"""backend.elastic's arithmetic: how many tp groups the live nodes hold, the smaller dp that keeps the
global batch, and the refusals; plus the rank numbering that keeps a placement bundle's tp group
consecutive. (The shrink itself, on a real cluster losing a node: tests/integration/test_ray_multinode.py.)"""
import pytest

from backends.elastic import describe, groups_that_fit, shrink
from backends.local_ray import rank_order
from workbench.errors import ConfigError
from workbench.spec import load_spec


def _spec(dp=4, tp=1, pp=1, global_batch=16, micro_batch=2, **layout):
    return load_spec({"train": {"global_batch": global_batch, "micro_batch": micro_batch},
                      "layout": {"dp": dp, "tp": tp, "pp": pp, **layout},
                      "resources": {"gpus_per_node": dp * tp * pp}, "backend": {"elastic": True}})


def test_groups_count_whole_bundles_on_live_nodes_only():
    nodes = [{"Alive": True, "Resources": {"CPU": 2.0}},
             {"Alive": True, "Resources": {"CPU": 3.0, "GPU": 1.0}},
             {"Alive": False, "Resources": {"CPU": 8.0}},  # declared dead: holds nothing
             {"Alive": True, "Resources": {}}]  # a head node with no CPUs
    assert groups_that_fit(nodes, {"CPU": 1.0}) == 5
    assert groups_that_fit(nodes, {"CPU": 2.0}) == 2  # a group never straddles two nodes
    assert groups_that_fit(nodes, {"CPU": 1.0, "GPU": 1.0}) == 1
    assert groups_that_fit([{"Alive": True, "Resources": {"CPU": 0.9}}], {"CPU": 0.1 * 3}) == 3  # 0.9 / 0.30000000000000004


def test_shrink_keeps_the_global_batch_with_more_accumulation():
    spec = _spec(dp=4)
    assert shrink(spec, 4) is None and shrink(spec, 7) is None  # fits as is
    smaller = shrink(spec, 2)
    assert (smaller.layout.dp, smaller.world_size, smaller.train.global_batch) == (2, 2, 16)
    assert (smaller.resources.nodes, smaller.resources.gpus_per_node) == (1, 2)
    assert smaller.train.global_batch // (smaller.layout.dp * smaller.train.micro_batch) == 4  # was 2
    assert "dp=2 (was 4)" in describe(spec, smaller, 2) and "4 micro-batches of 2 per rank" in describe(spec, smaller, 2)


def test_shrink_skips_a_dp_that_does_not_divide_the_batch():
    spec = _spec(dp=4, global_batch=8, micro_batch=2)
    assert shrink(spec, 3).layout.dp == 2  # dp=3 would need 8 % 6 == 0


def test_shrink_drops_whole_replicas_of_tp_x_pp():
    spec = _spec(dp=2, tp=2, pp=2, global_batch=16, micro_batch=2)
    assert shrink(spec, 3).layout.dp == 1  # 3 tp groups: one replica of pp(2) groups
    with pytest.raises(ConfigError, match=r"hold 1 group\(s\) of tp\(2\) ranks, but one model replica needs pp\(2\)"):
        shrink(spec, 1)


def test_refusals_name_every_dp_tried_and_a_batch_that_works():
    assert shrink(_spec(dp=3, global_batch=12, micro_batch=4), 2).layout.dp == 1  # dp=2 would need 12 % 8 == 0
    spec = _spec(dp=3, zero=2, global_batch=12, micro_batch=4)  # and zero=2 cannot run on a single rank
    with pytest.raises(ConfigError, match=r"no smaller dp runs the same job: dp=2: global_batch\(12\) is not divisible "
                                          r"by dp\(2\) x micro_batch\(4\) = 8; dp=1: .*zero.*e\.g\. 24, a multiple"):
        shrink(spec, 2)


def test_a_bundles_ranks_stay_consecutive_whatever_the_node_order():
    # bundles 0 and 2 on node b, bundle 1 on node a (PACK may interleave them so)
    where = [{"node": "b", "gpus": [], "bundle": 0}, {"node": "b", "gpus": [], "bundle": 0},
             {"node": "a", "gpus": [], "bundle": 1}, {"node": "a", "gpus": [], "bundle": 1},
             {"node": "b", "gpus": [], "bundle": 2}, {"node": "b", "gpus": [], "bundle": 2}]
    ranks = rank_order(where)
    assert ranks == [0, 1, 4, 5, 2, 3]
    tp_groups = [{where[ranks.index(r)]["bundle"] for r in (g, g + 1)} for g in range(0, 6, 2)]
    assert all(len(g) == 1 for g in tp_groups)  # ranks 2k, 2k+1 (a tp group) share one bundle
