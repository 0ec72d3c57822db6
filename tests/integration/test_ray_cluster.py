"""Ray cluster backend against a REAL local cluster (`ray start --head` on 127.0.0.1, token auth):
the bundle travels as the job's working_dir, the job runs, the test follows it and reads its output."""
from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

pytest.importorskip("ray")

import workbench  # noqa: E402
from backends.base import JobState  # noqa: E402
from backends.ray_cluster import RayClusterBackend, quote  # noqa: E402
from tests.helpers.ray_nodes import RayNodes  # noqa: E402
from workbench.spec import load_spec  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster():
    """A head node in its own process group, every port chosen free, its own token (not ~/.ray)."""
    nodes = RayNodes(uuid.uuid4().hex)
    try:
        nodes.start_head(num_cpus=2)
        yield nodes.address, nodes.token
    finally:
        nodes.stop()


@pytest.fixture
def client_env(cluster, monkeypatch):
    address, token = cluster
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    return address, token


def _spec(address: str, **overrides):
    raw = load_spec("examples/cloud-spot.yaml").to_dict()
    raw["backend"] = {"name": "ray", "ray": {"address": address}, "include": ["my_model.py"]}
    raw["resources"] = {"gpu": "cpu", "gpus_per_node": 2, "nodes": 1}
    raw["layout"] = {"dp": 2}
    raw["precision"] = {"dtype": "fp32"}
    raw["train"].update(steps=3, global_batch=8, micro_batch=4)
    raw["checkpoint"] = {"every_steps": 0}
    spec = load_spec(raw)
    return spec.replace(**overrides) if overrides else spec


def _project(tmp_path) -> Path:
    root = tmp_path / "proj"
    root.mkdir()
    (root / "my_model.py").write_text("X = 1\n")
    (root / ".env").write_text("SECRET=1\n")
    return root


@pytest.mark.slow  # fast twin: tests/unit/test_backends_bundle.py::test_the_job_runs_from_the_bundle_alone
def test_bundle_travels_and_job_is_followed_to_completion(client_env, tmp_path):
    address, token = client_env
    probe = ("import json, os, workbench; from workbench.spec import load_spec; s = load_spec('workbench_job.json'); "
             "print(json.dumps({'event': 'end', 'status': 'completed', 'step': 0, 'name': s.name, "
             "'workbench': workbench.__file__, 'cwd': os.getcwd(), 'files': sorted(os.listdir('.'))}))")
    backend = RayClusterBackend(root=_project(tmp_path))
    handle = backend.submit_entrypoint(_spec(address), quote(["python", "-c", probe]))
    status = handle.wait(timeout_s=120, poll_s=0.5)
    logs = handle.logs()
    assert status.state is JobState.COMPLETED, logs
    (event,) = handle.metrics()
    assert event["name"] == "cloud-spot"
    assert event["workbench"].startswith(event["cwd"])  # the shipped package, not this checkout
    assert {"workbench", "backends", "my_model.py", "workbench_job.json"} <= set(event["files"])
    assert ".env" not in event["files"]
    assert token not in logs
    assert token not in json.dumps(backend.dry_run(_spec(address)))


@pytest.mark.slow
def test_failed_entrypoint_reports_failed(client_env, tmp_path):
    address, _ = client_env
    handle = RayClusterBackend(root=_project(tmp_path)).submit_entrypoint(_spec(address), "python -c 'raise SystemExit(3)'")
    assert handle.wait(timeout_s=120, poll_s=0.5).state is JobState.FAILED


@pytest.mark.slow
@pytest.mark.skipif(not (Path(workbench.__file__).parent / "launch.py").exists(),
                    reason="needs the runtime launcher (workbench/launch.py) in the shipped package")
def test_gpt_tiny_runs_on_the_cluster_and_reports_metrics(client_env, tmp_path):
    address, _ = client_env
    spec = _spec(address)
    handle = RayClusterBackend(root=_project(tmp_path)).submit(spec)
    status = handle.wait(timeout_s=200, poll_s=1.0)
    assert status.state is JobState.COMPLETED, handle.logs(200)
    events = handle.metrics()
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3]
    assert all(e["loss"] > 0 for e in steps)
    assert [(e["status"], e["step"]) for e in events if e["event"] == "end"] == [("completed", 3)]
    assert {e["rank"] for e in events if e["event"] == "memory"} == {0, 1}  # both Ray workers reported


@pytest.mark.slow
def test_ray_job_stop_checkpoints_reports_the_end_and_releases_the_lease(client_env, tmp_path):
    """`ray job stop` (SIGTERM to the driver, SIGKILL after RAY_JOB_STOP_WAIT_TIME_S): the driver asks the
    ranks to stop after a step; they checkpoint, rank 0 reports the end and releases the lease (issue 33)."""
    import time

    address, _ = client_env
    ckpt = tmp_path / "ckpt"
    spec = _spec(address, **{"train.steps": 2000, "checkpoint.every_steps": 2, "checkpoint.uri": str(ckpt),
                             "backend.spot": True})
    handle = RayClusterBackend(root=_project(tmp_path)).submit(spec)
    deadline = time.monotonic() + 240
    while not (ckpt / "step-000000002" / "manifest.json").exists():
        assert not handle.status().state.done, handle.logs(200)
        assert time.monotonic() < deadline, handle.logs(200)
        time.sleep(0.2)
    assert (ckpt / "lease.json").exists()
    handle.cancel()  # what `ray job stop` does
    status = handle.wait(timeout_s=120, poll_s=0.5)
    assert status.state is JobState.STOPPED
    events = handle.metrics()
    (end,) = [e for e in events if e["event"] == "end"]
    assert end["status"] == "preempted" and end["step"] < 2000
    assert (ckpt / f"step-{end['step']:09d}" / "manifest.json").exists()  # the preemption checkpoint
    assert not (ckpt / "lease.json").exists()  # a resubmit is not refused for the lease's TTL
