"""The backend protocol: submit a JobSpec somewhere, get a handle to follow it.

Every target (local Ray, a Ray cluster, SageMaker, Vertex AI, Azure ML) implements `Backend`;
`dry_run` returns the exact request `submit` would send, with no credentials and no network.
"""
from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from workbench.errors import WorkerError

if TYPE_CHECKING:
    from workbench.spec import JobSpec

# Exit codes of `workbench dispatch` (and of `workbench run` for a remote backend) when the cloud
# could not be used, by sysexits.h as 69 (no local Ray cluster) and 75 (preempted) elsewhere.
EXIT_UNREACHABLE = 69  # EX_UNAVAILABLE: the service's endpoint could not be reached
EXIT_NO_CREDENTIALS = 77  # EX_NOPERM: no credentials were found, or the service refused them


class CloudAccessError(WorkerError):
    """A submission that could not reach the service or had no usable credentials, in one line that
    names the backend and the fix; `workbench dispatch` prints it and exits with `exit_code`."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code

    @classmethod
    def no_credentials(cls, message: str) -> CloudAccessError:
        return cls(message, EXIT_NO_CREDENTIALS)

    @classmethod
    def unreachable(cls, message: str) -> CloudAccessError:
        return cls(message, EXIT_UNREACHABLE)


@contextlib.contextmanager
def access_errors(classify: Callable[[Exception], Exception | None]):
    """Raise what `classify` makes of an SDK's exception (a CloudAccessError for credentials and
    connectivity, a ConfigError for a request the service refused), or the exception itself when
    it gives None. The SDK's exception stays attached as the cause."""
    try:
        yield
    except Exception as e:
        translated = classify(e)
        if translated is None:
            raise
        raise translated from e


def first_line(error: BaseException, limit: int = 200) -> str:
    """The first line of an SDK error's own message (its first argument), cut at `limit` characters."""
    text = str(error.args[0]) if error.args else str(error)
    line = text.strip().splitlines()[0].rstrip(".") if text.strip() else type(error).__name__
    return line if len(line) <= limit else line[:limit - 3] + "..."


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
