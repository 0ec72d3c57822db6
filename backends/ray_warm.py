"""The relays a finished job leaves ready for the driver's next job (backends/local_ray.py): a
notebook that runs twice finds its placement group, its relays and, in each relay, a rank process
that has already imported torch and the runtime (`ray_relay.RankRelay.standby`).

Only a job whose every rank ended cleanly leaves its relays; a job with another shape (world size,
tp, resources per rank) releases them first, so at most one set is kept, and they are released
after WORKBENCH_WARM_RANKS_S seconds unused (default 300; 0: never kept). Kept relays hold their
placement group's resources, as the job did: `release_warm()` frees them at once. Each job still
gets new rank processes and a process group of its own.
"""
from __future__ import annotations

import threading

from backends.ray_start import setting

WARM_ENV = "WORKBENCH_WARM_RANKS_S"
DEFAULT_WARM_S = 300.0

_lock = threading.Lock()
_warm: dict = {}  # {"key", "group", "relays", "where", "timer"} of the set kept, or empty


def warm_seconds() -> float:
    """How long a finished job's relays are kept for the next (WORKBENCH_WARM_RANKS_S; 0: not kept)."""
    return setting(WARM_ENV, DEFAULT_WARM_S, 0)


def keep(key: tuple, group, relays: list, where: list[dict]) -> bool:
    """Keep a finished job's relays (each starts its next rank process) for the next job of shape
    `key`; False when keeping is off or a relay could not start its next rank (the caller tears
    them down; the job that ended is not affected)."""
    import ray

    seconds = warm_seconds()
    if seconds <= 0:
        return False
    try:
        ray.get([r.standby.remote() for r in relays], timeout=60)
    except Exception:  # noqa: BLE001 - a relay that cannot start its next rank: the job tears them down
        return False
    timer = threading.Timer(seconds, release_warm)
    timer.daemon = True
    with _lock:
        old = dict(_warm)
        _warm.clear()
        _warm.update(key=key, group=group, relays=relays, where=where, timer=timer)
    _release(old)
    timer.start()
    return True


def take(key: tuple) -> tuple | None:
    """(group, relays, where) kept for a job of shape `key`, if they still answer; else None, with
    whatever was kept released (another shape, or a cluster that has gone since)."""
    import ray

    with _lock:
        kept = dict(_warm)
        _warm.clear()
    if not kept:
        return None
    kept["timer"].cancel()
    if kept["key"] != key:
        _release(kept)
        return None
    try:
        ray.get([r.where.remote() for r in kept["relays"]], timeout=10)
    except Exception:  # noqa: BLE001 - dead actors or a cluster shut down: start afresh
        _release(kept)
        return None
    return kept["group"], kept["relays"], kept["where"]


def wait_ready(timeout_s: float = 300) -> bool:
    """Wait until the kept relays' rank processes have finished their imports (a benchmark's next
    arm must not compete with them for the CPU); False when none are kept."""
    import ray

    with _lock:
        relays = list(_warm.get("relays", []))
    if relays:
        ray.get([r.ready.remote() for r in relays], timeout=timeout_s)
    return bool(relays)


def release_warm() -> None:
    """Tear down the relays kept for a next job (their rank processes die with them) and free
    their placement group's resources."""
    with _lock:
        kept = dict(_warm)
        _warm.clear()
    _release(kept)


def _release(kept: dict) -> None:
    if not kept:
        return
    import ray
    from ray.util.placement_group import remove_placement_group

    kept["timer"].cancel()
    if not ray.is_initialized():
        return
    try:
        for r in kept["relays"]:
            ray.kill(r)
        remove_placement_group(kept["group"])
    except Exception:  # noqa: BLE001 - already gone with their cluster
        pass
