"""`workbench run` end to end on an embedded local Ray cluster with 2 CPU workers: the cluster
of this pytest process, started by the first in-process Ray test and shared by the next ones
(the CLI's `run` too: tests/helpers/cli.py)."""
import json
import os
import re

import pytest

import workbench
from tests.helpers.cli import run_cli
from workbench import WorkerError

pytestmark = [pytest.mark.ray, pytest.mark.timeout(400)]


def test_cli_run_writes_the_metrics_contract(tmp_path):
    out = tmp_path / "m.jsonl"
    proc = run_cli("run", "examples/quickstart.yaml", "--metrics-out", out, "--set", "train.steps=12")
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in out.read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 13))
    for e in steps:
        assert set(e) >= {"event", "step", "loss", "tokens_per_s", "step_time_s"}
        assert e["tokens_per_s"] > 0 and e["step_time_s"] > 0
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5  # it learns the text
    memory = [e for e in events if e["event"] == "memory"]
    assert {e["rank"] for e in memory} == {0, 1}
    for e in memory:
        assert set(e["measured"]) >= {"params", "grads", "master", "optimizer", "activations", "peak"}
        assert all(isinstance(v, int) and v >= 0 for v in e["measured"].values())
        assert e["step_time_s"] > 0 and e["cpu_s"] >= 0  # each rank's own step time
    assert events[-1] == {"event": "end", "status": "completed", "step": 12}
    assert "quickstart" in proc.stderr and "12/12" in proc.stderr  # the progress bar


def test_worker_errors_come_back_readable():
    spec = {"name": "boom", "model": {"factory": "tests.helpers.models:exploding", "vocab": 256, "seq_len": 16},
            "layout": {"dp": 2}, "train": {"steps": 2}}
    with pytest.raises(WorkerError) as e:
        workbench.run(spec, progress=False)
    # both ranks fail the same way; the message names the first to report
    assert re.search(r"^rank [01]: RuntimeError: boom: this model always fails in forward$", str(e.value)), e.value


def test_a_rank_killed_by_a_signal_says_which_and_what_it_wrote_last():
    """The embedded Ray cluster removes its logs when it stops: the message keeps the rank's last stderr lines."""
    spec = {"name": "abort", "model": {"factory": "tests.helpers.models:aborting", "vocab": 256, "seq_len": 16},
            "train": {"steps": 2}}
    with pytest.raises(WorkerError) as e:
        workbench.run(spec, progress=False)
    message = str(e.value)
    assert "exited with signal 6 (SIGABRT) before the run ended" in message, message
    assert "the last of its stderr: " in message and "aborting: the test model's last words" in message, message


def test_cancel_stops_every_rank_within_k_steps_of_the_step_seen():
    """A cancel made while step 3 is the newest step seen ends the run after step 3 + k at the
    latest on every rank (k = STOP_WITHIN_STEPS: rank 0 lets at most k - 1 steps go without the
    driver's acknowledgement, which carries the stop), and the run ends preempted."""
    from backends.ray_relay import STOP_WITHIN_STEPS
    from workbench.launch import start

    spec = {"name": "stop-me", "model": {"preset": "gpt-tiny"}, "layout": {"dp": 2},
            "train": {"steps": 500, "global_batch": 4, "micro_batch": 2}}
    handle = start(spec)
    workers, policies = {}, {}
    for event in handle.follow(timeout_s=300):
        if event["event"] == "worker":
            workers[event["rank"]] = event
        if event["event"] == "step" and event["step"] == 3:
            # each rank runs in its own process at normal priority; its Ray worker only relays, on
            # CPU time the ranks leave idle (backends/embedded_ray.py, control_plane_setup)
            policies = {r: (os.sched_getscheduler(w["rank_pid"]), os.sched_getscheduler(w["pid"]))
                        for r, w in workers.items()}
            handle.cancel()
    assert policies == {0: (os.SCHED_OTHER, os.SCHED_IDLE), 1: (os.SCHED_OTHER, os.SCHED_IDLE)}
    events = handle.events
    end = events[-1]
    assert end["event"] == "end" and end["status"] == "preempted", end
    assert STOP_WITHIN_STEPS == 2  # the bound this test and docs/ui.md state
    assert 3 <= end["step"] <= 3 + STOP_WITHIN_STEPS, end  # by state: the last step seen before cancel() was 3
    assert handle.status().state.value == "stopped"
    steps = [e["step"] for e in events if e["event"] == "step"]
    assert steps == list(range(1, end["step"] + 1))


def test_a_group_the_cluster_cannot_hold_waits_says_why_and_can_be_cancelled(monkeypatch):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from backends import local_ray, ray_warm
    from workbench.launch import start

    monkeypatch.setattr(local_ray, "_PLACEMENT_WARN_S", 1.0)
    local_ray.ensure_ray()
    ray_warm.release_warm()  # the relays an earlier test's run left hold CPUs (backends/ray_warm.py)
    cpus = ray.cluster_resources()["CPU"]
    other_job = placement_group([{"CPU": cpus}])  # holds every CPU
    ray.get(other_job.ready())
    try:
        handle = start({"name": "no-room", "model": {"preset": "gpt-tiny"}, "layout": {"dp": 2},
                        "train": {"steps": 5, "global_batch": 4, "micro_batch": 2}})
        warning = next(e for e in handle.follow(timeout_s=120) if e["event"] == "warning")
        assert warning["message"].startswith(
            f"waiting for resources: 2 ranks need CPU {min(1.0, cpus / 2):g} each; the cluster has CPU 0 free of {cpus:g}")
        handle.cancel()
        assert handle.wait(timeout_s=60).state.value == "stopped"
        assert [e["event"] for e in handle.events] == ["warning"]  # no rank ever started
    finally:
        remove_placement_group(other_job)
