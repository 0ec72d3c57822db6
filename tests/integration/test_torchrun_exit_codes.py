"""Exit codes on the torchrun route (issue 32, item 7): `python -m workbench.cloud_entry` starts
torchrun itself and exits as its ranks did (75 after a preemption notice, 2 for a refused resume),
and ranks whose launcher was SIGKILLed stop with a checkpoint instead of training on unsupervised."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.common import popen_own_group

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(400)]
ROOT = Path(__file__).resolve().parents[2]


def job(tmp_path, steps=400) -> list[str]:
    spec = {"name": "exits", "model": {"preset": "gpt-tiny"}, "layout": {"dp": 2},
            "resources": {"gpu": "cpu", "gpus_per_node": 2}, "train": {"steps": steps, "global_batch": 4, "micro_batch": 2},
            "checkpoint": {"every_steps": 4}}
    (tmp_path / "job.json").write_text(json.dumps(spec))
    return [sys.executable, "-m", "workbench.cloud_entry", "--spec", str(tmp_path / "job.json")]


def env(tmp_path) -> dict:
    out = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {**out, "WORKBENCH_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "PYTHONPATH": str(ROOT),
            "MASTER_PORT": str(port), "WORKBENCH_LEASE_TTL_S": "30"}


def wait_for(path: Path, proc: subprocess.Popen, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_preemption_notice_exits_75_with_a_checkpoint(tmp_path):
    proc = popen_own_group(job(tmp_path), env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(tmp_path / "ckpt" / "step-000000004" / "manifest.json", proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    assert err.splitlines()[-1] == ("workbench: exit 75: stopped on a preemption notice after writing a checkpoint; "
                                    "run again to resume")
    end = [json.loads(line) for line in out.splitlines() if line.startswith('{"event": "end"')]
    assert end and end[-1]["status"] == "preempted"
    assert (tmp_path / "ckpt" / f"step-{end[-1]['step']:09d}" / "manifest.json").exists()
    assert not (tmp_path / "ckpt" / "lease.json").exists()


def test_ranks_whose_launcher_is_killed_checkpoint_and_stop(tmp_path):
    proc = popen_own_group(job(tmp_path), env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(tmp_path / "ckpt" / "step-000000004" / "manifest.json", proc)
    (torchrun,) = children(proc.pid)
    ranks = [p for agent in [torchrun] for p in children(agent)]
    assert len(ranks) == 2
    os.kill(torchrun, signal.SIGKILL)  # the launcher dies without a word to its ranks
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]  # each rank took the notice, checkpointed, exited 75
    deadline = time.monotonic() + 60
    while any(alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in ranks)
    end = [json.loads(line) for line in out.splitlines() if line.startswith('{"event": "end"')]
    assert end and end[-1]["status"] == "preempted"  # rank 0's report, after the checkpoint of that step
    assert (tmp_path / "ckpt" / f"step-{end[-1]['step']:09d}" / "manifest.json").exists()


def test_a_refused_resume_exits_2_from_the_launcher(tmp_path):
    ckpt = tmp_path / "ckpt" / "step-000000004"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text(json.dumps({"format": 1, "step": 4, "spec": {}, "files": {"x": {"bytes": 1, "crc32": 0}}}))
    # --strict-resume: by default the entrypoint starts fresh instead (test_cloud_entry_recovery.py, issue 33)
    proc = subprocess.run(job(tmp_path) + ["--strict-resume"], env=env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: cannot resume: every checkpoint under" in proc.stderr  # each rank's one-line reason
    assert proc.stderr.splitlines()[-1] == "workbench: exit 2: a rank refused the job (see its error above)"
