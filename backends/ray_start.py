"""Start the `local` backend's embedded Ray cluster on a busy machine: each attempt in a folder of
its own, bounded by a deadline, and every process and file of a failed attempt gone before the next.

What an attempt created is known for sure by its folder: Ray's session folder, logs and sockets
live under `<ray temp dir>/workbench/<pid>-<n>`, a name no other attempt uses, and every Ray
daemon names it on its command line or holds a file open in it (its logs). A process that does
so, and everything below it in the process tree, is the attempt's (`attempt_processes`). Folders
of runs that have ended are removed: at exit by the run itself, and at the next start by any run
when the owner was killed (a lock file the kernel releases when its holder dies says so).
"""
from __future__ import annotations

import atexit
import contextlib
import fcntl
import gc
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable

from workbench.errors import WorkerError

EXIT_NO_CLUSTER = 69  # sysexits.h EX_UNAVAILABLE, as 75 (preempted) is EX_TEMPFAIL
TIMEOUT_ENV = "WORKBENCH_RAY_START_TIMEOUT_S"
ATTEMPTS_ENV = "WORKBENCH_RAY_START_ATTEMPTS"
DEFAULT_TIMEOUT_S = 150.0  # cold starts took 40 s at load 6, up to 187 s at load 12-35 (issue #32)
DEFAULT_ATTEMPTS = 3
_NOTE_EVERY_S = 30.0  # how often a start still under way says so

Note = Callable[[str, str], None]  # (event kind: note | warning, message)


class RayStartError(WorkerError):
    """The embedded Ray cluster did not start; the message says what timed out, the load seen and
    what to try. `workbench run` exits with `exit_code` (EXIT_NO_CLUSTER)."""

    exit_code = EXIT_NO_CLUSTER


