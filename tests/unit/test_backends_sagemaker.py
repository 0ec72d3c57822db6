"""SageMaker backend: the request it builds, the rules it checks, and the spot lifecycle it reports."""
from __future__ import annotations

import datetime

import pytest

from backends.base import JobState
from backends.sagemaker import SageMakerBackend, SageMakerJob, build_request, check, map_status
from tests.helpers.specs import cloud_spot
from workbench.errors import ConfigError
from workbench.spec import load_spec


def test_request_has_spot_checkpoints_retries_and_torchrun():
    s = cloud_spot()
    params, notes = build_request(s, "job-1", "s3://b/code.tar.gz", "s3://b/ckpt/")
    assert params["EnableManagedSpotTraining"] is True
    assert params["StoppingCondition"]["MaxWaitTimeInSeconds"] >= params["StoppingCondition"]["MaxRuntimeInSeconds"]
    assert params["CheckpointConfig"]["LocalPath"] == "/opt/ml/checkpoints"
    assert params["RetryStrategy"]["MaximumRetryAttempts"] == 3
    # No distribution flag: the DLC runs our entrypoint once per instance, which starts the ranks itself
    # (the DLC's torchrun launcher counts GPUs, 0 on CPU instances, and exits 1 on a rank's 75).
    assert not any(k.startswith("sagemaker_") and "distributed" in k for k in params["HyperParameters"])
    assert set(params["HyperParameters"]) == {"sagemaker_program", "sagemaker_submit_directory", "sagemaker_region",
                                              "spec"}
    assert params["ResourceConfig"] == {"InstanceType": "ml.g4dn.12xlarge", "InstanceCount": 2, "VolumeSizeInGB": 100}


def test_max_failures_is_not_sagemakers_retry_strategy():
    """SageMaker's RetryStrategy retries only its own internal errors: `max_failures` is the entrypoint's
    torchrun --max-restarts (tests/integration/test_cloud_entry_recovery.py), the service's retries stay 3."""
    params, _ = build_request(cloud_spot(**{"backend.max_failures": 5}), "j", "s3://b/c", "s3://b/k/")
    assert params["RetryStrategy"] == {"MaximumRetryAttempts": 3}


def test_on_demand_has_no_max_wait_and_user_image_wins():
    s = cloud_spot(**{"backend.spot": False, "backend.sagemaker.image": "123.dkr.ecr.us-east-1.amazonaws.com/mine:1"})
    params, _ = build_request(s, "j", "s3://b/c", "s3://b/k/")
    assert params["EnableManagedSpotTraining"] is False
    assert "MaxWaitTimeInSeconds" not in params["StoppingCondition"]
    assert params["AlgorithmSpecification"]["TrainingImage"].endswith("/mine:1")


def test_h100_eight_per_node_is_p5_and_four_is_refused():
    s = cloud_spot(**{"resources.gpu": "h100-80gb", "resources.gpus_per_node": 8, "resources.nodes": 1})
    assert build_request(s, "j", "s3://b/c", "s3://b/k/")[0]["ResourceConfig"]["InstanceType"] == "ml.p5.48xlarge"
    s = cloud_spot(**{"resources.gpu": "h100-80gb", "resources.gpus_per_node": 4, "resources.nodes": 2})
    with pytest.raises(ConfigError, match=r"gpus_per_node=4.*offers 8 per node"):
        build_request(s, "j", "s3://b/c", "s3://b/k/")


@pytest.mark.parametrize("field,value,message", [
    ("backend.sagemaker.role", None, "role is required"),
    ("backend.sagemaker.role", "SageMakerRole", "not an IAM role ARN"),
    ("backend.sagemaker.bucket", None, "bucket is required"),
    ("backend.sagemaker.region", "us-east-9", "not a SageMaker training region"),
    ("backend.sagemaker.instance_type", "p5.48xlarge", "start with 'ml.'"),
    ("backend.max_runtime_s", 30 * 86400, "28 days"),
])
def test_rules_name_the_field_and_the_fix(field, value, message):
    raw = cloud_spot().to_dict()
    section, key = field.rsplit(".", 1)
    node = raw
    for part in section.split("."):
        node = node[part]
    if value is None:
        node.pop(key, None)
    else:
        node[key] = value
    if field == "backend.max_runtime_s":
        raw["backend"]["max_wait_s"] = value
    with pytest.raises(ConfigError, match=message):
        check(load_spec(raw))


