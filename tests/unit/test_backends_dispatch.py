"""`dispatch --dry-run` for every remote target: a complete request, no SDK at import, no secrets."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import backends
from tests.helpers.cli import run_cli
from workbench.errors import ConfigError
from workbench.spec import load_spec

SECRETS = {"AWS_SECRET_ACCESS_KEY": "wbLeakAws" + "X" * 20, "AZURE_CLIENT_SECRET": "wbLeakAzure" + "Y" * 20,
           "RAY_AUTH_TOKEN": "wbLeakRay" + "Z" * 20, "GOOGLE_OAUTH_ACCESS_TOKEN": "wbLeakGcp" + "W" * 20}
SDKS = {"sagemaker": "boto3", "vertex": "google.cloud.aiplatform_v1", "azureml": "azure.ai.ml", "ray": "ray"}


def test_backend_modules_import_no_sdk():
    code = ("import sys, workbench, backends, backends.sagemaker, backends.vertex, backends.azureml, "
            "backends.ray_cluster, backends.bundle, backends.instances, workbench.cloud_entry\n"
            "bad = [m for m in ('boto3', 'botocore', 'google.cloud.aiplatform', 'google.cloud.aiplatform_v1', "
            "'azure.ai.ml', 'azure.identity', 'ray', 'torch') if m in sys.modules]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.filterwarnings("ignore:The `context` parameter is deprecated")
@pytest.mark.parametrize("name", ["ray", "sagemaker", "vertex", "azureml"])
def test_dry_run_of_the_example_is_complete_and_clean(name, monkeypatch):
    pytest.importorskip(SDKS[name])
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    out = backends.dispatch(load_spec("examples/cloud-spot.yaml"), backend=name, dry_run=True)
    text = json.dumps(out)
    assert out["backend"] == name
    request = out["request"]
    assert {"operation", "endpoint", "body", "code"} <= set(request)
    assert request["code"]["files"] > 10 and "workbench_job.json" in request["code"]["top_level"]
    assert "workbench.cloud_entry" in text or "cloud_entry.py" in text
    for value in SECRETS.values():
        assert value not in text


def test_cli_prints_the_request(monkeypatch):
    """`workbench dispatch --dry-run` in this process (tests/helpers/cli.py): the SDKs the cloud
    tests already imported are not imported again by a new `python -m workbench.cli`."""
    pytest.importorskip("boto3")
    for key, value in {**SECRETS, "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    out = run_cli("dispatch", "examples/cloud-spot.yaml", "--backend", "sagemaker", "--dry-run")
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    assert printed["backend"] == "sagemaker"
    assert printed["request"]["body"]["EnableManagedSpotTraining"] is True
    assert not any(v in out.stdout + out.stderr for v in SECRETS.values())
    bad = run_cli("dispatch", "examples/cloud-spot.yaml", "--backend", "sagemaker", "--dry-run",
                  "--set", "backend.sagemaker.region=mars-1")
    assert bad.returncode == 2 and "not a SageMaker training region" in bad.stderr


@pytest.mark.parametrize("name", ["ray", "sagemaker", "vertex", "azureml"])
def test_what_the_runtime_cannot_run_is_refused_before_submission(name):
    # offload=cpu with zero=0 is a valid spec to plan, but no worker could run it (check_runnable).
    spec = load_spec("examples/cloud-spot.yaml").replace(**{"layout.offload": "cpu"})
    with pytest.raises(ConfigError, match="offload=cpu with zero=0"):
        backends.dispatch(spec, backend=name, dry_run=True)


@pytest.mark.parametrize("uri,note", [
    ("ckpt/run", "is relative: on the cluster checkpoints land in the job's temporary working directory"),
    ("/mnt/shared/run", "every node of the cluster must see the same folder there"),
    ("s3://bucket/run", None),
])
def test_ray_dry_run_says_when_restarted_ranks_may_not_find_the_checkpoints(uri, note):
    pytest.importorskip("ray")
    # on-demand: with spot a relative uri is refused (tests/unit/test_backends_ray_cluster.py, issue 33)
    spec = load_spec("examples/cloud-spot.yaml").replace(**{"checkpoint.uri": uri, "backend.spot": False})
    notes = backends.dispatch(spec, backend="ray", dry_run=True)["request"]["notes"]
    assert (note is None and notes == []) or (len(notes) == 1 and note in notes[0])


@pytest.mark.parametrize("name", ["sagemaker", "ray"])
def test_a_dry_run_reads_no_data_in_a_bucket_but_checks_a_local_path(name, monkeypatch, tmp_path):
    """The machine that dispatches may have neither the credentials nor the network the job has: token
    shards at an object-store URI are checked by the job when it starts, not read here (found from
    outside: without credentials the dry-run failed, with keys it signed a request and sent it)."""
    pytest.importorskip(SDKS[name])
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    bucket = ["data.source=tokens", "data.path=s3://wb-no-such-bucket/tokens"]
    out = backends.dispatch(load_spec("examples/cloud-spot.yaml", bucket), backend=name, dry_run=True)
    assert out["backend"] == name
    with pytest.raises(ConfigError, match="no index.json under"):
        backends.dispatch(load_spec("examples/cloud-spot.yaml", ["data.source=tokens", f"data.path={tmp_path}"]),
                          backend=name, dry_run=True)
