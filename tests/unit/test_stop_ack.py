"""The stop acknowledgement between the driver and rank 0 (backends/ray_relay.py `_rank_main`,
#35): rank 0 does not wait for the driver on every step, only when a decision would leave more
than STOP_WITHIN_STEPS - 1 steps unacknowledged (the decision after step S precedes its report),
and a cancel made while step N was the newest step delivered stops it after step
N + STOP_WITHIN_STEPS at the latest. The real rank process over a
real pipe; the test plays the driver (backends/local_ray.py `_take`: an acknowledgement carries
the stop request as it stood when that step was delivered), and acknowledges as the relay does
(`_send_quietly`): a rank that stopped may have exited before the acknowledgement of its last
step is written."""
import os
import subprocess
import sys
from multiprocessing import Pipe

import pytest

from backends.ray_relay import _CHILD, STOP_WITHIN_STEPS, _send_quietly

pytestmark = pytest.mark.timeout(120)
ENTRY = {"steps": 40}


def start_rank(stop_within: int | None = None):
    from tests.helpers.stepping import steps_until_stopped

    conn, child_end = Pipe()
    config = {"spec": ENTRY, "resume": False, "attempt": 0, "entry": steps_until_stopped}
    if stop_within is not None:
        config["stop_within_steps"] = stop_within
    conn.send(config)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(child_end.fileno())],
                            pass_fds=[child_end.fileno()], env=env)
    child_end.close()
    return conn, proc


def next_event(conn, timeout_s: float = 30.0):
    assert conn.poll(timeout_s), f"no message from the rank within {timeout_s} s"
    kind, payload = conn.recv()
    return payload if kind == "event" else (kind, payload)


def finish(conn, proc) -> list:
    """The rank's remaining messages, then its exit."""
    rest = []
    while True:
        try:
            rest.append(next_event(conn))
        except (EOFError, ConnectionResetError):  # the end: a socket closed with acknowledgements unread
            break  # in it reads as a reset once its data is read, not as EOF (the relay takes both)
    assert proc.wait(timeout=30) == 0
    return rest


@pytest.mark.parametrize("k", [STOP_WITHIN_STEPS, 3])
def test_rank_0_runs_k_steps_ahead_of_the_acknowledgements_and_then_waits(k):
    conn, proc = start_rank(stop_within=None if k == STOP_WITHIN_STEPS else k)
    try:
        steps = [next_event(conn)["step"] for _ in range(k - 1)]
        assert steps == list(range(1, k))  # no acknowledgement yet: k - 1 steps reported anyway
        # step k ran; its decision (which precedes its report) needs the acknowledgement of step 1
        assert not conn.poll(1.0), "the rank reported step k without the acknowledgement of step 1"
        conn.send(("ack", 1, False))
        assert next_event(conn)["step"] == k
        assert not conn.poll(1.0)
        conn.send(("ack", 2, True))  # a cancel made while step 1 was the newest step delivered
        rest = finish(conn, proc)
    finally:
        proc.kill()
    # decided after step k + 1 (the first decision that holds the acknowledgement of step 2)
    assert rest == [{"event": "step", "step": k + 1}, {"event": "end", "status": "preempted", "step": k + 1},
                    ("done", None)]


def test_fewer_than_two_steps_cannot_be_promised():
    """The rank decides before it reports the step, so the newest step the driver can have seen
    when a decision is made is the one before: k = 1 is refused, not silently weakened, and the
    refusal reaches the driver's side of the pipe as the rank's failure."""
    conn, proc = start_rank(stop_within=1)
    try:
        kind, message = next_event(conn)
        assert kind == "failed" and message.startswith("ValueError: stop_within_steps must be at least 2, not 1")
        assert proc.wait(timeout=30) == 1
    finally:
        proc.kill()


def test_a_cancel_at_step_n_stops_by_step_n_plus_k_when_every_acknowledgement_is_as_late_as_possible():
    """The worst case: the driver acknowledges one step at a time, the oldest unacknowledged, and
    only once the rank has stopped reporting steps (it waits for one). The cancel comes while step
    N is the newest step delivered, so acknowledgements of steps after N carry it: the rank stops
    after step N + k at the latest (exactly then, unless a pause of the rank looked like a wait)."""
    n = 5
    conn, proc = start_rank()
    acked = 0
    try:
        while True:
            if not conn.poll(0.3):  # the rank is waiting for an acknowledgement: the oldest it lacks
                acked += 1
                _send_quietly(conn, ("ack", acked, acked > n))
                continue
            event = next_event(conn)
            if event["event"] != "step":
                break
        assert event["status"] == "preempted" and n + 1 <= event["step"] <= n + STOP_WITHIN_STEPS, event
        assert finish(conn, proc) == [("done", None)]
    finally:
        proc.kill()


def test_a_cancel_at_step_n_with_prompt_acknowledgements_stops_within_k_steps():
    n = 5
    conn, proc = start_rank()
    try:
        while True:
            event = next_event(conn)
            if event["event"] != "step":
                break
            _send_quietly(conn, ("ack", event["step"], event["step"] > n))
        assert n + 1 <= event["step"] <= n + STOP_WITHIN_STEPS, event
        assert event["status"] == "preempted"
        assert finish(conn, proc) == [("done", None)]
    finally:
        proc.kill()


def test_the_end_reaches_the_driver_with_steps_unacknowledged():
    """The last step's acknowledgement is not waited for: the rank's last events and its exit
    arrive although the driver acknowledged nothing after step 39 of 40 (deciding after step 40
    needs the acknowledgement of step 40 - k + 1 only)."""
    conn, proc = start_rank()
    try:
        events = []
        while True:
            event = next_event(conn)
            if isinstance(event, tuple) or event["event"] != "step":
                break
            events.append(event["step"])
            if event["step"] <= 40 - STOP_WITHIN_STEPS + 1:
                conn.send(("ack", event["step"], False))
        assert events == list(range(1, 41))
        assert event == {"event": "end", "status": "completed", "step": 40}
        assert finish(conn, proc) == [("done", None)]
    finally:
        proc.kill()
