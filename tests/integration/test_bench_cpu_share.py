"""Benchmark (a)'s CPU split at tiny size: both arms run, every rank is found, the roles are right."""
import os

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(400)]  # Ray and torchrun arms: a process tree each


def test_cpu_share_finds_the_ranks_and_the_control_plane():
    from bench import bench_cpu_share

    r = bench_cpu_share.run(quick=True)
    for arm in ("workbench", "runtime"):
        (one,) = r["rounds"][arm]
        assert one["ranks"] == 2 and one["ms_per_step"] > 0
        assert 0 < one["rank_cores"] <= 1.05
    procs = r["rounds"]["workbench"][0]["processes"]
    if hasattr(os, "SCHED_BATCH"):
        assert {p["policy"] for p in procs if p["group"] == "ranks"} == {"OTHER"}
        actors = [(p["cmd"], p["policy"]) for p in procs if p["group"] == "Ray actors"]
        assert actors.count(("ray::RankRelay", "IDLE")) == 2, actors  # ours: idle time only
        # any other Ray worker process (one Ray keeps ready, say) never preempts a rank
        assert {policy for cmd, policy in actors if cmd != "ray::RankRelay"} <= {"BATCH"}, actors
