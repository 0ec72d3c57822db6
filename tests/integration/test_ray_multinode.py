"""The `ray` backend on a REAL Ray cluster of several nodes on this host (a head with no CPUs and
worker nodes of 2 CPUs each, separate raylets and node ids): ranks placed by the layout (a tp group
inside one node), `workbench dispatch --backend ray` and `ray job submit` (one job each), and node loss (a worker
node's raylet killed) -> the job restarts from the last checkpoint on the nodes left; with
`backend.elastic` it continues at a smaller dp on the same loss curve.

Checkpoints go to a local folder: every node of this test cluster is on one host. On a real
multi-host cluster checkpoint.uri must be an object store (or a file system every node mounts).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("ray")

import torch  # noqa: E402
import yaml  # noqa: E402

from backends.bundle import SPEC_FILE, build_bundle  # noqa: E402
from backends.ray_cluster import RayClusterJob  # noqa: E402
from tests.helpers.events import loss_by_step  # noqa: E402
from tests.helpers.ray_nodes import RayNodes  # noqa: E402
from tests.helpers.reference import reference_run  # noqa: E402
from workbench.spec import load_spec  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
CPUS_PER_NODE = 2  # one rank per CPU: a tp=2 group fills a node, so dp=2 x tp=2 needs two nodes
TRAIN = {"steps": 24, "global_batch": 8, "micro_batch": 2, "lr": 3e-3}


@pytest.fixture(scope="module")
def cluster():
    nodes = RayNodes(uuid.uuid4().hex)
    try:
        nodes.start_head(num_cpus=0)  # the job's driver runs here; ranks only on workers
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture
def client(cluster, monkeypatch):
    from ray.job_submission import JobSubmissionClient

    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", cluster.token)
    return JobSubmissionClient(cluster.address, headers={"Authorization": f"Bearer {cluster.token}"})


def _spec(cluster, **backend) -> dict:
    return {"name": "multinode", "model": {"preset": "gpt-tiny"}, "train": TRAIN, "layout": {"dp": 2, "tp": 2},
            "resources": {"gpu": "cpu", "gpus_per_node": 2, "nodes": 2},
            "backend": {"name": "ray", "ray": {"address": cluster.address}, **backend}}


@pytest.fixture(scope="module")
def reference() -> dict[int, float]:
    """The single-process loss curve of the same job (layout invariance)."""
    return reference_run({"model": {"preset": "gpt-tiny"}, "train": TRAIN}).loss_by_step()


def _workers(events, attempt: int) -> dict[int, str]:
    """rank -> node id of one attempt's ranks."""
    return {e["rank"]: e["node"] for e in events if e["event"] == "worker" and e["attempt"] == attempt}


def _assert_tp_groups_inside_nodes(nodes: dict[int, str], tp: int = 2) -> None:
    for first in range(0, len(nodes), tp):
        assert len({nodes[r] for r in range(first, first + tp)}) == 1, nodes


def _assert_rendezvous_on_rank0(events) -> None:
    """Every rank was given one MASTER_ADDR:PORT, and rank 0's process (started by its relay on rank 0's
    node) is the one listening there: the TCPStore the process group starts from."""
    import psutil

    first = {e["rank"]: e for e in events if e["event"] == "worker" and e["attempt"] == 0}
    (master,) = {w["master"] for w in first.values()}
    listening = {c.laddr.port for c in psutil.Process(first[0]["rank_pid"]).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN}
    assert int(master.rsplit(":", 1)[1]) in listening, (master, listening)


def _wait_for(job: RayClusterJob, predicate, timeout_s: float = 300):
    """Poll the job's metrics events until `predicate(events)` is true; the events."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = job.metrics()
        if predicate(events):
            return events
        if job.status().state.done:
            raise AssertionError(f"the job ended first: {job.status()}\n{job.logs(60)}")
        time.sleep(0.5)
    raise TimeoutError(job.logs(60))


def _submit_with_dispatch(cluster, spec: dict, tmp_path: Path) -> str:
    """`workbench dispatch --backend ray` of the spec (RayClusterBackend: the bundle through the Jobs API)."""
    (tmp_path / "multinode.yaml").write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": cluster.token}
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "dispatch", "multinode.yaml", "--backend", "ray"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("submitted: ")[1].strip()


def _submit_with_ray_cli(cluster, spec: dict, tmp_path: Path) -> str:
    """`ray job submit` of the spec's code bundle (what RayClusterBackend uploads) against the cluster."""
    code = build_bundle(load_spec(spec), tmp_path / "project").write_dir(tmp_path / "code")
    submission = f"multinode-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": cluster.token}
    cmd = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", cluster.address,
           "--submission-id", submission, "--working-dir", str(code), "--no-wait",
           "--runtime-env-json", json.dumps({"env_vars": {"WORKBENCH_CLOUD": "ray"}}),
           "--", "python", "-m", "workbench.cloud_entry", "--spec", SPEC_FILE]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return submission


