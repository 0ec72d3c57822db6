"""Issue 33: the cloud entrypoint recovers by itself. Started as SageMaker's DLC starts it now (one
process per instance, no LOCAL_RANK), it starts the spec's ranks per node itself (2 gloo ranks on a
CPU "instance"), resumes from the newest complete checkpoint or starts fresh when none is complete
(a warning event, exit 0, not the old exit 2), and restarts a rank group whose rank crashed, per
`backend.max_failures`, from the last checkpoint."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.common import popen_own_group

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(400)]
ROOT = Path(__file__).resolve().parents[2]


def job(tmp_path, steps: int, max_failures: int = 0, every: int = 2) -> list[str]:
    spec = {"name": "recovery", "model": {"preset": "gpt-tiny"}, "layout": {"dp": 2},
            "resources": {"gpu": "cpu", "gpus_per_node": 2},
            "train": {"steps": steps, "global_batch": 4, "micro_batch": 2},
            "checkpoint": {"every_steps": every, "keep": 2}, "backend": {"max_failures": max_failures}}
    (tmp_path / "job.json").write_text(json.dumps(spec))
    return [sys.executable, "-m", "workbench.cloud_entry", "--spec", str(tmp_path / "job.json")]


def sagemaker_env(tmp_path) -> dict:
    """What SageMaker's DLC gives the entrypoint it runs once per instance (script mode, no distribution)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT",
                                                            "MASTER_ADDR")}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {**env, "SM_TRAINING_ENV": "{}", "SM_HOSTS": '["algo-1"]', "SM_CURRENT_HOST": "algo-1",
            "TRAINING_JOB_NAME": "recovery-job", "WORKBENCH_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
            "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORKBENCH_LEASE_TTL_S": "30"}


def events(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith('{"event"')]


def test_all_incomplete_checkpoints_start_fresh_with_a_warning_on_a_cpu_instance_of_two_ranks(tmp_path):
    # A manifest whose rank file never arrived (SageMaker's background sync keeps no order).
    step = tmp_path / "ckpt" / "step-000000004"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"format": 1, "step": 4, "spec": {},
                                                    "files": {"rank0.distcp": {"bytes": 1, "crc32": 0}}}))
    out = subprocess.run(job(tmp_path, steps=4), env=sagemaker_env(tmp_path), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--nproc_per_node=2" in out.stdout  # the spec's ranks per node, on a CPU instance
    ev = events(out.stdout)
    assert {e["rank"] for e in ev if e["event"] == "memory"} == {0, 1}
    assert [e["step"] for e in ev if e["event"] == "step"] == [1, 2, 3, 4]
    restart = [e for e in ev if e["event"] == "restart"]
    assert restart and restart[0]["from_step"] == 0 and restart[0]["rejected"] == [4]  # the run's record of it
    warnings = [e["message"] for e in ev if e["event"] == "warning"]
    assert any("step 4" in w and "incomplete or corrupt" in w for w in warnings), warnings
    assert any("starting from step 0" in w for w in warnings), warnings
    assert [e["status"] for e in ev if e["event"] == "end"] == ["completed"]


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_crashed_rank_is_restarted_from_the_checkpoint_per_max_failures(tmp_path):
    proc = popen_own_group(job(tmp_path, steps=24, max_failures=1), env=sagemaker_env(tmp_path),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    manifest = tmp_path / "ckpt" / "step-000000002" / "manifest.json"
    deadline = time.monotonic() + 300
    while not manifest.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (torchrun,) = _children(proc.pid)
    ranks = _children(torchrun)
    assert len(ranks) == 2
    os.kill(ranks[-1], signal.SIGKILL)  # a rank crashes (OOM killer, a segfault)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    ev = events(out)
    restarts = [e for e in ev if e["event"] == "restart"]
    assert [r["attempt"] for r in restarts] == [0, 1]
    assert restarts[1]["from_step"] >= 2  # resumed from a checkpoint, not from step 1
    assert [e["status"] for e in ev if e["event"] == "end"] == ["completed"]
    steps = [e["step"] for e in ev if e["event"] == "step"]
    assert steps[-1] == 24 and set(range(1, 25)) <= set(steps)