def test_checkpoint_uri_of_another_cloud_is_refused_and_local_path_replaced():
    with pytest.raises(ConfigError, match="s3:// URIs"):
        SageMakerBackend()._prepare(cloud_spot(**{"checkpoint.uri": "gs://elsewhere/ckpt"}))
    run_spec, params, _, notes = SageMakerBackend()._prepare(cloud_spot(**{"checkpoint.uri": "./checkpoints/x"}))
    assert params["CheckpointConfig"]["S3Uri"] == "s3://fake-workbench-bucket/workbench/cloud-spot/checkpoints/"
    assert any("local path" in n for n in notes)
    run_spec, params, _, _ = SageMakerBackend()._prepare(cloud_spot(**{"checkpoint.uri": "s3://other/run7"}))
    assert params["CheckpointConfig"]["S3Uri"] == "s3://other/run7/"  # trailing '/' added
    assert run_spec.checkpoint.uri == "s3://other/run7/"


def _describe(status, secondary, transitions=()):
    now = datetime.datetime(2026, 1, 1)
    d = {"TrainingJobName": "j", "TrainingJobArn": "arn:aws:sagemaker:us-east-1:1:training-job/j",
         "ModelArtifacts": {"S3ModelArtifacts": "s3://b/o"}, "TrainingJobStatus": status,
         "SecondaryStatus": secondary, "AlgorithmSpecification": {"TrainingInputMode": "File", "TrainingImage": "i"},
         "ResourceConfig": {"InstanceCount": 2, "InstanceType": "ml.g4dn.12xlarge", "VolumeSizeInGB": 100},
         "StoppingCondition": {"MaxRuntimeInSeconds": 3600, "MaxWaitTimeInSeconds": 7200},
         "CreationTime": now, "EnableManagedSpotTraining": True}
    if transitions:
        d["SecondaryStatusTransitions"] = [{"Status": t, "StartTime": now} for t in transitions]
    return d


@pytest.mark.timeout(30)
def test_spot_lifecycle_interrupted_restarting_completed():
    boto3 = pytest.importorskip("boto3")
    from botocore.stub import Stubber

    client = boto3.client("sagemaker", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    sequence = [("InProgress", "Starting"), ("InProgress", "Training"), ("InProgress", "Interrupted"),
                ("InProgress", "Restarting"), ("InProgress", "Training"), ("Completed", "Completed")]
    job = SageMakerJob(client, "j")
    with Stubber(client) as stub:
        for s in sequence:
            stub.add_response("describe_training_job", _describe(*s), {"TrainingJobName": "j"})
        states = [job.status() for _ in sequence]
        stub.assert_no_pending_responses()
    assert [s.state for s in states] == [JobState.PENDING, JobState.RUNNING, JobState.INTERRUPTED,
                                         JobState.RESTARTING, JobState.RUNNING, JobState.COMPLETED]
    assert [s.interruptions for s in states] == [0, 0, 1, 1, 1, 1]


def test_interruptions_counted_from_transitions_and_terminal_states():
    st = map_status(_describe("Completed", "Completed", ["Starting", "Training", "Interrupted", "Restarting",
                                                         "Training", "Interrupted", "Training", "Completed"]))
    assert st.state is JobState.COMPLETED and st.interruptions == 2
    assert map_status(_describe("Stopped", "MaxWaitTimeExceeded")).state is JobState.STOPPED
    failed = _describe("Failed", "Failed")
    failed["FailureReason"] = "AlgorithmError: exit 1"
    assert map_status(failed).state is JobState.FAILED and "AlgorithmError" in map_status(failed).message
