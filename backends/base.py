"""The backend protocol: submit a JobSpec somewhere, get a handle to follow it.

Every target (local Ray, a Ray cluster, SageMaker, Vertex AI, Azure ML) implements `Backend`;
`dry_run` returns the exact request `submit` would send, with no credentials and no network.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from workbench.spec import JobSpec


class JobState(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    INTERRUPTED = "interrupted"  # spot capacity taken back; the service will restart it
    RESTARTING = "restarting"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def done(self) -> bool:
        return self in (JobState.COMPLETED, JobState.FAILED, JobState.STOPPED)


@dataclass
class JobStatus:
    state: JobState
    message: str = ""
    interruptions: int = 0  # spot interruptions, where the service reports them
    raw: dict = field(default_factory=dict)  # the service's own status fields


def poll_until_done(status, timeout_s: float | None, poll_s: float) -> JobStatus:
    """Call `status()` every `poll_s` seconds until the job is done or `timeout_s` passed."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        current = status()
        if current.state.done or deadline is not None and time.monotonic() >= deadline:
            return current
        time.sleep(poll_s)


@runtime_checkable
class JobHandle(Protocol):
    job_id: str

    def status(self) -> JobStatus: ...

    def logs(self, tail: int = 100) -> str: ...

    def cancel(self) -> None: ...

    def wait(self, timeout_s: float | None = None) -> JobStatus: ...


@runtime_checkable
class Backend(Protocol):
    name: str

    def dry_run(self, spec: JobSpec) -> dict:
        """The exact request submit() would send: JSON-serializable, no secrets, no network."""

    def submit(self, spec: JobSpec) -> JobHandle: ...