def _lose_a_node_after_a_checkpoint(cluster, client, spec: dict, tmp_path: Path, submit):
    """Submit, wait for a checkpoint, kill the raylet of a node holding ranks, follow to the end.
    Returns (events, the lost node's id)."""
    (tmp_path / "project").mkdir()
    job = RayClusterJob(client, submit(cluster, spec, tmp_path))
    events = _wait_for(job, lambda ev: any(e["event"] == "checkpoint" for e in ev) and len(_workers(ev, 0)) == 4)
    _assert_rendezvous_on_rank0(events)
    first = _workers(events, 0)
    _assert_tp_groups_inside_nodes(first)
    assert "head" not in {cluster.name_of(n) for n in first.values()}  # ranks only on workers
    victim = _workers(events, 0)[3]
    lost = cluster.kill(cluster.node(cluster.name_of(victim)))
    status = job.wait(timeout_s=500, poll_s=1.0)
    assert status.state.value == "completed", job.logs(120)
    return job.metrics(), lost


def _restart(events: list[dict]) -> tuple[int, dict, dict]:
    """(index of the restart after the failure, losses before it, losses after it). The entrypoint
    always resumes, so the first attempt has a restart event too (from step 0)."""
    cut = next(i for i, e in enumerate(events) if e["event"] == "restart" and e["attempt"] == 1)
    return cut, loss_by_step(events[:cut]), loss_by_step(events[cut:])


def test_node_loss_restarts_from_the_last_checkpoint_on_the_nodes_left(cluster, client, tmp_path, reference):
    """Submitted by `workbench dispatch --backend ray`; the elastic case below by `ray job submit`."""
    cluster.set_workers(3, CPUS_PER_NODE)  # the job takes two; the third is what is left after the loss
    spec = _spec(cluster, max_failures=1)
    spec["checkpoint"] = {"every_steps": 2, "uri": str(tmp_path / "ckpt")}
    events, lost = _lose_a_node_after_a_checkpoint(cluster, client, spec, tmp_path, _submit_with_dispatch)

    cut, before, after = _restart(events)
    last_ckpt = max(e["step"] for e in events[:cut] if e["event"] == "checkpoint")
    assert events[cut] == {"event": "restart", "attempt": 1, "from_step": last_ckpt}
    again = _workers(events, 1)
    assert sorted(again) == [0, 1, 2, 3] and lost not in again.values()  # the same layout on the nodes left
    _assert_tp_groups_inside_nodes(again)
    assert sorted(after) == list(range(last_ckpt + 1, TRAIN["steps"] + 1))
    redone = [k for k in before if k > last_ckpt]
    assert [after[k] for k in redone] == [before[k] for k in redone]  # the same layout: the same numbers
    joined = {**before, **after}
    torch.testing.assert_close([joined[k] for k in sorted(reference)], list(reference.values()), rtol=1e-4, atol=0)
    assert events[-1] == {"event": "end", "status": "completed", "step": TRAIN["steps"]}


def test_elastic_continues_at_a_smaller_dp_on_the_same_loss_curve(cluster, client, tmp_path, reference):
    cluster.set_workers(2, CPUS_PER_NODE)  # after the loss one node is left: one tp group, dp=1
    spec = _spec(cluster, max_failures=1, elastic=True)
    spec["checkpoint"] = {"every_steps": 2, "uri": str(tmp_path / "ckpt")}
    events, lost = _lose_a_node_after_a_checkpoint(cluster, client, spec, tmp_path, _submit_with_ray_cli)

    cut, before, after = _restart(events)
    last_ckpt = max(e["step"] for e in events[:cut] if e["event"] == "checkpoint")
    assert events[cut] == {"event": "restart", "attempt": 1, "from_step": last_ckpt}
    shrunk = [e["message"] for e in events if e["event"] == "warning" and "backend.elastic" in e["message"]]
    assert len(shrunk) == 1 and "dp=1 (was 2), 2 ranks, 4 micro-batches of 2 per rank and step (was 2)" in shrunk[0]
    again = _workers(events, 1)
    assert sorted(again) == [0, 1] and lost not in again.values()
    _assert_tp_groups_inside_nodes(again)
    assert {e["world_size"] for e in events if e["event"] == "worker" and e["attempt"] == 1} == {2}
    assert sorted(after) == list(range(last_ckpt + 1, TRAIN["steps"] + 1))
    # same global batch, same data: the curve after the shrink is the uninterrupted run's
    torch.testing.assert_close([after[k] for k in sorted(after)], [reference[k] for k in sorted(after)],
                               rtol=1e-5, atol=1e-5)
    assert events[-1] == {"event": "end", "status": "completed", "step": TRAIN["steps"]}
