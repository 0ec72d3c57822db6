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
