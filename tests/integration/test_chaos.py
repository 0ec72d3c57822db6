"""Chaos: what a spot run meets. A corrupt or truncated newest checkpoint, a disk that fills
during a write, a resume with an incompatible spec, SIGTERM to `workbench run` at a random
step, and SIGKILL of a rank's process, then of a Ray worker, in one run (max_failures=2)."""
import errno
import functools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import fsspec
import pytest
import torch
import yaml
from fsspec.implementations.memory import MemoryFileSystem

from bench.common import OWN_GROUP
from tests.helpers.events import loss_by_step
from tests.helpers.reference import reference_run
from tests.helpers.specs import tiny_gpt
from workbench.errors import ConfigError
from workbench.runtime.checkpoint import CheckpointError, CheckpointWarning
from workbench.runtime.checkpoint_store import Store
from workbench.runtime.loop import train
from workbench.runtime.spawn import SpawnPool

ROOT = Path(__file__).resolve().parents[2]


def tiny(steps: int, uri=None, dp: int = 1, global_batch: int = 8, **ckpt) -> dict:
    return tiny_gpt(uri, name="chaos", steps=steps, global_batch=global_batch, layout={"dp": dp}, **ckpt)


@pytest.fixture(scope="module")
def reference() -> dict[int, float]:
    return reference_run(tiny(6)).loss_by_step()


def test_corrupt_and_truncated_newest_checkpoints_fall_back(tmp_path, reference):
    train(tiny(6, tmp_path, every_steps=2), [].append)
    step6, step4 = tmp_path / "step-000000006" / "__0_0.distcp", tmp_path / "step-000000004" / "__0_0.distcp"
    with open(step6, "r+b") as f:  # truncated: the upload or the disk stopped half-way
        f.truncate(step6.stat().st_size // 2)
    data = bytearray(step4.read_bytes())  # corrupted: same size, one byte flipped
    data[len(data) // 2] ^= 0xFF
    step4.write_bytes(bytes(data))

    events: list[dict] = []
    with pytest.warns(CheckpointWarning) as caught:
        train(tiny(6, tmp_path, every_steps=2), events.append, resume=True)
    messages = [str(w.message) for w in caught]
    assert any("step 6" in m and "truncated" in m for m in messages), messages
    assert any("step 4" in m and "corrupted" in m for m in messages), messages
    assert [e["message"] for e in events if e["event"] == "warning"][:2] == messages[:2]
    assert {"event": "restart", "attempt": 0, "from_step": 2, "rejected": [6, 4]} in events
    assert loss_by_step(events) == {k: v for k, v in reference.items() if k > 2}


class FullDisk(MemoryFileSystem):
    """An object store whose volume holds `capacity` bytes: writes past it fail with ENOSPC."""

    protocol = "fulldisk"
    store: dict = {}
    pseudo_dirs = [""]
    capacity = 0

    def used(self, besides=None) -> int:
        return sum(f.getbuffer().nbytes for f in self.store.values() if f is not besides)

    def _open(self, path, mode="rb", **kwargs):
        f = super()._open(path, mode, **kwargs)
        if "w" in mode:
            write, fs = f.write, self

            def limited(data):
                if fs.used(besides=f) + f.tell() + len(data) > fs.capacity:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
                return write(data)

            f.write = limited
        return f


@pytest.fixture
def small_volume(tmp_path):
    """A real 5 MiB tmpfs (needs root), or an fsspec store that raises ENOSPC past 5 MB."""
    mount = tmp_path / "volume"
    mount.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(mount)],
                                 capture_output=True).returncode == 0
    except OSError:  # no mount(8) here
        mounted = False
    if mounted:
        yield str(mount / "run"), lambda: subprocess.run(["umount", str(mount)], check=True)
        subprocess.run(["umount", str(mount)], capture_output=True)
        return
    fsspec.register_implementation("fulldisk", FullDisk, clobber=True)
    FullDisk.store.clear()
    FullDisk.capacity = 5_000_000
    yield "fulldisk://bucket/run", lambda: setattr(FullDisk, "capacity", 10**9)


