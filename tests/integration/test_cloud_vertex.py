"""Vertex AI backend through the real SDK (JobServiceClient over REST, google-cloud-storage upload)
pointed at a local fake endpoint with anonymous credentials; the fake records every request."""
from __future__ import annotations

import email.parser
import io
import itertools
import json
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("google.cloud.aiplatform_v1")

from backends.base import JobState  # noqa: E402
from backends.vertex import VertexBackend  # noqa: E402
from workbench.errors import ConfigError  # noqa: E402
from workbench.spec import load_spec  # noqa: E402

pytestmark = [pytest.mark.cloud, pytest.mark.timeout(120)]

FAKE_SECRET = "wbFakeGcpKey-" + "DoNotLeak" * 3


class FakeVertex(BaseHTTPRequestHandler):
    """CreateCustomJob / GetCustomJob / cancel, and GCS multipart uploads; all recorded."""

    recorded: list = []
    jobs: dict = {}
    objects: dict = {}
    ids = itertools.count(1000)

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        path = self.path.split("?")[0]
        self.recorded.append(("POST", self.path, raw, dict(self.headers)))
        if path.startswith("/upload/storage/v1/b/"):
            bucket = path.split("/")[5]
            msg = email.parser.BytesParser().parsebytes(
                b"Content-Type: " + self.headers["Content-Type"].encode() + b"\r\n\r\n" + raw)
            meta, media = (part.get_payload(decode=True) for part in msg.get_payload())
            name = json.loads(meta)["name"]
            self.objects[(bucket, name)] = media
            return self._send(200, {"bucket": bucket, "name": name, "size": str(len(media))})
        if path.endswith("/customJobs"):
            name = f"{path[len('/v1/'):]}/{next(self.ids)}"
            self.jobs[name] = dict(json.loads(raw), name=name, state="JOB_STATE_PENDING")
            return self._send(200, self.jobs[name])
        if path.endswith(":cancel"):
            self.jobs[path[len("/v1/"):-len(":cancel")]]["state"] = "JOB_STATE_CANCELLED"
            return self._send(200, {})
        self._send(404, {"error": {"code": 404, "message": "not faked: " + path, "status": "NOT_FOUND"}})

    def do_GET(self):
        self.recorded.append(("GET", self.path, b"", dict(self.headers)))
        job = self.jobs.get(self.path.split("?")[0][len("/v1/"):])
        if job is None:
            return self._send(404, {"error": {"code": 404, "message": "not found", "status": "NOT_FOUND"}})
        job["state"] = {"JOB_STATE_PENDING": "JOB_STATE_RUNNING"}.get(job["state"], "JOB_STATE_SUCCEEDED") \
            if job["state"] != "JOB_STATE_CANCELLED" else job["state"]
        self._send(200, job)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_vertex():
    FakeVertex.recorded, FakeVertex.jobs, FakeVertex.objects = [], {}, {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeVertex)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def make_project(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "my_model.py").write_text("X = 1\n")
    (root / ".gitignore").write_text("outputs/\n")
    (root / "outputs").mkdir()
    (root / "outputs" / "big.bin").write_bytes(b"0" * 100)
    (root / "application_default_credentials.json").write_text(json.dumps({"refresh_token": FAKE_SECRET}))
    (root / "key.json").write_text(json.dumps({"type": "service_account", "private" + "_key": "-----BEGIN PRIVATE KEY-----"
                                               + "\nMIIEv" + "Q" * 40}))
    return root


