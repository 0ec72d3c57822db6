"""Ray cluster rules and request (issue 33): spot needs a checkpoint destination every node reaches, and
`ray job stop` waits the preemption grace period before SIGKILL (the supervisor reads the job's env_vars)."""
from __future__ import annotations

import pytest

from backends.ray_cluster import build_request, check
from tests.helpers.specs import cloud_spot
from workbench.errors import ConfigError


def spec(**overrides):
    return cloud_spot(**{"backend.name": "ray", **overrides})


def test_the_example_checkpoints_on_ray():
    s = spec()
    assert s.backend.spot and s.checkpoint.uri.startswith("/")
    check(s)


@pytest.mark.parametrize("overrides,what", [
    ({"checkpoint.uri": None}, "no checkpoint.uri"),
    ({"checkpoint.uri": "ckpt/run"}, "is relative"),
    ({"checkpoint.every_steps": 0, "checkpoint.every_minutes": 0}, "no checkpoint schedule"),
])
def test_spot_without_a_checkpoint_destination_is_refused(overrides, what):
    with pytest.raises(ConfigError, match=f"backend.spot=true on a Ray cluster with .*{what}.*s3://"):
        check(spec(**overrides))
    check(spec(**overrides, **{"backend.spot": False}))  # on-demand: a note, not a refusal


def test_ray_job_stop_waits_the_grace_period(monkeypatch):
    monkeypatch.setenv("WORKBENCH_PREEMPT_GRACE_S", "45.5")
    env = build_request(spec(), "job-1", "/tmp/x")["runtime_env"]["env_vars"]
    assert env["RAY_JOB_STOP_WAIT_TIME_S"] == "46" and env["WORKBENCH_PREEMPT_GRACE_S"] == "46"
    assert env["WORKBENCH_RUN_ID"] == "job-1"