def setting(name: str, default: float, minimum: float) -> float:
    """A number >= `minimum` from the environment variable `name`, else `default`."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < minimum:
        from workbench.errors import ConfigError

        raise ConfigError(f"{name}={raw!r} must be a number >= {minimum:g}; unset it for the default, {default:g}.")
    return value


def sessions_root() -> str:
    """Where every local run keeps its Ray folders: `workbench/` in Ray's own temp dir
    ($RAY_TMPDIR, else $TMPDIR on Linux, else /tmp, then `ray`)."""
    base = os.environ.get("RAY_TMPDIR") or (os.environ.get("TMPDIR") if sys.platform.startswith("linux") else None)
    return os.path.join(base or "/tmp", "ray", "workbench")


class SessionFolder:
    """One attempt's folder `<root>/<pid>-<n>` and its lock `<root>/<pid>-<n>.lock`, held (flock)
    as long as this process lives: a folder whose lock can be taken belongs to a run that has ended."""

    _count = 0
    _count_lock = threading.Lock()

    def __init__(self, root: str | None = None):
        self.root = root or sessions_root()
        os.makedirs(self.root, exist_ok=True)
        with contextlib.suppress(OSError):  # shared by every user of the machine, like /tmp
            os.chmod(self.root, 0o1777)
        sweep(self.root)
        with SessionFolder._count_lock:
            SessionFolder._count += 1
            n = SessionFolder._count
        self.path = os.path.join(self.root, f"{os.getpid()}-{n}")
        self._lock_fd: int | None = os.open(self.path + ".lock", os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        os.makedirs(self.path, exist_ok=True)

    def remove(self) -> None:
        """End what still runs from this folder, then delete it and its lock."""
        end_processes(self.path)
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(self.path + ".lock")
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def sweep(root: str) -> list[str]:
    """Remove the folders under `root` whose run has ended (their lock is free); returns them."""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.endswith(".lock"):
            continue
        lock = os.path.join(root, name)
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: that run is alive
            os.close(fd)
            continue
        try:
            folder = lock[: -len(".lock")]
            end_processes(folder)
            shutil.rmtree(folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.unlink(lock)
            removed.append(folder)
        finally:
            os.close(fd)
    return removed


def _mine(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def _refers_to(pid: int, folder: str) -> bool:
    """Whether process `pid` names `folder` on its command line, works in it or holds a file in it."""
    inside = folder.rstrip("/") + "/"
    named = re.compile(re.escape(folder.rstrip("/").encode()) + rb"(?=[/\x00]|$)")  # not .../12-1 for .../12-10
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if named.search(f.read()):
                return True
        if (os.readlink(f"/proc/{pid}/cwd") + "/").startswith(inside):
            return True
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(inside):
                    return True
    except OSError:  # gone, or not ours to read
        return False
    return False


def _parents() -> dict[int, int]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
                out[int(name)] = int(stat[stat.rindex(")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return out


def attempt_processes(folder: str) -> set[int]:
    """The processes of this user that refer to `folder` (`_refers_to`), with all their descendants;
    never this process."""
    if not os.path.isdir("/proc"):
        return set()
    parents = _parents()
    found = {pid for pid in parents if pid != os.getpid() and _mine(pid) and _refers_to(pid, folder)}
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found and child != os.getpid():
                found.add(child)
                todo.append(child)
    return found


def end_processes(folder: str) -> set[int]:
    """SIGKILL every process of `folder` (`attempt_processes`). Each is stopped first (SIGSTOP) and
    the tree scanned again until nothing new appears, so none can start another or be re-parented
    out of reach meanwhile. Returns the pids ended."""
    stopped: set[int] = set()
    while True:
        new = attempt_processes(folder) - stopped
        if not new:
            break
        for pid in new:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
        stopped |= new
    for pid in stopped:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for pid in stopped:  # reap our own children (Ray's daemons), so that no zombie is left
        with contextlib.suppress(OSError):
            os.waitpid(pid, 0)
    _wait_gone(stopped)
    return stopped


def _wait_gone(pids: set[int], timeout_s: float = 30.0) -> None:
    """Wait until every one of `pids` has exited. A SIGKILLed process that is not our child (a
    worker the raylet forked) still holds its files while the kernel tears it down, which takes a
    while on a loaded machine; returning before that would leave it referring to the folder."""
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.02)


def _alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (a zombie holds no file, port or memory)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def load_text() -> str:
    """'load 14.2 on 2 cores' (1-minute load average), or '' where the OS has none."""
    try:
        return f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    except (OSError, AttributeError):
        return ""


def _attempt(init: Callable[[str], None], folder: str, timeout_s: float, note: Note, label: str) -> BaseException | None:
    """Run `init(folder)` on this thread, a line to `note` every _NOTE_EVERY_S while it runs.
    None on success, else what went wrong, its traceback dropped (below).

    No deadline is enforced from outside: ray.init cannot be interrupted safely (with its GCS
    killed under it, Ray's GCS client ends the whole process 60 s later), and Ray bounds its own
    waits (the GCS's port: `timeout_s`; the raylet's registration: 30 s, fixed in Ray)."""
    done = threading.Event()
    t0 = time.monotonic()

    def watchdog() -> None:
        while not done.wait(_NOTE_EVERY_S):
            note("note", f"still starting Ray ({label}): {time.monotonic() - t0:.0f} s, {load_text()}")

    threading.Thread(target=watchdog, name="workbench-ray-start-progress", daemon=True).start()
    try:
        init(folder)
    except Exception as e:  # noqa: BLE001 - Ray raises bare Exceptions on a slow start
        # The traceback holds the failed attempt's ray Node and its GCS client; once its GCS is
        # ended, a live client would end this process 60 s later. Drop them before the cleanup.
        error: BaseException | None = _without_traceback(e)
        del e
        gc.collect()
        return error
    finally:
        done.set()
    return None


def _without_traceback(e: BaseException) -> BaseException:
    seen = set()
    link: BaseException | None = e
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return e


def _first_line(e: BaseException | None) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def start_ray(init: Callable[[str], None], shutdown: Callable[[], None], *, note: Note, on_owner_thread: bool,
              fallback: str = "") -> SessionFolder:
    """Start Ray with `init(folder)` up to WORKBENCH_RAY_START_ATTEMPTS times (default 3), each
    bounded by WORKBENCH_RAY_START_TIMEOUT_S (default 150 s). After a failed attempt `shutdown()`
    resets Ray's state and the attempt's processes and folder are removed before the next.

    Args:
        init: starts Ray with its temp dir in the folder it is given.
        shutdown: ray.shutdown.
        note: called with a line of progress (a retry, a start still under way).
        on_owner_thread: run `init` on a thread that then lives as long as the process (Ray's
            daemons die with the thread that started them: embedded_ray.ensure_ray).
        fallback: how to run without Ray, named in the final message.
    Returns:
        The session folder of the cluster that started; it is removed when this process exits.
    Raises:
        RayStartError: no attempt started Ray; the message says why and what to try.
    """
    timeout_s = setting(TIMEOUT_ENV, DEFAULT_TIMEOUT_S, 0)
    attempts = int(setting(ATTEMPTS_ENV, DEFAULT_ATTEMPTS, 1))
    # Ray waits 30 s for the GCS to publish its port unless told otherwise; under load that is short.
    # (A value the user gave Ray itself stands unless WORKBENCH_RAY_START_TIMEOUT_S is set too.)
    if TIMEOUT_ENV in os.environ or "RAY_gcs_server_port_wait_time_s" not in os.environ:
        os.environ["RAY_gcs_server_port_wait_time_s"] = str(int(timeout_s))
    failures = []
    for attempt in range(1, attempts + 1):
        folder = SessionFolder()
        label = f"attempt {attempt} of {attempts}"
        error = _run(init, folder.path, timeout_s, note, label, on_owner_thread)
        if error is None:
            atexit.register(_at_exit, shutdown, folder)
            return folder
        shutdown()
        ended = end_processes(folder.path)
        folder.remove()
        failures.append((error, load_text()))
        if attempt < attempts:
            note("warning", f"Ray did not start ({label}: {_what(error, timeout_s)}; {load_text()}); ended its "
                 f"{len(ended)} process(es), removed {folder.path}, trying again")
    raise RayStartError(_final_message(failures, timeout_s, fallback))


def _run(init, folder: str, timeout_s: float, note: Note, label: str, on_owner_thread: bool) -> BaseException | None:
    if not on_owner_thread:
        return _attempt(init, folder, timeout_s, note, label)
    import queue

    outcome: queue.Queue = queue.Queue()

    def own() -> None:
        error = _attempt(init, folder, timeout_s, note, label)
        outcome.put(error)
        if error is None:
            threading.Event().wait()  # park: the cluster's daemons live as long as this thread

    thread = threading.Thread(target=own, name="workbench-ray-owner", daemon=True)
    thread.start()
    error = outcome.get()
    if error is not None:
        thread.join()  # its daemons (PR_SET_PDEATHSIG) go with it
    return error


def _what(error: BaseException, timeout_s: float) -> str:
    """What timed out, in Ray's terms and ours."""
    text = str(error)
    if "gcs_server_port" in text:
        return f"the GCS server did not come up within {int(timeout_s)} s ({TIMEOUT_ENV})"
    if "timed out during startup" in text:
        return "the raylet did not register with the GCS within Ray's fixed 30 s"
    return _first_line(error)


def _final_message(failures: list, timeout_s: float, fallback: str) -> str:
    error, load = failures[-1]
    timed_out = isinstance(error, TimeoutError) or "timed out" in str(error).lower()
    try_ = ["run again when the machine is less busy", f"raise {TIMEOUT_ENV} (now {timeout_s:g} s) or "
            f"{ATTEMPTS_ENV} (now {len(failures)})"]
    if fallback:
        try_.append(f"run without Ray: {fallback}")
    return (f"the local Ray cluster did not start: {len(failures)} attempt(s) "
            f"{'timed out' if timed_out else 'failed'}, the last because {_what(error, timeout_s)}; "
            f"{load or 'load unknown'}. Every process and folder of those attempts was removed. "
            f"Try: {'; or '.join(try_)}.")


def _at_exit(shutdown: Callable[[], None], folder: SessionFolder) -> None:
    # Registered after `import ray`, so this runs before Ray's own atexit shutdown: shut down here,
    # then nothing of the run is left to hold the folder.
    with contextlib.suppress(Exception):
        shutdown()
    folder.remove()
