"""A real dispatch that finds no credentials, or cannot reach the service, ends in one line naming the
backend and the fix, with exit 77 (credentials) or 69 (unreachable), never a traceback (review_cloud
finding 6). Each case runs the real SDK through `workbench dispatch`: it looks for credentials in an
emptied environment, or sends its request to a closed local port or to a local server that answers
as the service does when it refuses a key. No network is used."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from backends.base import EXIT_NO_CREDENTIALS, EXIT_UNREACHABLE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # each case starts a `workbench dispatch` process

SPEC = {"name": "access", "model": {"preset": "gpt-tiny"}, "layout": {"dp": 8},
        "train": {"steps": 20, "global_batch": 16, "micro_batch": 2},
        "resources": {"gpu": "a100-40gb", "gpus_per_node": 8, "nodes": 1},
        "backend": {"sagemaker": {"role": "arn:aws:iam::123456789012:role/Fake", "region": "us-east-1",
                                  "bucket": "fake-bucket"},
                    "vertex": {"project": "fake-project-000000", "region": "us-central1", "bucket": "gs://fake-bucket"},
                    "azureml": {"subscription_id": "00000000-0000-0000-0000-000000000000", "resource_group": "rg",
                                "workspace": "ws", "compute": "c"}}}
FAKE_KEY = "wbFakeKey" + "DoNotLeak" * 3
REPO = Path(__file__).parents[2]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Refuses(BaseHTTPRequestHandler):
    """Answers every request as the service does for a key it does not know (`status`, `body`)."""

    status, body, content_type = 403, b"", "application/xml"

    def _answer(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(self.status)
        self.send_header("Content-Type", self.content_type)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    do_GET = do_PUT = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def refusing_server():
    servers = []

    def start(status: int, body: bytes, content_type: str = "application/xml") -> str:
        handler = type("Handler", (Refuses,), {"status": status, "body": body, "content_type": content_type})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project folder with the spec, as the current directory; HOME and the clouds' config paths
    point into it (empty), so no credential of the machine running the tests is found."""
    root = tmp_path / "proj"
    root.mkdir()
    (root / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    home = tmp_path / "home"
    home.mkdir()
    for var in list(os.environ):
        if var.startswith(("AWS_", "AZURE_", "GOOGLE_", "CLOUDSDK_", "GCE_", "RAY_", "MSI_", "IDENTITY_")):
            monkeypatch.delenv(var)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(home / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(home / "gcloud"))
    monkeypatch.setenv("NO_GCE_CHECK", "True")
    monkeypatch.chdir(root)
    return root


def dispatch(backend: str, *sets: str) -> tuple[int, str]:
    """`workbench dispatch` in a process of its own: what the user's terminal shows, the SDKs' own
    logging included."""
    argv = ["dispatch", "spec.yaml", "--backend", backend, *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "workbench.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=100)
    return done.returncode, done.stdout + done.stderr


def assert_one_line(text: str, backend: str, *words: str) -> None:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {backend}: "), text
    assert "Traceback" not in text and FAKE_KEY not in text
    assert all(w in text for w in words), text


def test_sagemaker_without_credentials(project):
    code, text = dispatch("sagemaker")
    assert code == EXIT_NO_CREDENTIALS
    assert_one_line(text, "sagemaker", "no usable AWS credentials", "aws sso login")


def test_sagemaker_with_a_key_aws_refuses(project, refusing_server, monkeypatch):
    """S3 answers PutObject for an unknown access key with 403 InvalidAccessKeyId."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFAKEFAKEFAKEFAKE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_KEY)
    body = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InvalidAccessKeyId</Code><Message>The AWS Access '
            b"Key Id you provided does not exist in our records.</Message></Error>")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", refusing_server(403, body))
    code, text = dispatch("sagemaker")
    assert code == EXIT_NO_CREDENTIALS
    assert_one_line(text, "sagemaker", "refused the credentials", "PutObject: InvalidAccessKeyId")


def test_sagemaker_unreachable(project, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFAKEFAKEFAKEFAKE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_KEY)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    code, text = dispatch("sagemaker")
    assert code == EXIT_UNREACHABLE
    assert_one_line(text, "sagemaker", "cannot reach AWS", "HTTPS_PROXY")


def test_vertex_with_a_malformed_key_file(project, monkeypatch):
    """google-auth refuses a key file without its fields before any request."""
    key = project.parent / "home" / "key.json"
    key.write_text(json.dumps({"type": "service_account", "private_key_id": FAKE_KEY}))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    code, text = dispatch("vertex")
    assert code == EXIT_NO_CREDENTIALS
    assert_one_line(text, "vertex", "no usable Google credentials", "gcloud auth application-default login")


def test_vertex_without_credentials(project):
    code, text = dispatch("vertex")
    assert code == EXIT_NO_CREDENTIALS
    assert_one_line(text, "vertex", "no usable Google credentials", "GOOGLE_APPLICATION_CREDENTIALS")


def test_azureml_when_the_login_endpoint_cannot_be_reached(project, monkeypatch):
    """DefaultAzureCredential's first source (a service principal in the environment) cannot reach its
    authority: the chain stops there with ClientAuthenticationError and its many-line message."""
    pytest.importorskip("azure.ai.ml")
    monkeypatch.setenv("AZURE_TENANT_ID", "00000000-0000-0000-0000-000000000001")
    monkeypatch.setenv("AZURE_CLIENT_ID", "00000000-0000-0000-0000-000000000002")
    monkeypatch.setenv("AZURE_CLIENT_SECRET", FAKE_KEY)
    monkeypatch.setenv("AZURE_AUTHORITY_HOST", f"https://127.0.0.1:{closed_port()}")
    code, text = dispatch("azureml")
    assert code == EXIT_NO_CREDENTIALS
    assert_one_line(text, "azureml", "no Azure token", "az login")


def test_ray_unreachable(project):
    pytest.importorskip("ray")
    address = f"http://127.0.0.1:{closed_port()}"
    code, text = dispatch("ray", f"backend.ray.address={address}")
    assert code == EXIT_UNREACHABLE
    assert_one_line(text, "ray", f"cannot reach the Ray dashboard at {address}", "backend.ray.address")


def test_ray_dashboard_refuses_the_token(project, refusing_server, monkeypatch):
    """A cluster started with token authentication answers 401 to a request without its token."""
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_AUTH_TOKEN", FAKE_KEY)
    address = refusing_server(401, b"Unauthorized: missing or invalid token", "text/plain")
    code, text = dispatch("ray", f"backend.ray.address={address}")
    assert code == EXIT_NO_CREDENTIALS
    assert_one_line(text, "ray", "refused the request", "RAY_AUTH_TOKEN")
