"""The local Ray start's bookkeeping without Ray (backends/ray_start.py): a failed attempt's processes
and folder are gone before the next, the last failure is one RayStartError, folders of ended runs
are swept and those of live runs kept."""
import fcntl
import os
import subprocess
import sys
import time

import pytest

from backends import ray_start
from backends.ray_start import RayStartError, SessionFolder, attempt_processes, end_processes, start_ray, sweep


@pytest.fixture
def root(monkeypatch):
    # short: Ray's sockets live under it and AF_UNIX paths stop at 107 bytes
    import tempfile

    base = tempfile.mkdtemp(prefix="wbt", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", base)
    monkeypatch.setenv(ray_start.TIMEOUT_ENV, "5")
    yield ray_start.sessions_root()
    subprocess.run(["rm", "-rf", base], check=False)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _fake_ray(started: list):
    """An init that starts what a slow Ray start leaves behind, then fails as Ray does: a daemon
    naming the folder, its child that names nothing, and an orphan (re-parented to PID 1) whose
    only tie to the attempt is its working directory there."""
    def init(folder: str) -> None:
        os.makedirs(os.path.join(folder, "session_x", "logs"))
        daemon = subprocess.Popen(["sh", "-c", "sleep 300 & wait", "sh", f"--temp-dir={folder}"])
        orphan = subprocess.run(["sh", "-c", "sleep 302 >/dev/null 2>&1 & echo $!"], cwd=folder,
                                capture_output=True, text=True, check=True)
        started.extend([daemon.pid, int(orphan.stdout)])
        deadline = time.monotonic() + 10
        while len(attempt_processes(folder)) < 3 and time.monotonic() < deadline:  # sh has forked its sleep
            time.sleep(0.05)
        raise Exception("The current node timed out during startup. This could happen because ...")
    return init


def test_each_failed_attempt_is_ended_and_removed_before_the_next_then_one_clear_error(root, monkeypatch):
    monkeypatch.setenv(ray_start.ATTEMPTS_ENV, "2")
    started: list[int] = []
    notes: list[tuple[str, str]] = []
    shutdowns: list[int] = []
    seen_at_retry: list[set] = []

    def note(kind, message):
        notes.append((kind, message))
        seen_at_retry.append({pid for pid in started if _alive(pid)})

    with pytest.raises(RayStartError) as e:
        start_ray(_fake_ray(started), lambda: shutdowns.append(1), note=note, on_owner_thread=False,
                  fallback="torchrun ... (no Ray)")
    assert seen_at_retry == [set()]  # attempt 1's processes were gone before attempt 2 began
    assert len(started) == 4 and not any(_alive(pid) for pid in started)
    assert os.listdir(root) == []  # no folder, no lock
    assert len(shutdowns) == 2
    (kind, message), = notes
    assert kind == "warning" and message.startswith("Ray did not start (attempt 1 of 2: the raylet did not register")
    text = str(e.value)
    assert e.value.exit_code == ray_start.EXIT_NO_CLUSTER == 69
    assert text.startswith("the local Ray cluster did not start: 2 attempt(s) timed out, the last because the raylet")
    assert "load " in text and "WORKBENCH_RAY_START_TIMEOUT_S" in text and "run without Ray: torchrun ... (no Ray)" in text


def test_a_start_on_another_thread_reports_the_same(root, monkeypatch):
    monkeypatch.setenv(ray_start.ATTEMPTS_ENV, "1")
    started: list[int] = []
    with pytest.raises(RayStartError):
        start_ray(_fake_ray(started), lambda: None, note=lambda *a: None, on_owner_thread=True)
    assert started and not any(_alive(pid) for pid in started)
    assert os.listdir(root) == []


def test_a_started_cluster_keeps_its_folder_until_removed(root):
    folder = start_ray(lambda path: None, lambda: None, note=lambda *a: None, on_owner_thread=False)
    assert os.path.isdir(folder.path) and folder.path.startswith(root + os.sep)
    assert sweep(root) == [] and os.path.isdir(folder.path)  # its run (this process) is alive
    folder.remove()
    assert os.listdir(root) == []


def test_sweep_removes_the_folders_of_ended_runs_only(root):
    os.makedirs(root)
    ended = os.path.join(root, "999999-1")
    os.makedirs(os.path.join(ended, "session_x"))
    open(ended + ".lock", "w").close()  # nobody holds it: that run has ended
    live = os.path.join(root, "999999-2")
    os.makedirs(live)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(300)", live + ".lock"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        assert sweep(root) == [ended]
        assert sorted(os.listdir(root)) == ["999999-2", "999999-2.lock"]
    finally:
        holder.kill()
        holder.wait()
    assert sweep(root) == [live] and os.listdir(root) == []


def test_a_folder_is_not_mistaken_for_one_that_shares_its_prefix(root):
    a = SessionFolder(root)
    other = a.path + "0"  # <pid>-10 beside <pid>-1
    os.makedirs(other)
    proc = subprocess.Popen(["sh", "-c", "sleep 300; :", "sh", f"--temp-dir={other}"])
    try:
        assert proc.pid not in attempt_processes(a.path)
        assert proc.pid in attempt_processes(other)
        assert proc.pid in end_processes(other)
    finally:
        proc.kill()
        proc.wait()
        a.remove()


def test_a_bad_setting_is_refused_with_the_rule(monkeypatch):
    from workbench.errors import ConfigError

    monkeypatch.setenv(ray_start.ATTEMPTS_ENV, "0")
    with pytest.raises(ConfigError, match=r"WORKBENCH_RAY_START_ATTEMPTS='0' must be a number >= 1"):
        start_ray(lambda path: None, lambda: None, note=lambda *a: None, on_owner_thread=False)


def test_the_lock_is_held_while_the_folder_lives(root):
    folder = SessionFolder(root)
    with open(folder.path + ".lock") as f, pytest.raises(OSError):
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    folder.remove()


def test_the_cli_exits_with_the_documented_code_when_ray_does_not_start(monkeypatch, capsys):
    """RayStartError is a WorkerError with its own exit code; workbench/cli.py must return it."""
    from workbench import cli, launch

    def no_ray(*args, **kwargs):
        raise RayStartError("the local Ray cluster did not start: (the rest)")

    monkeypatch.setattr(launch, "run", no_ray)
    code = cli.main(["run", "examples/quickstart.yaml"])
    err = capsys.readouterr().err
    assert "the local Ray cluster did not start: (the rest)" in err and "Traceback" not in err
    assert code == ray_start.EXIT_NO_CLUSTER
