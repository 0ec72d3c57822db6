"""One writer per checkpoint URI: a lease file (owner host, pid, run id, heartbeat) at its root.

Two runs writing the same checkpoints would delete each other's files. The run's rank 0 takes
the lease before it loads or saves anything and renews it from a thread; a second run is refused
with the owner's name. A stale lease (the owner died: same host and its pid is gone, or no
heartbeat for WORKBENCH_LEASE_TTL_S seconds) is taken over, by exactly one contender. No atomic
rename is assumed: the lease is created with create-exclusive where the store has it (local
O_EXCL, S3's If-None-Match), and every write is read back and checked.
"""
from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
import uuid

from workbench.errors import ConfigError

LEASE = "lease.json"
DEFAULT_TTL_S = 120.0  # a heartbeat older than this (seconds) means the owner is gone
RUN_ID_VARS = ("WORKBENCH_RUN_ID", "TRAINING_JOB_NAME", "CLOUD_ML_JOB_ID", "AZUREML_RUN_ID")


class LeaseHeld(ConfigError):
    """Another live run owns the checkpoint URI."""


def run_id(env=os.environ) -> str:
    """This run's identity: the cloud job's (its restarts on other hosts are the same run), else
    this process's (a process never competes with itself)."""
    for var in RUN_ID_VARS:
        if env.get(var):
            return env[var]
    return f"{socket.gethostname()}:{os.getpid()}"


def ttl_s() -> float:
    try:
        ttl = float(os.environ.get("WORKBENCH_LEASE_TTL_S", DEFAULT_TTL_S))
    except ValueError:
        return DEFAULT_TTL_S
    return ttl if math.isfinite(ttl) and ttl > 0 else DEFAULT_TTL_S


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


_MAX_PID = 1 << 22  # Linux's pid_max limit


def _pid(owner: dict) -> int | None:
    """The owner's pid when it is one a process can have (1 .. 2^22); 0 and -1 would signal groups."""
    pid = owner.get("pid")
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid <= _MAX_PID else None


def _heartbeat(owner: dict) -> float | None:
    beat = owner.get("heartbeat_unix")
    if isinstance(beat, bool) or not isinstance(beat, (int, float)) or not math.isfinite(beat):
        return None
    return float(beat)


def stale_reason(owner: dict, now: float | None = None) -> str | None:
    """Why a lease's owner is gone, or None while it may be alive.

    Hosts' clocks must agree within the TTL: a heartbeat more than a TTL in the future comes from a
    clock that does not (or from a forged lease), and counts as stale like one a TTL in the past.
    """
    now = time.time() if now is None else now
    beat, pid = _heartbeat(owner), _pid(owner)
    if owner.get("host") == socket.gethostname() and (pid is None or not _pid_alive(pid)):
        return f"its process {owner.get('pid')!r} on this host is gone" if pid else \
            f"its pid {owner.get('pid')!r} is not a process's"
    if beat is None:
        return f"its heartbeat {owner.get('heartbeat_unix')!r} is not a time"
    if now - beat > ttl_s():
        return f"no heartbeat for {now - beat:.0f} s (more than {ttl_s():.0f} s)"
    if beat - now > ttl_s():
        return (f"its heartbeat is {beat - now:.0f} s in the future: a clock more than {ttl_s():.0f} s off "
                "(keep hosts' clocks in sync, e.g. NTP)")
    return None


def describe(owner: dict) -> str:
    beat = _heartbeat(owner)
    ago = f"{time.time() - beat:.0f} s ago" if beat is not None else "never"
    return (f"run {str(owner.get('run_id'))[:200]!r} (pid {str(owner.get('pid'))[:40]} on host "
            f"{str(owner.get('host'))[:200]}, last heartbeat {ago})")


