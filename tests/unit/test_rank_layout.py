"""How the local/ray backend numbers its ranks from where Ray placed the relay actors."""
from backends.local_ray import rank_env, rank_order

MASTER = ("10.0.0.1", 29500)


def test_cpu_ranks_keep_the_actor_order_on_one_node():
    where = [{"node": "a", "gpus": []}] * 4
    assert rank_order(where) == [0, 1, 2, 3]
    env = rank_env(where, [0, 1, 2, 3], 2, MASTER)
    assert env == {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
                   "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True"}


def test_gpu_ranks_are_grouped_by_node_and_follow_the_gpu_ids():
    # as Ray may place them: two nodes interleaved, GPU ids out of order
    where = [{"node": "b", "gpus": ["1"]}, {"node": "a", "gpus": ["3"]}, {"node": "b", "gpus": ["0"]},
             {"node": "a", "gpus": ["10"]}, {"node": "a", "gpus": ["2"]}]
    ranks = rank_order(where)
    assert ranks == [1, 3, 0, 4, 2]  # node b (seen first): GPUs 0, 1; then node a: GPUs 2, 3, 10
    envs = {ranks[i]: rank_env(where, ranks, i, MASTER) for i in range(len(where))}
    assert [envs[r]["LOCAL_RANK"] for r in range(5)] == ["0", "1", "0", "1", "2"]
    assert [envs[r]["LOCAL_WORLD_SIZE"] for r in range(5)] == ["2", "2", "3", "3", "3"]
    # every GPU of the node visible, in local-rank order; LOCAL_RANK picks the rank's own
    assert envs[0]["CUDA_VISIBLE_DEVICES"] == envs[1]["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert envs[2]["CUDA_VISIBLE_DEVICES"] == envs[4]["CUDA_VISIBLE_DEVICES"] == "2,3,10"
    for i, w in enumerate(where):
        env = rank_env(where, ranks, i, MASTER)
        assert env["CUDA_VISIBLE_DEVICES"].split(",")[int(env["LOCAL_RANK"])] == w["gpus"][0]
