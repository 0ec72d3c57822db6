"""A driver that runs twice (the notebook, #35): the second job of the same shape takes the relays
the first left (backends/ray_warm.py) with a new rank process each, already past its imports, and
trains the same model; a job of another shape releases them; a failed job keeps nothing."""
import time

import pytest

import workbench
from backends import ray_warm

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]  # fast twin: tests/unit/test_rank_standby.py
SPEC = {"name": "twice", "model": {"preset": "gpt-tiny"}, "layout": {"dp": 2},
        "train": {"steps": 3, "global_batch": 4, "micro_batch": 2}}


def workers(result) -> dict:
    return {e["rank"]: (e["pid"], e["rank_pid"]) for e in result.events if e["event"] == "worker"}


def startup(result) -> dict:
    (event,) = [e for e in result.events if e["event"] == "startup"]
    return event


def test_the_second_run_reuses_the_relays_with_new_rank_processes_and_trains_the_same_model():
    import ray

    ray_warm.release_warm()
    first = workbench.run(SPEC, progress=False)
    second = workbench.run(SPEC, progress=False)
    assert second.losses == first.losses  # a fresh process group and model: the same run
    assert startup(first)["reused"] is False and startup(second)["reused"] is True
    relays = {r: pids[0] for r, pids in workers(first).items()}
    assert {r: pids[0] for r, pids in workers(second).items()} == relays  # the same relay actors
    assert not {p[1] for p in workers(first).values()} & {p[1] for p in workers(second).values()}  # new ranks
    for event in (startup(first), startup(second)):
        assert set(event["ranks"]) == {"0", "1"} and event["launch_to_step_1_s"] > 0
        assert event["ranks"]["0"]["import_torch_s"] > 0 and event["ranks"]["0"]["first_step_s"] > 0
    assert "placement_s" in startup(first)["driver"] and "placement_s" not in startup(second)["driver"]

    other = workbench.run({**SPEC, "layout": {"dp": 1}, "train": {**SPEC["train"], "global_batch": 2}}, progress=False)
    assert startup(other)["reused"] is False  # another shape: the dp=2 relays were released first
    ray_warm.release_warm()
    for _ in range(300):  # Ray frees a removed placement group's resources asynchronously
        if ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"]:
            break
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"]  # nothing held


def test_a_failed_run_keeps_no_relays():
    from workbench import WorkerError

    ray_warm.release_warm()
    spec = {"name": "boom", "model": {"factory": "tests.helpers.models:exploding", "vocab": 256, "seq_len": 16},
            "layout": {"dp": 2}, "train": {"steps": 2}}
    with pytest.raises(WorkerError):
        workbench.run(spec, progress=False)
    assert not ray_warm.wait_ready()  # nothing kept