class Lease:
    """The lease on one Store's root, held by this process for run `run`.

    Args:
        store: the checkpoint Store (its fs and root).
        run: this run's id (see run_id()).
    """

    def __init__(self, store, run: str | None = None):
        self.store, self.run = store, run or run_id()
        self.path = store.path(LEASE)
        self.token = uuid.uuid4().hex
        self.lost: str | None = None  # set when another run took the lease from us
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> dict:
        return {"host": socket.gethostname(), "pid": os.getpid(), "run_id": self.run, "token": self.token,
                "heartbeat_unix": time.time()}

    def read(self, path: str | None = None) -> dict | None:
        """The lease's record; None when there is none, {} when it is torn or not a lease (stale)."""
        path = path or self.path
        if self.store.fs.isdir(path):
            raise ConfigError(f"{path} is a folder, where the checkpoint lease file belongs. Remove it (or give "
                              "this run another checkpoint.uri).")
        try:
            with self.store.fs.open(path, "rb") as f:
                record = json.loads(f.read(1 << 16).decode())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RecursionError):
            return {}  # a torn or garbage lease: nobody can be named, so it is stale
        return record if isinstance(record, dict) else {}

    def _create(self, path: str, record: dict) -> bool:
        """Create `path` only if absent; True when this process's record is what it holds."""
        data = json.dumps(record).encode()
        try:
            if self.store.local:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            else:
                self.store.fs.pipe_file(path, data, mode="create")  # S3: If-None-Match: *
        except FileExistsError:
            return False
        except OSError as e:
            if "PreconditionFailed" not in repr(e) and "412" not in str(e):
                raise
            return False
        got = self.read(path)  # read back: stores without create-exclusive overwrite silently
        return bool(got) and got.get("token") == record["token"]

    def acquire(self) -> None:
        """Take the lease, or take over a stale one. Raises LeaseHeld naming a live owner."""
        self.store.fs.makedirs(self.store.root, exist_ok=True)
        for _ in range(3):  # another contender may win a race; look again
            if self._create(self.path, self._record()):
                return self._start()
            owner = self.read()
            if owner is None:
                continue  # released in between
            if owner and owner.get("run_id") == self.run:
                why = "it is this run's (restarted)"
            else:
                why = stale_reason(owner) if owner else "it is unreadable"
                if why is None:
                    raise LeaseHeld(held_message(self.store.uri, owner))
            if self._take_over(owner):
                return self._start()
        raise LeaseHeld(f"could not take the lease on {self.store.uri}: other runs keep taking it. "
                        "Make sure one run writes there at a time.")

    def _take_over(self, owner: dict) -> bool:
        """Replace `owner`'s stale lease. Exactly one contender creates the take-over marker of
        that lease's token; it re-reads the lease and overwrites it only if it is still `owner`'s."""
        marker = f"{self.path}.takeover-{owner.get('token', 'unreadable')}"
        if not self._create(marker, self._record()):
            return False
        try:
            if (self.read() or {}).get("token") != owner.get("token"):
                return False
            self._write()
            return (self.read() or {}).get("token") == self.token
        finally:
            self.store.remove(marker)

    def _write(self) -> None:
        self.store.write_atomic(self.path, json.dumps(self._record()).encode())  # never torn for a reader

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="checkpoint-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        """Renew the heartbeat; stop (and remember) if another run holds the lease now."""
        while not self._stop.wait(ttl_s() / 8):
            try:
                owner = self.read()
                if not owner or owner.get("token") != self.token:
                    self.lost = f"the lease on {self.store.uri} was taken over by " + (
                        describe(owner) if owner else "another run")
                    return
                self._write()
            except (OSError, ConfigError):
                continue  # a transient store error: the next beat tries again, well within the TTL

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if (self.read() or {}).get("token") == self.token:
                self.store.remove(self.path)


def held_message(uri: str, owner: dict) -> str:
    return (f"checkpoint.uri {uri} is in use by {describe(owner)}: two runs writing the same checkpoints would "
            "delete each other's files. Wait for that run to finish (or stop it), or give this run another "
            f"checkpoint.uri. A lease whose owner died is taken over once its heartbeat is older than {ttl_s():.0f} s "
            "(WORKBENCH_LEASE_TTL_S), at once on the same host.")


def check_lease_free(uri: str) -> None:
    """Before any worker starts (the driver): ConfigError if a live run of another process
    holds the URI. The workers' rank 0 takes the lease itself (Lease.acquire)."""
    from workbench.runtime.checkpoint_store import Store

    store = Store(uri)
    lease = Lease(store)
    owner = lease.read()
    if owner and owner.get("run_id") != lease.run and stale_reason(owner) is None:
        raise LeaseHeld(held_message(uri, owner))