def test_disk_full_during_a_write_fails_clearly_and_keeps_the_previous_checkpoint(small_volume, reference):
    uri, free_space = small_volume  # one gpt-tiny checkpoint (~3.4 MB) fits, two do not
    with pytest.raises(CheckpointError) as err:
        train(tiny(6, uri, every_steps=2), [].append)
    message = str(err.value)
    assert "checkpoint of step 4" in message and "no space left on device" in message
    assert "previous checkpoint is intact (step 2)" in message and "checkpoint.uri" in message
    store = Store(uri)
    assert store.committed_steps() == [2]
    left = sorted(p[len(store.root) + 1:] for p in store.fs.find(store.root) if "/step-" in p)
    assert left == [f"step-000000002/{n}" for n in (".metadata", "__0_0.distcp", "manifest.json", "rng-rank00000.pt")]
    if uri.startswith("fulldisk://"):
        free_space()
    else:  # move the intact checkpoint off the full volume and continue from there
        moved = Path(uri).parent.parent / "moved"
        subprocess.run(["cp", "-r", uri, str(moved)], check=True)
        free_space()
        uri = str(moved)
    resumed: list[dict] = []
    train(tiny(6, uri, every_steps=2), resumed.append, resume=True)
    assert loss_by_step(resumed) == {k: v for k, v in reference.items() if k > 2}


def test_resume_with_an_incompatible_spec_names_the_difference(tmp_path):
    from workbench.launch import run

    train(tiny(1, tmp_path), [].append)
    changed = tiny(2, tmp_path)
    changed["model"]["hidden"] = 96
    with pytest.raises(ConfigError, match=r"model\.hidden: checkpoint has 64, this spec has 96"):
        run(changed, resume=True, progress=False)  # before any worker starts
    with pytest.raises(ConfigError, match=r"model\.hidden"):
        train(changed, [].append, resume=True)  # and in the worker (the cloud entrypoint's path)


@pytest.mark.distributed
@pytest.mark.slow  # fast twins: tests/unit/test_preemption_signals.py, the exact resumes of test_checkpoint_dist.py
@pytest.mark.timeout(420)
def test_sigterm_to_one_rank_process_checkpoints_and_resumes_exactly(pool2, tmp_path):
    """The per-rank path (torchrun, a cloud's launcher): SIGTERM to one rank's process at a
    random moment stops both ranks after the same step, with a checkpoint of that step."""
    _sigterm_one_rank(pool2, tmp_path)


def _sigterm_one_rank(pool: SpawnPool, tmp_path: Path) -> None:
    steps, spec = 20, tiny(20, tmp_path, dp=2, every_steps=2)
    reference = reference_run(tiny(steps, dp=2), pool=pool).loss_by_step()
    at = random.Random().choice([2, 4, 6])
    print(f"SIGTERM once step {at} is checkpointed")
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(events=pool.run(spec, timeout_s=240)))
    runner.start()
    deadline = time.monotonic() + 240
    while not (tmp_path / f"step-{at:09d}").exists() and runner.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(pool._procs[1].pid, signal.SIGTERM)
    runner.join(timeout=240)
    events = result["events"]
    end = next(e for e in events if e["event"] == "end")
    assert end["status"] == "preempted" and at <= end["step"] < steps, end
    assert (tmp_path / f"step-{end['step']:09d}" / "manifest.json").exists()

    resumed = pool.run(spec, fn=functools.partial(_resume), timeout_s=240)
    assert loss_by_step(resumed) == {k: v for k, v in reference.items() if k > end["step"]}


def _resume(spec: dict, sink) -> None:
    train(spec, sink, resume=True)


def _read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _workbench_run(spec_path: Path, metrics: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "workbench.cli", "run", str(spec_path), "--metrics-out",
                             str(metrics), "--no-progress", *extra], cwd=ROOT, env=env, **OWN_GROUP,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out


