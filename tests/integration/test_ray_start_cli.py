"""`workbench run` when the embedded Ray cluster cannot start in time, and when three runs start it
at once beside busy processes: one message and a documented exit code, and nothing of the run left
(no process, no session folder) either way (backends/ray_start.py)."""
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from backends.ray_start import ATTEMPTS_ENV, EXIT_NO_CLUSTER, TIMEOUT_ENV, attempt_processes
from bench.common import OWN_GROUP

pytestmark = [pytest.mark.ray]
CLI = [sys.executable, "-m", "workbench.cli"]


@pytest.fixture
def ray_tmp():
    """A RAY_TMPDIR of the test's own, short: Ray's sockets live under it (AF_UNIX: 107 bytes)."""
    path = tempfile.mkdtemp(prefix="wb", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _nothing_left(ray_tmp: str, groups: list[int]) -> None:
    root = os.path.join(ray_tmp, "ray", "workbench")
    assert os.listdir(root) == [], os.listdir(root)  # no session folder, no lock
    assert set(os.listdir(os.path.join(ray_tmp, "ray"))) == {"workbench"}
    assert attempt_processes(ray_tmp) == set()  # no process names, works in or holds a file under it
    assert not [p for p in _live_members(groups)], _live_members(groups)  # nor anything alive in the runs' groups


def _live_members(groups: list[int]) -> list[str]:
    """Processes of these process groups that are not zombies. A zombie whose parent has exited
    waits for PID 1 to reap it: it holds no memory, file or port, so it is not something a run left."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        if int(fields[2]) in groups and fields[0] != "Z":
            found.append(f"{pid} ({fields[0]})")
    return found


@pytest.mark.timeout(200)
def test_a_start_that_times_out_ends_with_one_message_and_nothing_left(ray_tmp):
    # 0 s for the GCS to publish its port: it cannot, so every attempt times out, deterministically
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, TIMEOUT_ENV: "0", ATTEMPTS_ENV: "2"}
    proc = subprocess.Popen(CLI + ["run", "examples/quickstart.yaml", "--set", "train.steps=2"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **OWN_GROUP)
    _, err = proc.communicate(timeout=180)
    assert "Traceback" not in err, err[-3000:]
    retries = [line for line in err.splitlines() if line.startswith("warning: Ray did not start")]
    assert len(retries) == 1 and retries[0].startswith(
        "warning: Ray did not start (attempt 1 of 2: the GCS server did not come up within 0 s"), err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err[-3000:]
    assert "the local Ray cluster did not start: 2 attempt(s) timed out, the last because the GCS server did not " \
           "come up within 0 s (WORKBENCH_RAY_START_TIMEOUT_S); load " in errors[0]
    assert "Every process and folder of those attempts was removed." in errors[0]
    assert "run without Ray: python -m workbench.cloud_entry --spec SPEC (torchrun with 2 ranks" in errors[0]
    _nothing_left(ray_tmp, [proc.pid])
    assert proc.returncode == EXIT_NO_CLUSTER


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_three_runs_at_once_beside_busy_processes_finish_and_leave_nothing(ray_tmp, tmp_path):
    """The light-load case of issue #32: three cold `workbench run`s at once beside one busy loop per
    core, sharing one RAY_TMPDIR (each keeps the others' live folders)."""
    env = {**os.environ, "RAY_TMPDIR": ray_tmp}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], **OWN_GROUP) for _ in range(os.cpu_count() or 2)]
    runs = []
    try:
        for i in range(3):
            runs.append(subprocess.Popen(
                CLI + ["run", "examples/quickstart.yaml", "--set", "train.steps=3", "--set", f"name=three-{i}",
                       "--no-progress", "--metrics-out", str(tmp_path / f"{i}.jsonl")],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **OWN_GROUP))
        outcomes = [(r.wait(timeout=840), r.stderr.read()) for r in runs]
    finally:
        for p in busy + runs:
            p.kill()
            p.wait()
    for code, err in outcomes:
        assert code == 0, err[-3000:]
    for i in range(3):
        assert (tmp_path / f"{i}.jsonl").read_text().splitlines()[-1] == \
            '{"event": "end", "status": "completed", "step": 3}'
    _nothing_left(ray_tmp, [r.pid for r in runs])
