"""The in-cloud entrypoint: each cloud's rendezvous and checkpoint variables, and a real torchrun
launch of two gloo ranks from a Vertex-style node-level start."""
from __future__ import annotations

import inspect
import json
import os
import socket
import subprocess
import sys

import pytest

from workbench import cloud_entry as E
from workbench.errors import ConfigError
from workbench.spec import load_spec

# What SageMaker's torchrun launcher (torch_distributed) leaves in each rank's environment.
SAGEMAKER_RANK = {"SM_TRAINING_ENV": "{}", "SM_CURRENT_HOST": "algo-2", "SM_HOSTS": '["algo-1", "algo-2"]',
                  "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "algo-1", "MASTER_PORT": "7777"}
# What Vertex sets on each replica of a 3-node job (chief pool 0, workers in pool 1).
VERTEX_NODE = {"CLUSTER_SPEC": json.dumps({"cluster": {"workerpool0": ["cmle-training-workerpool0-ab-0:2222"],
                                                       "workerpool1": ["cmle-training-workerpool1-ab-0:2222",
                                                                       "cmle-training-workerpool1-ab-1:2222"]},
                                           "environment": "cloud", "task": {"type": "workerpool1", "index": 1}}),
               "AIP_CHECKPOINT_DIR": "gs://bkt/workbench/run/checkpoints/", "CLOUD_ML_JOB_ID": "123"}
AZURE_RANK = {"AZUREML_RUN_ID": "run-1", "AZ_BATCHAI_JOB_NAME": "j", "RANK": "3", "LOCAL_RANK": "3", "NODE_RANK": "0",
              "WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.4", "MASTER_PORT": "6105",
              "AZURE_ML_OUTPUT_CHECKPOINTS": "/mnt/azureml/cr/j/outputs/checkpoints"}


def test_detect_cloud():
    assert E.detect_cloud(SAGEMAKER_RANK) == "sagemaker"
    assert E.detect_cloud(VERTEX_NODE) == "vertex"
    assert E.detect_cloud(AZURE_RANK) == "azureml"
    assert E.detect_cloud({"WORKBENCH_CLOUD": "ray", **VERTEX_NODE}) == "ray"
    assert E.detect_cloud({}) == "generic"


def test_checkpoint_dirs():
    assert E.checkpoint_dir("sagemaker", SAGEMAKER_RANK) == "/opt/ml/checkpoints"
    assert E.checkpoint_dir("vertex", VERTEX_NODE) == "/gcs/bkt/workbench/run/checkpoints/"
    assert E.checkpoint_dir("azureml", AZURE_RANK) == "/mnt/azureml/cr/j/outputs/checkpoints"
    assert E.checkpoint_dir("azureml", AZURE_RANK, "/mnt/given") == "/mnt/given"  # --checkpoint-dir wins
    assert E.checkpoint_dir("vertex", {**VERTEX_NODE, "WORKBENCH_CHECKPOINT_DIR": "gs://b/x/"}) == "/gcs/b/x/"
    assert E.checkpoint_dir("generic", {}) is None


def test_per_rank_or_per_node():
    assert E.launched_per_rank(SAGEMAKER_RANK) and E.launched_per_rank(AZURE_RANK)
    assert not E.launched_per_rank(VERTEX_NODE)
    assert not E.launched_per_rank({"RANK": "1", "WORLD_SIZE": "2"})  # Vertex's per-node torch variables


def test_vertex_cluster_spec_gives_node_rank_and_master():
    rdzv = E.node_rendezvous("vertex", VERTEX_NODE)
    assert rdzv == E.Rendezvous(3, 2, "cmle-training-workerpool0-ab-0", 2222)
    rdzv = E.node_rendezvous("vertex", {**VERTEX_NODE, "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "3333"})
    assert (rdzv.master_addr, rdzv.master_port) == ("10.1.1.1", 3333)


def test_sagemaker_hosts_and_torch_style_fallback():
    assert E.node_rendezvous("sagemaker", {"SM_HOSTS": '["algo-2", "algo-1"]', "SM_CURRENT_HOST": "algo-2"}) == \
        E.Rendezvous(2, 1, "algo-1", E.DEFAULT_PORT)
    assert E.node_rendezvous("generic", {"WORLD_SIZE": "4", "RANK": "3", "MASTER_ADDR": "h"}) == \
        E.Rendezvous(4, 3, "h", E.DEFAULT_PORT)


def test_torchrun_command_reruns_this_module_with_the_same_args():
    cmd = E.torchrun_command(E.Rendezvous(2, 1, "h", 29500), 4, ["--spec", "s.json"])
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert {"--nnodes=2", "--node_rank=1", "--nproc_per_node=4", "--master_addr=h", "--master_port=29500"} <= set(cmd)
    assert cmd[-4:] == ["-m", "workbench.cloud_entry", "--spec", "s.json"]


def test_max_failures_restarts_through_the_c10d_rendezvous():
    cmd = E.torchrun_command(E.Rendezvous(2, 1, "h", 29500), 4, ["--spec", "s.json"], max_restarts=3, run="job-7")
    assert {"--nnodes=2", "--nproc_per_node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=h:29500", "--rdzv-id=job-7",
            "--max-restarts=3"} <= set(cmd)
    assert not any(a.startswith(("--node_rank", "--master_addr")) for a in cmd)  # c10d ignores them


def test_only_the_last_attempts_exit_codes_count(tmp_path):
    for name, code in [("exit-a0-rank0", "1"), ("exit-a0-rank1", "2"), ("exit-a1-rank0", "0"), ("exit-a1-rank1", "0"),
                       ("junk", "x")]:
        (tmp_path / name).write_text(code)
    assert E.last_attempt_codes(tmp_path) == {0}
    assert E.last_attempt_codes(tmp_path / "none") == set()


def test_world_size_mismatch_is_a_config_error():
    spec = load_spec("examples/cloud-spot.yaml")
    E.check_world(spec, {"WORLD_SIZE": "8"})
    with pytest.raises(ConfigError, match=r"started 16 ranks.*= 8"):
        E.check_world(spec, {"WORLD_SIZE": "16"})


def _train_takes_resume() -> bool:
    try:
        from workbench.runtime.loop import train
    except ImportError:
        return False
    return "resume" in inspect.signature(train).parameters


@pytest.mark.distributed
# torchrun and two gloo ranks (6-7 s): slow. The fast loop keeps each part of the route: the Vertex
# rendezvous and the torchrun command (above), cloud_entry.main training a job
# (test_backends_bundle.py::test_the_job_runs_from_the_bundle_alone), dp=2 on gloo (tests/distributed).
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not _train_takes_resume(), reason="needs workbench.runtime.loop.train(..., resume=)")
def test_vertex_style_node_start_runs_two_gloo_ranks(tmp_path):
    raw = load_spec("examples/cloud-spot.yaml").to_dict()
    raw.update(resources={"gpu": "cpu", "gpus_per_node": 2, "nodes": 1}, layout={"dp": 2},
               precision={"dtype": "fp32"}, checkpoint={"every_steps": 2})
    raw["train"].update(steps=2, global_batch=8, micro_batch=4)
    raw["backend"] = {"name": "vertex", "vertex": raw["backend"]["vertex"]}
    (tmp_path / "job.json").write_text(json.dumps(raw))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(CLUSTER_SPEC=json.dumps({"cluster": {"workerpool0": [f"127.0.0.1:{port}"]},
                                        "task": {"type": "workerpool0", "index": 0}}),
               AIP_CHECKPOINT_DIR=str(tmp_path / "ckpt"), PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-m", "workbench.cloud_entry", "--spec", str(tmp_path / "job.json")],
                         env=env, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"event"')]
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2]
    assert [e["status"] for e in events if e["event"] == "end"] == ["completed"]  # rank 0 reports the end
    assert {e["rank"] for e in events if e["event"] == "memory"} == {0, 1}  # both ranks ran and reported


def test_the_refusal_names_the_flags_each_route_takes():
    from workbench.runtime.checkpoint_store import RESUME_OR_FRESH, all_rejected

    message = str(all_rejected("/ckpt", [(4, "rank1.distcp: missing")]))
    assert "workbench run --resume-or-fresh" in message and "--strict-resume" in message
    assert E.resume_mode(strict=False) == RESUME_OR_FRESH and E.resume_mode(strict=True) is True
    with pytest.raises(ConfigError, match="contradict"):
        E.main(["--spec", "x.json", "--strict-resume", "--resume-or-fresh"])