def _sigterm_after(spec_path: Path, metrics: Path, at: int, *args: str) -> list[dict]:
    """`workbench run` until it reports step `at`, then SIGTERM: it must checkpoint and exit 75."""
    proc = _workbench_run(spec_path, metrics, *args)
    try:
        deadline = time.monotonic() + 240
        while not any(e["event"] == "step" and e["step"] >= at for e in _read_events(metrics)):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the run ended (or stalled) before step {at}: {_finish(proc, 10)}")
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
    finally:
        code, out = _finish(proc, timeout=240)
    events = _read_events(metrics)
    assert code == 75, out  # EXIT_PREEMPTED
    end = events[-1]
    assert end["event"] == "end" and end["status"] == "preempted" and end["step"] >= at, (end, out)
    assert {"event": "checkpoint", "step": end["step"],
            "uri": str(spec_path.parent / "ckpt" / f"step-{end['step']:09d}")} in events
    return events


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_at_a_random_step_then_resume(tmp_path):
    # More steps than the test could ever wait for: whatever the stop's way to the ranks costs
    # (driver -> relay -> pipe), the run is still going when it lands, so the run is stopped twice
    # (first run, then its resume) and only the steps both reached are compared.
    steps = 100_000
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(tiny(steps, tmp_path / "ckpt", every_steps=10)))
    at = random.Random().randint(2, 12)
    print(f"SIGTERM after step {at}")
    first = _sigterm_after(spec_path, tmp_path / "first.jsonl", at)
    stopped = first[-1]["step"]

    second = _sigterm_after(spec_path, tmp_path / "second.jsonl", stopped + 3, "--resume")
    assert {"event": "restart", "attempt": 0, "from_step": stopped} in second
    last = second[-1]["step"]
    assert sorted(loss_by_step(second)) == list(range(stopped + 1, last + 1))

    ref = reference_run(tiny(last)).loss_by_step()  # uninterrupted, in this process
    joined = {**loss_by_step(first), **loss_by_step(second)}
    torch.testing.assert_close([joined[k] for k in ref], list(ref.values()), rtol=1e-5, atol=1e-5)


def _alive(pid: int) -> bool:
    """Running (not exited, not a zombie waiting to be reaped), from /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_of_a_rank_then_of_a_ray_worker_restarts_from_the_last_checkpoint(tmp_path):
    """One run, two losses (max_failures=2): attempt 0 loses rank 1's process (what the OOM killer
    picks: the one holding the memory), attempt 1 loses rank 1's Ray worker (which takes its rank
    down with it). Each time, no process of the lost attempt is left (no orphan keeps training or
    holding memory) and the next attempt continues the curve exactly from the last checkpoint."""
    import ray

    from workbench.launch import start

    victims = ("rank_pid", "pid")
    spec = tiny(24, tmp_path, dp=2, every_steps=4)
    spec["backend"] = {"name": "local", "max_failures": len(victims)}
    handle = start(spec)
    workers: dict[int, dict[int, dict]] = {}  # attempt -> rank -> its worker event
    killed: dict[int, int] = {}  # attempt -> the step of the checkpoint after which it lost a process
    left: dict[int, list[int]] = {}  # attempt -> its processes still running once the next one started
    attempt = 0
    try:
        for event in handle.follow(timeout_s=480):
            if event["event"] == "worker":
                workers.setdefault(event["attempt"], {})[event["rank"]] = event
                if event["attempt"] > attempt:  # the group restarted: the lost attempt's processes are gone
                    attempt = event["attempt"]
                    left[attempt - 1] = [pid for w in workers[attempt - 1].values()
                                         for pid in (w["pid"], w["rank_pid"]) if _alive(pid)]
            if (event["event"] == "checkpoint" and attempt < len(victims) and attempt not in killed
                    and 1 in workers.get(attempt, {})):
                os.kill(workers[attempt][1][victims[attempt]], signal.SIGKILL)
                killed[attempt] = event["step"]
        assert handle.status().state.value == "completed", handle.status()
    finally:
        handle.cancel()
        ray.shutdown()
    assert sorted(killed) == [0, 1], killed
    assert left == {0: [], 1: []}, workers
    events = handle.events
    cuts = [i for i, e in enumerate(events) if e["event"] == "restart"]
    assert len(cuts) == 2, [events[i] for i in cuts]
    bounds = [0, *cuts, len(events)]
    for n, cut in enumerate(cuts, start=1):
        last_ckpt = max(e["step"] for e in events[:cut] if e["event"] == "checkpoint")
        assert events[cut] == {"event": "restart", "attempt": n, "from_step": last_ckpt}
        assert last_ckpt >= killed[n - 1]
        before, after = loss_by_step(events[bounds[n - 1]:cut]), loss_by_step(events[cut:bounds[n + 1]])
        assert sorted(after) == list(range(last_ckpt + 1, last_ckpt + 1 + len(after)))
        redone = [k for k in before if k in after]  # steps run again after the restart
        assert [after[k] for k in redone] == [before[k] for k in redone]  # the curve continues exactly
    assert sorted(loss_by_step(events[cuts[-1]:])) == list(range(events[cuts[-1]]["from_step"] + 1, 25))
    assert events[-1] == {"event": "end", "status": "completed", "step": 24}