def test_submit_creates_spot_custom_job_with_checkpoint_dir(fake_vertex, tmp_path, monkeypatch, capsys):
    from google.auth.credentials import AnonymousCredentials

    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "nonexistent.json"))
    spec = load_spec("examples/cloud-spot.yaml").replace(**{"backend.include": ["*"]})  # the whole project, filtered
    root = make_project(tmp_path / "proj")
    backend = VertexBackend(credentials=AnonymousCredentials(), api_endpoint=fake_vertex,
                            storage_endpoint=fake_vertex, root=root)
    with pytest.raises(ConfigError, match=r"key.json, line 1: "):
        backend.dry_run(spec)  # a key under a plain name is found by its content: the dispatch stops
    (root / "key.json").unlink()  # as its owner would
    dry = json.dumps(backend.dry_run(spec))
    handle = backend.submit(spec)

    create = [r for r in FakeVertex.recorded if r[0] == "POST" and r[1].split("?")[0].endswith("/customJobs")]
    assert len(create) == 1
    assert create[0][1].startswith("/v1/projects/fake-project-000000/locations/us-central1/customJobs")
    body = json.loads(create[0][2])
    job = body["jobSpec"]
    assert job["scheduling"]["strategy"] in ("SPOT", 4)  # enums travel as integers over REST; 4 = SPOT
    assert job["scheduling"]["restartJobOnWorkerRestart"] is True
    assert job["scheduling"]["timeout"] == "14400s"
    assert job["baseOutputDirectory"]["outputUriPrefix"] == "gs://fake-workbench-bucket/workbench/cloud-spot/"
    pools = job["workerPoolSpecs"]
    assert [int(p["replicaCount"]) for p in pools] == [1, 1]  # chief + one worker = resources.nodes
    for pool in pools:
        assert pool["machineSpec"]["machineType"] == "n1-standard-32"
        assert pool["machineSpec"]["acceleratorCount"] == 4
        assert pool["machineSpec"]["acceleratorType"] in ("NVIDIA_TESLA_T4", 5)
        container = pool["containerSpec"]
        assert container["imageUri"].startswith("docker.io/pytorch/pytorch:")
        assert container["command"][:2] == ["bash", "-c"]
        assert "python -m workbench.cloud_entry --spec workbench_job.json" in container["command"][2]
    assert job["serviceAccount"] == "fake-trainer@fake-project-000000.iam.gserviceaccount.com"

    # The uploaded bundle is the one the command unpacks (through the /gcs mount).
    (bucket, key), data = next(iter(FakeVertex.objects.items()))
    assert f"/gcs/{bucket}/{key}" in pools[0]["containerSpec"]["command"][2]
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert {"workbench/cloud_entry.py", "my_model.py", "requirements.txt"} <= set(members)
    assert not {"outputs/big.bin", "application_default_credentials.json", "key.json"} & set(members)
    assert json.loads(members["workbench_job.json"])["checkpoint"]["uri"] == \
        "gs://fake-workbench-bucket/workbench/cloud-spot/checkpoints/"
    assert all(FAKE_SECRET.encode() not in blob for blob in members.values())

    # Anonymous credentials: no Authorization header left this process.
    assert not any("Authorization" in r[3] or "authorization" in r[3] for r in FakeVertex.recorded)
    assert handle.status().state is JobState.RUNNING
    assert handle.wait(timeout_s=20, poll_s=0.1).state is JobState.COMPLETED
    out = capsys.readouterr()
    assert FAKE_SECRET not in dry + out.out + out.err


def test_cancel_maps_to_stopped(fake_vertex, tmp_path):
    from google.auth.credentials import AnonymousCredentials

    spec = load_spec("examples/cloud-spot.yaml").replace(**{"backend.spot": False, "resources.nodes": 1,
                                                           "layout.dp": 4, "train.micro_batch": 4})
    handle = VertexBackend(credentials=AnonymousCredentials(), api_endpoint=fake_vertex, storage_endpoint=fake_vertex,
                           root=make_project(tmp_path / "proj")).submit(spec)
    body = json.loads(next(r[2] for r in FakeVertex.recorded if r[1].split("?")[0].endswith("/customJobs")))
    assert "strategy" not in body["jobSpec"]["scheduling"]  # on-demand
    assert len(body["jobSpec"]["workerPoolSpecs"]) == 1
    handle.cancel()
    assert handle.status().state is JobState.STOPPED
