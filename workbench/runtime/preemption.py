"""The preemption notice: SIGTERM (or SIGHUP, the launcher's death) means "finish this step,
checkpoint, exit with EXIT_PREEMPTED".

Spot capacity is reclaimed with a SIGTERM and a grace period (AWS: 2 minutes, GCP: 30 s, Azure:
30 s) before SIGKILL. The training loop polls `PreemptionNotice.requested` after every step;
the driver (`workbench run`) forwards the notice to its workers with `forward_signal`. A second
SIGTERM while stopping exits at once. The exit code contract is in docs/checkpoints.md.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on purpose; a checkpoint was written; resume with --resume
DEFAULT_GRACE_S = 30.0  # the shortest of the clouds' notices


def grace_seconds() -> float:
    """The grace period to plan for: $WORKBENCH_PREEMPT_GRACE_S, else DEFAULT_GRACE_S."""
    try:
        return float(os.environ.get("WORKBENCH_PREEMPT_GRACE_S", DEFAULT_GRACE_S))
    except ValueError:
        return DEFAULT_GRACE_S


class _SignalScope:
    """Installs `self._handle` for `self.signals` while active (main thread only, else inert)
    and restores the previous handlers on exit."""

    signals: tuple[int, ...]
    _previous: dict[int, object]

    def _handle(self, signum, frame) -> None:
        raise NotImplementedError

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


class PreemptionNotice(_SignalScope):
    """Records SIGTERM while active (a context manager); the loop polls `requested`.

    Signal handlers can only be installed from the main thread; elsewhere (a Ray actor's
    training thread) this does nothing and the launcher delivers the stop instead.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)):
        self.signals = signals
        self.received_at: float | None = None
        self._terms = 0
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    def seconds_left(self) -> float:
        """Seconds of the grace period left since the notice (the full grace before one)."""
        if self.received_at is None:
            return grace_seconds()
        return grace_seconds() - (time.monotonic() - self.received_at)

    def overrun_message(self) -> str:
        over = -self.seconds_left()
        return (f"stopping after the preemption notice took {grace_seconds() + over:.1f} s, {over:.1f} s more than "
                f"the {grace_seconds():g} s grace period (WORKBENCH_PREEMPT_GRACE_S): the cloud may have killed the "
                "run before its checkpoint. Write checkpoints to faster storage, or make steps shorter.")

    def _handle(self, signum, frame) -> None:
        # SIGHUP: the launcher died (stop_with_parent). Linux may send it once per thread of the
        # dead launcher, so repeats are ignored; a second SIGTERM stops waiting for the step.
        self._terms += signum == signal.SIGTERM
        if self._terms > 1:
            sys.exit(128 + signum)
        if self.received_at is None:
            self.received_at = time.monotonic()


class forward_signal(_SignalScope):
    """While active, the first SIGTERM calls `stop()` (once, on a helper thread) instead of
    killing the process; a second one exits with 128 + SIGTERM. Main thread only, else inert.

    Usage (the driver): `with forward_signal(handle.cancel): follow(handle)`.
    """

    def __init__(self, stop: Callable[[], None], signals: tuple[int, ...] = (signal.SIGTERM,)):
        self.stop, self.signals = stop, signals
        self.received = False
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.received:
            sys.exit(128 + signum)
        self.received = True
        print(f"received signal {signum}: stopping after the current step and writing a checkpoint",
              file=sys.stderr, flush=True)
        threading.Thread(target=self.stop, name="workbench-stop", daemon=True).start()


def stop_with_parent() -> None:
    """Have Linux send this process SIGHUP when the process that started it dies (prctl
    PR_SET_PDEATHSIG): a rank whose launcher was killed (torchrun's agent) takes the preemption
    path (PreemptionNotice), checkpointing and exiting EXIT_PREEMPTED, instead of training on
    unsupervised. SIGHUP, not SIGTERM: the kernel sends it again as the orphan passes from one
    dying thread of the launcher to the next, and a repeated SIGTERM means "stop now". Elsewhere
    than Linux this does nothing."""
    import ctypes

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGHUP)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before the call above
        os.kill(os.getpid(), signal.SIGHUP)
