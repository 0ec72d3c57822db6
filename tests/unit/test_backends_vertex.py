"""Vertex AI backend: the CustomJob body, its validation by the real proto, and the rules."""
from __future__ import annotations

import json

import pytest

from backends.base import JobState
from backends.vertex import build_body, check, map_state
from tests.helpers.specs import cloud_spot
from workbench.errors import ConfigError


def test_body_validates_against_the_v1_proto():
    aiplatform_v1 = pytest.importorskip("google.cloud.aiplatform_v1")
    body, _ = build_body(cloud_spot(), "j", "workbench/cloud-spot/j/code.tar.gz", "gs://b/workbench/cloud-spot/checkpoints/")
    job = aiplatform_v1.CustomJob.from_json(json.dumps(body))
    assert job.job_spec.scheduling.strategy == aiplatform_v1.Scheduling.Strategy.SPOT
    assert job.job_spec.worker_pool_specs[0].machine_spec.accelerator_type == aiplatform_v1.AcceleratorType.NVIDIA_TESLA_T4
    with pytest.raises(Exception):  # noqa: B017 (protobuf's ParseError) a misspelt field is refused by the proto, before any network
        aiplatform_v1.CustomJob.from_json(json.dumps({**body, "jobSpec": {**body["jobSpec"], "schedulng": {}}}))


def test_checkpoint_dir_follows_base_output_or_is_passed_explicitly():
    body, _ = build_body(cloud_spot(), "j", "k", "gs://b/runs/x/checkpoints/")
    assert body["jobSpec"]["baseOutputDirectory"]["outputUriPrefix"] == "gs://b/runs/x/"
    env = body["jobSpec"]["workerPoolSpecs"][0]["containerSpec"]["env"]
    assert "WORKBENCH_CHECKPOINT_DIR" not in {e["name"] for e in env}
    body, _ = build_body(cloud_spot(), "j", "k", "gs://b/elsewhere/ckpt/")
    env = {e["name"]: e["value"] for e in body["jobSpec"]["workerPoolSpecs"][0]["containerSpec"]["env"]}
    assert env["WORKBENCH_CHECKPOINT_DIR"] == "gs://b/elsewhere/ckpt/"


def test_cpu_pools_have_no_accelerator_and_single_node_has_one_pool():
    s = cloud_spot(**{"resources.gpu": "cpu", "resources.nodes": 1, "resources.gpus_per_node": 2, "layout.dp": 2,
                "train.micro_batch": 8, "backend.spot": False})
    body, _ = build_body(s, "j", "k", "gs://b/c/checkpoints/")
    (pool,) = body["jobSpec"]["workerPoolSpecs"]
    assert pool["machineSpec"] == {"machineType": "n1-standard-8"}
    assert "strategy" not in body["jobSpec"]["scheduling"]


@pytest.mark.parametrize("overrides,message", [
    ({"backend.vertex.project": None}, "project is required"),
    ({"backend.vertex.project": "My Project"}, "not a project id"),
    ({"backend.vertex.bucket": None}, "bucket is required"),
    ({"backend.vertex.region": "us-central9"}, "not a Vertex AI training region"),
])
def test_rules(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check(cloud_spot(**overrides))


def test_a10g_is_not_sold_by_vertex():
    with pytest.raises(ConfigError, match="Vertex AI offers no a10g"):
        build_body(cloud_spot(**{"resources.gpu": "a10g"}), "j", "k", "gs://b/c/checkpoints/")


def test_states():
    assert map_state("JOB_STATE_QUEUED").state is JobState.PENDING
    assert map_state("JOB_STATE_RUNNING").state is JobState.RUNNING
    assert map_state("JOB_STATE_SUCCEEDED").state is JobState.COMPLETED
    assert map_state("JOB_STATE_FAILED", "boom").message == "boom"
    assert map_state("JOB_STATE_CANCELLED").state is JobState.STOPPED
