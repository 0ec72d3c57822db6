"""A per-rank entry for `ray_relay._rank_main` without torch: step events and the stop poll only,
as the training loop makes them (after each step `should_stop`, then the step event: the loop
agrees on the stop and the loss in one all-reduce before rank 0 reports the step), so that a test
can play the driver's side of the pipe."""
from __future__ import annotations


def steps_until_stopped(spec: dict, sink, *, should_stop, resume: bool = False, attempt: int = 0) -> dict:
    step = 0
    for step in range(1, spec["steps"] + 1):
        stop = should_stop()
        sink({"event": "step", "step": step})
        if stop:
            sink({"event": "end", "status": "preempted", "step": step})
            return {"status": "preempted", "step": step}
    sink({"event": "end", "status": "completed", "step": step})
    return {"status": "completed", "step": step}


def env_probe(spec: dict, sink, *, should_stop, resume: bool = False, attempt: int = 0) -> dict:
    """Sends the values of the environment variables named in `spec["names"]` as the rank sees them."""
    import os

    sink({"event": "note", "message": {name: os.environ.get(name) for name in spec["names"]}})
    return {"status": "completed", "step": 0}
