"""Ray start-up for the `local` backend: the embedded cluster (`ensure_ray`) and the CPU scheduling
of its processes (`control_plane_setup`, `set_policy`): Ray's own workers yield the CPU to the ranks.

The relays and the ranks they start are backends/ray_relay.py; the driver's job, backends/local_ray.py.
"""
from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path


def _package_root() -> str:
    # backends/ and workbench/ install side by side (pyproject: one distribution, both packages),
    # so their common parent puts both on the workers' path; no `import workbench` (an import cycle).
    return str(Path(__file__).resolve().parent.parent)


def ensure_ray(num_cpus: int | None = None, note: Callable[[str, str], None] | None = None, fallback: str = ""):
    """Start (or reuse) the embedded Ray cluster; workers import workbench from this checkout.

    The start survives a busy machine (backends/ray_start.py): each attempt runs in a folder of its
    own under `<ray temp dir>/workbench/`, bounded by WORKBENCH_RAY_START_TIMEOUT_S; a failed
    attempt's processes and folder are removed before the next; after the last, RayStartError
    (exit 69) says what timed out, the load seen and what to try (`fallback`: the Ray-free route).
    `note(kind, line)` gets a warning for each retry and a note while a start is under way (default:
    printed on stderr). The folder is removed
    when this process exits.

    Safe from any thread: Ray forks its gcs_server and raylet with PR_SET_PDEATHSIG, which Linux
    fires when the *thread* that forked them exits, and the driver dies 60 s later ("Failed to
    connect to GCS"). Off the main thread (the notebook's Run button) the cluster is therefore
    started by a thread that lives as long as the process.
    """
    import ray

    from backends.ray_start import start_ray

    if not ray.is_initialized():
        def say(kind: str, line: str) -> None:
            print(f"{kind}: {line}", file=sys.stderr, flush=True)

        start_ray(functools.partial(_init_ray, num_cpus), ray.shutdown, note=note or say,
                  on_owner_thread=threading.current_thread() is not threading.main_thread(), fallback=fallback)
    return ray


def _init_ray(num_cpus: int | None, temp_dir: str) -> None:
    import ray

    root = _package_root()
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    ray.init(
        # "local": always an embedded cluster, never one a `ray start` left running
        # (that is the `ray` backend's job).
        address="local",
        num_cpus=num_cpus or os.cpu_count() or 1,
        include_dashboard=False,
        logging_level="ERROR",
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path},
                     "worker_process_setup_hook": "backends.embedded_ray.control_plane_setup"},
        # Ray runs workers at nice 15 so that its own daemons stay responsive; here
        # the workers are the job and should not yield to every daemon wake-up (no
        # measurable change on a 2-core VM: docs/benchmarks.md, section a).
        _system_config={"worker_niceness": 0},
        _temp_dir=temp_dir,  # this attempt's own folder: what it started is known by it (ray_start.py)
    )


def set_policy(policy_name: str) -> None:
    """Put every thread of this process under the Linux scheduling policy `policy_name`
    ("SCHED_BATCH", "SCHED_IDLE", "SCHED_OTHER"); a no-op where the OS has none."""
    policy = getattr(os, policy_name, None)
    if policy is None or not os.path.isdir("/proc/self/task"):
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))
        except OSError:  # the thread has exited, or a sandbox forbids it: only slower
            pass


def control_plane_setup() -> None:
    """Every Ray worker process of the embedded cluster runs SCHED_BATCH (its runtime_env's
    worker_process_setup_hook): Ray's core worker wakes each actor process ~100 times a second,
    and a batch process does not preempt a rank when it wakes; it runs on a CPU the ranks leave
    idle (waiting on a collective) or at the next tick. The ranks switch back to SCHED_OTHER
    (`ray_relay._rank_main`).

    A relay goes further, to SCHED_IDLE, once its rank has started (a rank forked from an idle
    process cannot leave SCHED_IDLE without privileges, so the hook cannot): it then runs only on
    CPU time the ranks leave idle."""
    set_policy("SCHED_BATCH")
