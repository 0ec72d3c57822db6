"""Ray cluster backend against a REAL local cluster (`ray start --head` on 127.0.0.1, token auth):
the bundle travels as the job's working_dir, the job runs, the test follows it and reads its output."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

pytest.importorskip("ray")

import workbench  # noqa: E402
from backends.base import JobState  # noqa: E402
from backends.ray_cluster import RayClusterBackend, quote  # noqa: E402
from workbench.spec import load_spec  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _start_head(token: str):
    """One `ray start --head` attempt: (process, address, log path) once it is up, else (None, address, log tail)."""
    gcs, dash, client, agent_http, agent_grpc, metrics, rt_env, node_mgr, obj_mgr = _free_ports(9)
    temp_dir = tempfile.mkdtemp(prefix="wbray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    bin_dir = str(Path(sys.executable).parent)
    # jsonschema imports rfc3987_syntax when installed (jupyter-events pulls it in through
    # jsonschema[format-nongpl]) and that builds a lark grammar at import: ~3 s of CPU in every Ray
    # process, enough on a busy 2-core machine for the dashboard agent to miss the raylet's fixed
    # 15 s start window. Ray does not use the IRI format check it enables.
    shim = Path(temp_dir) / "shim"
    shim.mkdir()
    (shim / "rfc3987_syntax.py").write_text("raise ImportError('not loaded in this test cluster')\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": token, "PYTHONPATH": str(shim)}
    cmd = [f"{bin_dir}/ray", "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
           "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash), "--ray-client-server-port", str(client),
           "--dashboard-agent-listen-port", str(agent_http), "--dashboard-agent-grpc-port", str(agent_grpc),
           "--metrics-export-port", str(metrics), "--runtime-env-agent-port", str(rt_env),
           "--node-manager-port", str(node_mgr), "--object-manager-port", str(obj_mgr),
           "--num-cpus", "2", "--temp-dir", temp_dir, "--include-dashboard", "true", "--disable-usage-stats"]
    log_path = Path(temp_dir) / "head.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    deadline = time.monotonic() + 150
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            req = urllib.request.Request(f"{address}/api/version", headers={"Authorization": f"Bearer {token}"})
            urllib.request.urlopen(req, timeout=2).read()
            # The dashboard answers before the raylet registered: usable once `ray start` says so.
            time.sleep(1.0)
            if proc.poll() is None and "Ray runtime started" in log_path.read_text(errors="replace"):
                return proc, address, log_path
        except OSError:
            time.sleep(0.5)
    tail = log_path.read_text(errors="replace")[-3000:]
    _stop(proc, log_path)
    return None, address, tail


def _stop(proc, log_path: Path) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # SIGTERM shutdown of --block can take 30 s
    proc.wait(timeout=30)
    shutil.rmtree(log_path.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    """A head node in its own process group, every port chosen free, its own token (not ~/.ray)."""
    token = uuid.uuid4().hex
    # The raylet waits a fixed 15 s for the dashboard agent's port files and aborts past that; a
    # 2-core machine busy with other test runs can still miss it, so a failed start gets another try.
    for _attempt in range(3):
        proc, address, log = _start_head(token)
        if proc is not None:
            break
    else:
        pytest.fail("ray head did not start:\n" + log)
    try:
        yield address, token
    finally:
        _stop(proc, log)


@pytest.fixture
def client_env(cluster, monkeypatch):
    address, token = cluster
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    return address, token


def _spec(address: str, **overrides):
    raw = load_spec("examples/cloud-spot.yaml").to_dict()
    raw["backend"] = {"name": "ray", "ray": {"address": address}}
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
