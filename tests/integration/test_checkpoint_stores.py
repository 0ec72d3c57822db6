"""Checkpoints on a real object store (moto's S3 server through s3fs, as the `aws` extra installs
it) and one writer per URI (issue 20): a second run on the URI of a live run is refused with exit
2 naming the owner, on a local folder and on S3; a dead owner's lease is taken over."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("s3fs")

from bench.common import OWN_GROUP  # noqa: E402
from tests.helpers.events import losses  # noqa: E402
from tests.helpers.reference import reference_run  # noqa: E402
from tests.helpers.specs import tiny_gpt  # noqa: E402
from tests.integration.test_cloud_sagemaker import aws_env, moto_server  # noqa: E402,F401 - fixtures
from workbench.runtime.checkpoint import CheckpointWarning  # noqa: E402
from workbench.runtime.checkpoint_lease import LEASE, Lease, LeaseHeld  # noqa: E402
from workbench.runtime.checkpoint_store import Store  # noqa: E402
from workbench.runtime.loop import train  # noqa: E402

pytestmark = [pytest.mark.cloud, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 5


def tiny(uri=None, steps=STEPS, **ckpt) -> dict:
    return tiny_gpt(uri, name="stores", steps=steps, **ckpt)


@pytest.fixture
def bucket(aws_env):  # noqa: F811 (the fixture imported above)
    import boto3
    import fsspec

    name = f"wb-ckpt-{time.monotonic_ns()}"
    boto3.client("s3", endpoint_url=aws_env[0]).create_bucket(Bucket=name)
    fsspec.filesystem("s3").invalidate_cache()
    return f"s3://{name}"


@pytest.fixture(scope="module")
def reference():
    return reference_run(tiny()).losses()


def test_s3_write_list_retain_resume_and_skip_a_corrupt_step(bucket, reference):
    uri = f"{bucket}/run"
    first = []
    train(tiny(uri, every_steps=1, keep=2), first.append, should_stop=iter([False, False, True]).__next__)
    store = Store(uri)
    assert store.committed_steps() == [3, 2]  # keep=2 on the object store
    assert [e["uri"] for e in first if e["event"] == "checkpoint"][-1] == f"{uri}/step-000000003"
    manifest = store.read_manifest(3)
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "rng-rank00000.pt"}

    shard = f"{store.step_dir(3)}/__0_0.distcp"
    data = bytearray(store.fs.cat_file(shard))
    data[len(data) // 2] ^= 0xFF
    store.fs.pipe_file(shard, bytes(data))
    resumed = []
    with pytest.warns(CheckpointWarning, match="step 3 .*CRC-32 mismatch"):
        train(tiny(uri, every_steps=1, keep=2), resumed.append, resume=True)
    assert {"event": "restart", "attempt": 0, "from_step": 2, "rejected": [3]} in resumed
    assert losses(resumed) == reference[2:]


def start_owner(uri: str, tmp_path: Path) -> subprocess.Popen:
    """A real run (one process, as a cloud launcher starts it) that holds `uri` for a while."""
    spec = tmp_path / "owner.json"
    spec.write_text(json.dumps(tiny(uri, steps=100_000, every_steps=1000)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORKBENCH_CLOUD": "generic"}
    return subprocess.Popen([sys.executable, "-m", "workbench.cloud_entry", "--spec", str(spec)], env=env,
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **OWN_GROUP)


def wait_for_lease(store: Store, owner: subprocess.Popen) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and owner.poll() is None:
        lease = Lease(store).read()
        if lease:
            return lease
        time.sleep(0.2)
    pytest.fail(f"the owner never took the lease: {owner.stderr.read().decode()[-2000:] if owner.poll() else ''}")


@pytest.mark.slow  # three processes; the lease rules themselves are fast tests (test_checkpoint_edges.py, below)
@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_second_writer_is_refused_and_a_dead_owners_lease_taken_over(where, tmp_path, request):
    uri = str(tmp_path / "ckpt") if where == "local" else f"{request.getfixturevalue('bucket')}/run"
    owner = start_owner(uri, tmp_path)
    try:
        lease = wait_for_lease(Store(uri), owner)
        assert lease["pid"] == owner.pid and lease["run_id"].endswith(f":{owner.pid}")
        spec = tmp_path / "second.json"
        spec.write_text(json.dumps(tiny(uri)))
        second = subprocess.run([sys.executable, "-m", "workbench.cloud_entry", "--spec", str(spec)],
                                env={**os.environ, "PYTHONPATH": str(ROOT), "WORKBENCH_CLOUD": "generic"},
                                capture_output=True, text=True, timeout=240, cwd=tmp_path)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"is in use by run {lease['run_id']!r} (pid {owner.pid} on host" in second.stderr
        if where == "local":  # `workbench run` refuses before it starts Ray
            cli = subprocess.run([sys.executable, "-m", "workbench.cli", "run", str(spec), "--no-progress"],
                                 env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                                 timeout=120, cwd=tmp_path)
            assert cli.returncode == 2 and f"pid {owner.pid} on host" in cli.stderr, cli.stderr[-2000:]
        assert Lease(Store(uri)).read()["pid"] == owner.pid  # the owner's lease is untouched
    finally:
        os.killpg(owner.pid, signal.SIGKILL)
        owner.wait(timeout=30)
    taker = Lease(Store(uri), run="taker")
    taker.acquire()  # same host, owner's pid gone: stale, taken over at once
    assert Lease(Store(uri)).read()["run_id"] == "taker"
    with pytest.raises(LeaseHeld, match="'taker'"):
        Lease(Store(uri), run="third").acquire()
    taker.release()
    assert not Store(uri).fs.exists(Store(uri).path(LEASE))


def test_a_lease_without_heartbeat_is_stale_after_the_ttl(tmp_path, monkeypatch):
    store = Store(str(tmp_path))
    other_host = {"host": "elsewhere", "pid": 1, "run_id": "gone", "token": "t0", "heartbeat_unix": time.time() - 30}
    store.fs.pipe_file(store.path(LEASE), json.dumps(other_host).encode())
    with pytest.raises(LeaseHeld, match="host elsewhere"):  # another host: only its heartbeat can tell
        Lease(store, run="me").acquire()
    monkeypatch.setenv("WORKBENCH_LEASE_TTL_S", "10")
    lease = Lease(store, run="me")
    lease.acquire()
    assert lease.read()["run_id"] == "me"
    lease.release()


def test_the_lease_is_created_with_the_stores_precondition_on_s3(bucket):
    """Two owners are impossible where the store enforces create-exclusive (issue 33): moto's S3 answers
    the second `If-None-Match: *` PUT with 412, so the second Lease's create fails, with no read-back race."""
    store = Store(f"{bucket}/run")
    store.fs.makedirs(store.root, exist_ok=True)
    first, second = Lease(store, run="one"), Lease(store, run="two")
    assert first._create(first.path, first._record())
    assert not second._create(second.path, second._record())  # 412 Precondition Failed, not an overwrite
    assert first.read()["run_id"] == "one"
