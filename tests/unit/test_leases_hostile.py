"""Leases parse whatever a store holds and are never left behind by a run that failed or was
refused (issue 32, items 6 and 8): odd lease contents, pids and heartbeats, clock skew, a full
disk during a save, and the `error` event in --metrics-out."""
import json
import os
import socket
import time

import pytest

from workbench.errors import ConfigError
from workbench.runtime.checkpoint_lease import LEASE, Lease, LeaseHeld, check_lease_free, describe, stale_reason
from workbench.runtime.checkpoint_store import Store

HOST = socket.gethostname()


@pytest.mark.parametrize("content", [b"[1, 2]", b"42", b"null", b'"lease"', b"{", b"", b"\x00\xff", b"[" * 5000])
def test_a_lease_that_is_not_a_record_is_stale_and_taken_over(tmp_path, content):
    (tmp_path / LEASE).write_bytes(content)
    store = Store(str(tmp_path))
    check_lease_free(str(tmp_path))  # stale: nothing to refuse
    lease = Lease(store, run="me")
    lease.acquire()
    assert json.loads((tmp_path / LEASE).read_text())["run_id"] == "me"
    lease.release()
    assert not (tmp_path / LEASE).exists()


@pytest.mark.parametrize("pid", ["abc", None, 2**80, 0, -1, True, 1.5])
def test_a_pid_no_process_can_have_is_gone_on_this_host(pid):
    owner = {"host": HOST, "pid": pid, "run_id": "x", "heartbeat_unix": time.time()}
    assert stale_reason(owner) is not None
    assert "pid" in describe(owner)


@pytest.mark.parametrize("beat", ["yesterday", None, float("nan"), float("inf"), -float("inf"), [1], True])
def test_a_heartbeat_that_is_not_a_time_is_stale(beat):
    owner = {"host": "another-host", "pid": 1, "run_id": "x", "heartbeat_unix": beat}
    assert "is not a time" in stale_reason(owner)
    assert "never" in describe(owner)


def test_clock_skew_within_the_ttl_is_alive_beyond_it_stale(monkeypatch):
    monkeypatch.setenv("WORKBENCH_LEASE_TTL_S", "120")
    now = 1_800_000_000.0
    live = {"host": "another-host", "pid": 1, "run_id": "x"}
    assert stale_reason({**live, "heartbeat_unix": now + 60}, now) is None  # a clock a minute ahead
    assert stale_reason({**live, "heartbeat_unix": now - 60}, now) is None
    assert "in the future" in stale_reason({**live, "heartbeat_unix": now + 10_000}, now)
    assert "no heartbeat for" in stale_reason({**live, "heartbeat_unix": now - 10_000}, now)
    monkeypatch.setenv("WORKBENCH_LEASE_TTL_S", "nonsense")
    assert stale_reason({**live, "heartbeat_unix": now - 60}, now) is None  # the default TTL


def test_a_live_owner_is_still_refused(tmp_path):
    (tmp_path / LEASE).write_text(json.dumps({"host": HOST, "pid": os.getpid(), "run_id": "other",
                                              "token": "t", "heartbeat_unix": time.time()}))
    with pytest.raises(LeaseHeld, match="is in use by run 'other'"):
        Lease(Store(str(tmp_path)), run="me").acquire()


def test_a_folder_where_the_lease_belongs_is_named(tmp_path):
    (tmp_path / LEASE).mkdir()
    with pytest.raises(ConfigError, match="is a folder, where the checkpoint lease file belongs"):
        check_lease_free(str(tmp_path))


def test_a_save_that_fails_on_a_full_disk_leaves_no_lease(tmp_path, monkeypatch):
    from workbench.runtime import checkpoint_store
    from workbench.runtime.loop import train

    def full(self, path, obj):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_store.Store, "write_torch", full)
    spec = {"name": "full", "model": {"preset": "gpt-tiny"}, "train": {"steps": 2, "global_batch": 4, "micro_batch": 4},
            "checkpoint": {"uri": str(tmp_path / "ckpt"), "every_steps": 1}}
    with pytest.raises(Exception, match="[Nn]o space left"):
        train(spec, [].append)
    assert not (tmp_path / "ckpt" / LEASE).exists()


def test_the_error_event_reaches_metrics_out(tmp_path):
    from workbench.launch import _record

    path = tmp_path / "m.jsonl"
    with open(path, "w") as out:
        for event in ({"event": "step", "step": 1, "loss": 1.0, "tokens_per_s": 1.0},
                      {"event": "error", "rank": 1, "message": "rank 1: RuntimeError: boom"}):
            _record(event, out, None, "job")
    assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == ["step", "error"]


def test_a_refused_resume_leaves_no_lease(tmp_path):
    from workbench.runtime.loop import train

    spec = {"name": "r", "model": {"preset": "gpt-tiny"}, "train": {"steps": 2, "global_batch": 4, "micro_batch": 4},
            "checkpoint": {"uri": str(tmp_path), "every_steps": 2}}
    train(spec, [].append)
    (tmp_path / "step-000000002" / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(ConfigError, match="every checkpoint under"):
        train(spec, [].append, resume=True)
    assert not (tmp_path / LEASE).exists()
