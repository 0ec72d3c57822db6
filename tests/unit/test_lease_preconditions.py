"""The lease's create-exclusive precondition on GCS (issue 33), at the client layer: gcsfs against a
small local JSON-API endpoint that, like real GCS, answers an upload with ifGenerationMatch=0 on an
existing object with 412. The second Lease cannot create the lease. S3 is tested against moto's
server (tests/integration/test_checkpoint_stores.py)."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

import pytest

gcsfs = pytest.importorskip("gcsfs")


class FakeGCS(BaseHTTPRequestHandler):
    objects: dict[str, bytes] = {}
    uploads: list[dict] = []

    def log_message(self, *args):
        pass

    def _reply(self, code: int, body: bytes = b"{}", kind: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        url = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        data = self.rfile.read(int(self.headers["Content-Length"]))
        meta, payload = data.split(b"\n\n", 2)[1], data.split(b"\n\n", 2)[2].rsplit(b"\n--==0==--", 1)[0]
        name = json.loads(meta.split(b"\n--==0==")[0])["name"]
        self.uploads.append(query)
        if query.get("ifGenerationMatch") == "0" and name in self.objects:
            return self._reply(412, json.dumps({"error": {"code": 412, "message": "Precondition Failed"}}).encode())
        self.objects[name] = payload
        return self._reply(200, json.dumps({"name": name, "bucket": "b", "generation": "1",
                                            "size": str(len(payload))}).encode())

    def do_GET(self):
        url = urlparse(self.path)
        name = unquote(url.path.split("/o/", 1)[1]) if "/o/" in url.path else None
        if name is None or name not in self.objects:
            if url.path.endswith("/o"):  # a listing
                return self._reply(200, json.dumps({"items": []}).encode())
            return self._reply(404, json.dumps({"error": {"code": 404, "message": "Not Found"}}).encode())
        if "alt=media" in url.query:
            return self._reply(200, self.objects[name], "application/octet-stream")
        return self._reply(200, json.dumps({"name": name, "bucket": "b", "size": str(len(self.objects[name])),
                                            "generation": "1", "kind": "storage#object"}).encode())


@pytest.fixture
def gcs():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeGCS)
    FakeGCS.objects, FakeGCS.uploads = {}, []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_a_second_lease_on_gcs_is_refused_by_the_precondition(gcs, monkeypatch):
    import fsspec

    from workbench.runtime.checkpoint_lease import Lease
    from workbench.runtime.checkpoint_store import Store

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs)  # gcsfs's own switch to another endpoint
    monkeypatch.setenv("GCSFS_DEFAULT_TOKEN", "anon")
    fsspec.filesystem("gcs").clear_instance_cache()
    store = Store("gs://b/run")
    first, second = Lease(store, run="one"), Lease(Store("gs://b/run"), run="two")
    assert first._create(first.path, first._record())
    assert not second._create(second.path, second._record())
    assert [u.get("ifGenerationMatch") for u in FakeGCS.uploads] == ["0", "0"]  # what gcsfs sent each time
    assert json.loads(FakeGCS.objects["run/lease.json"])["run_id"] == "one"
