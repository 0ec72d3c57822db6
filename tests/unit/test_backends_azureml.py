"""Azure ML backend: the command job's REST body and the rules."""
from __future__ import annotations

import pytest

from backends.azureml import AzureMLBackend, check, map_status
from backends.base import JobState
from tests.helpers.specs import cloud_spot
from workbench.errors import ConfigError

pytest.importorskip("azure.ai.ml")
pytestmark = pytest.mark.filterwarnings("ignore:The `context` parameter is deprecated")


def test_dry_run_body():
    req = AzureMLBackend().dry_run(cloud_spot())
    props = req["body"]["properties"]
    assert "/workspaces/fake-workspace/jobs/cloud-spot-" in req["endpoint"] and "name" not in req["body"]
    assert "jobTier" not in (props.get("queueSettings") or {})  # a named cluster: its tier decides
    assert props["computeId"].endswith("/workspaces/fake-workspace/computes/fake-t4-cluster")  # as MLClient sends it
    assert "codeId" not in props and "properties.codeId" in req["filled_at_submit"]
    assert any("low_priority" in n for n in req["notes"])
    assert props["distribution"]["processCountPerInstance"] == 4
    assert props["limits"]["timeout"] == "PT4H"
    assert props["resources"]["shmSize"] == "16g"


def test_user_environment_or_image():
    props = AzureMLBackend().dry_run(cloud_spot(**{"backend.azureml.environment": "my-env:3"}))["body"]["properties"]
    assert props["environmentId"] == "azureml:my-env:3"
    on_demand = AzureMLBackend().dry_run(cloud_spot(**{"backend.spot": False}))["body"]["properties"]
    assert "queueSettings" not in on_demand or not on_demand["queueSettings"].get("jobTier")


@pytest.mark.parametrize("overrides,message", [
    ({"backend.azureml.subscription_id": None}, "subscription_id is required"),
    ({"backend.azureml.workspace": None}, "workspace is required"),
    ({"backend.azureml.subscription_id": "my-sub"}, "not a subscription id"),
])
def test_rules(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check(cloud_spot(**overrides))


def test_shape_and_checkpoint_scheme():
    with pytest.raises(ConfigError, match="Azure ML offers no l4"):
        AzureMLBackend().dry_run(cloud_spot(**{"resources.gpu": "l4"}))
    with pytest.raises(ConfigError, match="azureml:// URIs"):
        AzureMLBackend().dry_run(cloud_spot(**{"checkpoint.uri": "s3://b/c"}))


def test_status_map_counts_back_to_queue_as_restart():
    assert map_status("Preparing", has_run=False) is JobState.PENDING
    assert map_status("Queued", has_run=True) is JobState.RESTARTING
    assert map_status("Completed", has_run=True) is JobState.COMPLETED
    assert map_status("Failed", has_run=False) is JobState.FAILED


def _git_clone_with_remote(path, url):
    """A real git repository (one commit) whose origin is `url`, as `git clone <url>` leaves it."""
    import subprocess

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=path,
                       check=True, capture_output=True)

    git("init", "-q", "-b", "main", ".")
    git("remote", "add", "origin", url)
    (path / "README").write_text("x\n")
    git("add", "README")
    git("commit", "-q", "-m", "init")


def _no_git_env(monkeypatch):
    for var in ("AZUREML_GIT_REPOSITORY_URI", "AZUREML_GIT_BRANCH", "AZUREML_GIT_COMMIT", "AZUREML_GIT_DIRTY"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("remote", [
    "https://oauth2:ghp_FAKEgitREMOTEtokenMARKER0301abcdefgh@github.com/acme/train.git",
    "https://FAKEadoPAT52characterslong0000000000000000000000000@dev.azure.com/acme/ml/_git/train",
])
def test_dry_run_drops_git_properties_of_a_remote_with_a_token(tmp_path, monkeypatch, remote):
    """MLClient's create_or_update leaves the git properties out when has_pat_token(url): the dry-run
    does the same, so it equals the real PUT and never shows the token."""
    import json

    from azure.ai.ml.operations._job_ops_helper import has_pat_token

    assert has_pat_token(remote)  # the SDK's own rule, which the real submit applies
    spec = cloud_spot()  # loaded from the repository before we move into the clone
    _no_git_env(monkeypatch)
    _git_clone_with_remote(tmp_path, remote)
    monkeypatch.chdir(tmp_path)
    req = AzureMLBackend(root=tmp_path).dry_run(spec)
    text = json.dumps(req)
    assert "FAKE" not in text
    props = req["body"]["properties"]["properties"]
    assert not any(k.startswith("mlflow.source.git") or k == "azureml.git.dirty" for k in props)
    assert any("carries a token" in n for n in req["notes"])


def test_dry_run_keeps_git_properties_of_a_clean_remote(tmp_path, monkeypatch):
    spec = cloud_spot()
    _no_git_env(monkeypatch)
    _git_clone_with_remote(tmp_path, "https://github.com/acme/train.git")
    monkeypatch.chdir(tmp_path)
    props = AzureMLBackend(root=tmp_path).dry_run(spec)["body"]["properties"]["properties"]
    assert props["mlflow.source.git.repoURL"] == "https://github.com/acme/train.git"
    assert props["mlflow.source.git.branch"] == "main" and len(props["mlflow.source.git.commit"]) == 40


def test_dry_run_masks_a_password_the_sdk_rule_misses(tmp_path, monkeypatch):
    """has_pat_token only looks at https://; an http:// password would still be sent, so it is masked and named."""
    spec = cloud_spot()
    _no_git_env(monkeypatch)
    _git_clone_with_remote(tmp_path, "http://ci:FAKEhttpPASSWORD@git.internal/acme/train.git")
    monkeypatch.chdir(tmp_path)
    req = AzureMLBackend(root=tmp_path).dry_run(spec)
    assert "FAKEhttpPASSWORD" not in str(req)
    assert req["body"]["properties"]["properties"]["mlflow.source.git.repoURL"] == \
        "http://ci:***@git.internal/acme/train.git"
    assert any("carries a password" in n for n in req["notes"])
