"""SageMaker backend against moto's server on loopback: boto3 uploads the bundle to moto's S3 and
creates the training job; moto's recorder keeps the exact request, which the test reads back."""
from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")

from backends.base import JobState  # noqa: E402
from backends.sagemaker import SageMakerBackend  # noqa: E402
from bench.common import OWN_GROUP  # noqa: E402
from workbench.errors import ConfigError  # noqa: E402
from workbench.spec import load_spec  # noqa: E402

pytestmark = [pytest.mark.cloud, pytest.mark.timeout(120)]

FAKE_SECRET = "wbFakeSecret/" + "DoNotLeak" * 3  # built at run time: no key-shaped literal in the repo
BUCKET = "wb-test-bucket"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def moto_server(tmp_path_factory):
    record = tmp_path_factory.mktemp("moto") / "requests.jsonl"
    port = _free_port()
    exe = Path(sys.executable).parent / "moto_server"
    env = {**os.environ, "MOTO_ENABLE_RECORDING": "1", "MOTO_RECORDER_FILEPATH": str(record)}
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], env=env, **OWN_GROUP,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("moto_server did not start")
    yield f"http://127.0.0.1:{port}", record
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


@pytest.fixture
def aws_env(moto_server, monkeypatch):
    url, record = moto_server
    monkeypatch.setenv("AWS_ENDPOINT_URL", url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWBTESTFAKE" + "000000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    return url, record


def make_project(root: Path) -> Path:
    """A user project with everything that must not travel: git, venv, checkpoints, ignored files, keys."""
    root.mkdir(parents=True)
    (root / "train_extra.py").write_text("X = 1\n")
    (root / ".gitignore").write_text("data/\n*.log\n")
    for d in (".git", ".venv", "checkpoints", "data", "sub/__pycache__"):
        (root / d).mkdir(parents=True)
    (root / ".git" / "config").write_text("[core]\n")
    (root / ".venv" / "pyvenv.cfg").write_text("home = /usr\n")
    (root / "checkpoints" / "step-10").write_text("weights")
    (root / "data" / "big.bin").write_bytes(b"0" * 1000)
    (root / "run.log").write_text("log")
    (root / ".env").write_text(f"AWS_SECRET_ACCESS_KEY={FAKE_SECRET}\n")
    (root / "notes.py").write_text('aws_secret_access_key = "' + "wbFake7K2q" * 4 + '"\n')  # found by its content
    return root


def spec(tmp_path, **overrides):
    raw = load_spec("examples/cloud-spot.yaml").to_dict()
    raw["backend"]["sagemaker"]["bucket"] = BUCKET
    raw["backend"]["include"] = ["*"]  # the whole project: what is named still passes the filters
    s = load_spec(raw)
    return s.replace(**overrides) if overrides else s


def test_submit_uploads_bundle_and_creates_spot_job(aws_env, tmp_path, capsys):
    url, record = aws_env
    session = boto3.Session()
    session.client("s3").create_bucket(Bucket=BUCKET)
    job_spec = spec(tmp_path)
    root = make_project(tmp_path / "proj")
    backend = SageMakerBackend(session=session, root=root)
    with pytest.raises(ConfigError, match=r"notes.py, line 1: "):
        backend.dry_run(job_spec)  # a key in a plain file stops the dispatch
    (root / "notes.py").unlink()  # as its owner would
    dry = json.dumps(backend.dry_run(job_spec))

    handle = backend.submit(job_spec)

    # The recorded CreateTrainingJob request, as it went over the wire.
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    create = [c for c in calls if "CreateTrainingJob" in c["headers"].get("X-Amz-Target", "")]
    assert len(create) == 1
    raw = create[0]["body"]
    body = json.loads(base64.b64decode(raw) if create[0].get("body_encoded") else raw)
    assert body["TrainingJobName"] == handle.job_id
    assert body["EnableManagedSpotTraining"] is True
    stop = body["StoppingCondition"]
    assert stop == {"MaxRuntimeInSeconds": 14400, "MaxWaitTimeInSeconds": 43200}
    assert stop["MaxWaitTimeInSeconds"] >= stop["MaxRuntimeInSeconds"]
    assert body["CheckpointConfig"] == {"S3Uri": f"s3://{BUCKET}/workbench/cloud-spot/checkpoints/",
                                        "LocalPath": "/opt/ml/checkpoints"}
    assert body["ResourceConfig"]["InstanceType"] == "ml.g4dn.12xlarge"  # 4 x T4
    assert body["ResourceConfig"]["InstanceCount"] == 2
    assert body["RetryStrategy"] == {"MaximumRetryAttempts": 3}
    image = body["AlgorithmSpecification"]["TrainingImage"]
    assert image.startswith("763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:") and "-gpu-" in image
    hp = body["HyperParameters"]
    assert json.loads(hp["sagemaker_program"]) == "workbench/cloud_entry.py"
    assert "sagemaker_torch_distributed_enabled" not in hp  # our entrypoint starts the ranks (one process per node)
    code_uri = json.loads(hp["sagemaker_submit_directory"])

    # The bundle moto's S3 received is the one the job names, and it carries no secret or junk.
    key = code_uri.removeprefix(f"s3://{BUCKET}/")
    data = session.client("s3").get_object(Bucket=BUCKET, Key=key)["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert "workbench/cloud_entry.py" in members and "backends/sagemaker.py" in members
    assert "train_extra.py" in members
    for junk in (".git/config", ".venv/pyvenv.cfg", "checkpoints/step-10", "data/big.bin", "run.log", ".env",
                 "notes.py"):
        assert junk not in members, junk
    travelled = json.loads(members["workbench_job.json"])
    assert travelled["checkpoint"]["uri"] == f"s3://{BUCKET}/workbench/cloud-spot/checkpoints/"
    assert all(FAKE_SECRET.encode() not in blob for blob in members.values())

    # moto completes jobs at once.
    status = handle.wait(timeout_s=30, poll_s=0.5)
    assert status.state is JobState.COMPLETED
    assert handle.logs() == ""  # no CloudWatch stream in moto: an empty log, not an error
    out = capsys.readouterr()
    for text in (dry, out.out, out.err):
        assert FAKE_SECRET not in text and "AKIAWBTESTFAKE" not in text


def test_dry_run_needs_no_credentials_or_network(monkeypatch, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    root = make_project(tmp_path / "proj")
    (root / "notes.py").unlink()
    req = SageMakerBackend(root=root).dry_run(spec(tmp_path))
    assert req["operation"] == "CreateTrainingJob"
    assert req["endpoint"] == "https://api.sagemaker.us-east-1.amazonaws.com/"
    assert req["body"]["CheckpointConfig"]["S3Uri"].endswith("/")
    assert req["code"]["excluded_credential_files"] == [".env"]
    assert "Authorization" not in json.dumps(req)
