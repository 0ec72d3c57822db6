"""Checkpoints of a 2-node job whose nodes share no folder (issue 14), as SageMaker runs one:
two torchrun "nodes" on this host, each rank writing to its own node's folder
(WORKBENCH_CHECKPOINT_DIR), the folders merged as SageMaker's sync merges them (every instance
uploads to one S3 prefix; a restarted job downloads the whole prefix to each instance), then a
restart that resumes on the exact loss curve. The same over a store that refuses directory
renames, and a node stopped by SIGTERM in the middle of a save."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.common import OWN_GROUP
from tests.helpers.events import losses

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


def job(tmp: Path, steps: int, every: int = 2) -> Path:
    spec = {"name": "two-nodes", "model": {"preset": "gpt-tiny"},
            "train": {"steps": steps, "global_batch": 8, "micro_batch": 4},
            "layout": {"dp": 2}, "resources": {"gpu": "cpu", "gpus_per_node": 1, "nodes": 2},
            "checkpoint": {"every_steps": every, "keep": 2}}
    path = tmp / f"job-{steps}-{every}.json"
    path.write_text(json.dumps(spec))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(spec: Path, dirs: list[str], entry: str, extra_env: dict | None = None) -> list[subprocess.Popen]:
    """`torchrun --nnodes 2 --node_rank N ...` per node, as SageMaker's torch_distributed launcher starts them
    (`bench.torchrun`: torchrun with its ranks kept in this session, as bench/common.py says why)."""
    port, procs = free_port(), []
    for node, folder in enumerate(dirs):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
        env.update(PYTHONPATH=str(ROOT), WORKBENCH_CLOUD="generic", WORKBENCH_CHECKPOINT_DIR=folder,
                   **((extra_env or {}).get(node, {})))
        cmd = [sys.executable, "-m", "bench.torchrun", "--nnodes=2", f"--node_rank={node}",
               "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}", "-m", entry,
               "--spec", str(spec)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, **OWN_GROUP))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 400) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        out.append((p.returncode, stdout, stderr))
    return out


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith('{"event"')]


def run_nodes(spec: Path, dirs: list[str], entry: str) -> list[dict]:
    results = finish(start_nodes(spec, dirs, entry))
    for code, _, stderr in results:
        assert code == 0, stderr[-3000:]
    return events(results[0][1])  # rank 0 (node 0) reports the steps


def sync(folders: list[Path], prefix: Path) -> None:
    """SageMaker's checkpoint sync: each instance uploads its folder to one prefix; a restarted
    job downloads the whole prefix to every instance."""
    for folder in folders:
        shutil.copytree(folder, prefix, dirs_exist_ok=True)
    for folder in folders:
        shutil.copytree(prefix, folder, dirs_exist_ok=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    tmp = tmp_path_factory.mktemp("reference")
    evs = run_nodes(job(tmp, STEPS), [str(tmp / "n0"), str(tmp / "n1")], "workbench.cloud_entry")
    return losses(evs)


@pytest.mark.parametrize("store", ["local", "norename"])
def test_per_node_folders_merged_by_the_sync_resume_exactly(store, reference, tmp_path):
    folders = [tmp_path / "n0", tmp_path / "n1"]
    dirs = [str(f) if store == "local" else f"norename://{f}" for f in folders]
    entry = "workbench.cloud_entry" if store == "local" else "tests.helpers.stores"
    first = run_nodes(job(tmp_path, 4, every=1), dirs, entry)
    assert losses(first) == reference[:4]
    # Each node holds its own rank's files; the manifest (written last, by rank 0) is on node 0.
    assert sorted(p.name for p in (folders[0] / "step-000000004").iterdir()) == [
        ".metadata", "__0_0.distcp", "manifest.json", "rng-rank00000.pt"]
    assert sorted(p.name for p in (folders[1] / "step-000000004").iterdir()) == ["__1_0.distcp", "rng-rank00001.pt"]
    manifest = json.loads((folders[0] / "step-000000004" / "manifest.json").read_text())
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp", "rng-rank00000.pt",
                                         "rng-rank00001.pt"]
    for folder in folders:  # keep=2 on each node: steps 1 and 2 dropped by each node from its own folder
        assert sorted(p.name for p in folder.glob("step-*")) == ["step-000000003", "step-000000004"]

    sync(folders, tmp_path / "s3-prefix")
    resumed = run_nodes(job(tmp_path, STEPS), dirs, entry)
    assert {"event": "restart", "attempt": 0, "from_step": 4} in resumed
    assert losses(resumed) == reference[4:]  # bit for bit


def test_sigterm_to_one_node_mid_save_keeps_the_previous_checkpoint(reference, tmp_path):
    folders = [tmp_path / "n0", tmp_path / "n1"]
    dirs = [f"norename://{f}" for f in folders]
    marker = tmp_path / "node1-is-saving"
    stall = {1: {"WB_TEST_HANG_ON": "step-000000004/rng-rank00001.pt", "WB_TEST_HANG_MARKER": str(marker)}}
    procs = start_nodes(job(tmp_path, STEPS), dirs, "tests.helpers.stores", stall)
    deadline = time.monotonic() + 400
    while not marker.exists():  # node 1 is inside its save of step 4 (its write stalls there)
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            pytest.fail(f"node 1 never reached its save of step 4: {finish(procs, 10)}")
        time.sleep(0.1)
    os.kill(procs[1].pid, signal.SIGTERM)  # node 1's torchrun: it stops its rank
    results = finish(procs)
    assert results[1][0] != 0 and results[0][0] != 0  # the job failed: its save did not finish
    assert not (folders[0] / "step-000000004" / "manifest.json").exists()
    assert (folders[0] / "step-000000002" / "manifest.json").exists()

    sync(folders, tmp_path / "s3-prefix")
    resumed = run_nodes(job(tmp_path, STEPS), dirs, "tests.helpers.stores")
    assert {"event": "restart", "attempt": 0, "from_step": 2} in resumed  # the previous checkpoint
    assert losses(resumed) == reference[2:]
