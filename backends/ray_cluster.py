"""Ray cluster backend: submit the job to an existing cluster through the Ray Jobs API (what
`ray job submit` uses), shipping the code bundle as the job's working_dir with the spec in it.

Token authentication (Ray's default): the cluster's token is read from where Ray keeps it
(RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token) and sent only as an Authorization header.

`ray job stop` (JobSubmissionClient.stop_job) sends the driver SIGTERM and SIGKILLs it after
RAY_JOB_STOP_WAIT_TIME_S (Ray's default: 3 s). The request sets that to the preemption grace period
(WORKBENCH_PREEMPT_GRACE_S, 30 s by default), which the job's supervisor actor reads from the job's
env_vars; the driver (workbench.cloud_entry) stops the ranks after a step, checkpoints, writes the
`end` event and releases the checkpoint lease within it, and exits 75.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from backends.base import CloudAccessError, JobState, JobStatus, access_errors, first_line, poll_until_done
from backends.bundle import SPEC_FILE, build_bundle, job_name, sha256
from workbench.errors import ConfigError
from workbench.validate import check_runnable

if TYPE_CHECKING:
    from workbench.spec import JobSpec

ENTRYPOINT = f"python -m workbench.cloud_entry --spec {SPEC_FILE}"
_STATES = {"PENDING": JobState.PENDING, "RUNNING": JobState.RUNNING, "SUCCEEDED": JobState.COMPLETED,
           "FAILED": JobState.FAILED, "STOPPED": JobState.STOPPED}


def check(spec: JobSpec) -> None:
    """Ray-cluster rules. Raises ConfigError."""
    check_runnable(spec, read_remote_data=False)  # what the job could not run is refused here, not after the machines start
    address = spec.backend.ray.address
    if not address.startswith(("http://", "https://", "ray://")):
        raise ConfigError(f"backend.ray.address {address!r}: give the cluster's dashboard (Jobs API) address, "
                          "e.g. http://head-node:8265.")
    uri, ck = spec.checkpoint.uri, spec.checkpoint
    if spec.backend.spot:
        saving = ck.every_steps > 0 or ck.every_minutes > 0
        if not saving or not uri or "://" not in uri and not uri.startswith("/"):
            what = ("no checkpoint schedule (checkpoint.every_steps / every_minutes)" if not saving else
                    f"checkpoint.uri {uri!r} is relative (the job's temporary folder)" if uri else "no checkpoint.uri")
            raise ConfigError(
                f"backend.spot=true on a Ray cluster with {what}: a preempted node would lose the whole run, and "
                "the cluster has no bucket of its own to default to. Set checkpoint.uri to an object store every "
                "node reaches (s3://, gs://, az://) or an absolute path on a file system mounted on every node, "
                "with checkpoint.every_steps > 0; or set backend.spot=false.")


def _notes(spec: JobSpec) -> list[str]:
    uri, ck = spec.checkpoint.uri, spec.checkpoint
    saving = ck.every_steps > 0 or ck.every_minutes > 0
    if saving and (not uri or "://" not in uri and not uri.startswith("/")):
        where = f"checkpoint.uri {uri!r} is relative" if uri else "no checkpoint.uri"
        return [f"{where}: on the cluster checkpoints land in the job's temporary working directory and are "
                "lost with it. Use an absolute path on shared storage, or s3:// / gs://."]
    if saving and "://" not in uri:
        return [f"checkpoint.uri {uri!r} is a local path: every node of the cluster must see the same folder there "
                "(a shared file system), or ranks restarted on other nodes will not find the checkpoints. On "
                "nodes that share no file system use an object store (s3://, gs://, az://)."]
    return []


def stop_grace_s() -> int:
    """Seconds `ray job stop` waits for the driver before SIGKILL: the preemption grace period."""
    from workbench.runtime.preemption import grace_seconds

    return max(1, math.ceil(grace_seconds()))


def build_request(spec: JobSpec, name: str, working_dir: str) -> dict:
    """The Jobs API submission (JobSubmissionClient.submit_job keyword arguments)."""
    grace = stop_grace_s()
    env = {"WORKBENCH_CLOUD": "ray", "WORKBENCH_JOB": name, "WORKBENCH_RUN_ID": name,
           # read by the job's supervisor actor: SIGTERM, then this long before SIGKILL
           "RAY_JOB_STOP_WAIT_TIME_S": str(grace), "WORKBENCH_PREEMPT_GRACE_S": str(grace)}
    return {
        "entrypoint": ENTRYPOINT,
        "submission_id": name,
        "runtime_env": {"working_dir": working_dir, "env_vars": env},
        "metadata": {"workbench": "true", "workbench_job": spec.name},
    }


def _auth_headers() -> dict:
    """The cluster token as a header. Passed explicitly because Ray's client reads RAY_AUTH_MODE
    once per process (at import), so a token made available later would otherwise be ignored."""
    token = os.environ.get("RAY_AUTH_TOKEN")
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if not token and path.is_file():
        token = path.read_text().strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


class RayClusterBackend:
    """Submit a JobSpec to a running Ray cluster."""

    name = "ray"

    def __init__(self, root=None):
        self._root = root  # project directory to bundle; default: the current directory

    def dry_run(self, spec: JobSpec) -> dict:
        """The Jobs API request (POST /api/jobs/), the bundle standing in for working_dir."""
        check(spec)
        bundle = build_bundle(spec, self._root)
        request = build_request(spec, job_name(spec), "<the code bundle below, uploaded as a package>")
        return {"operation": "POST /api/jobs/", "endpoint": spec.backend.ray.address.rstrip("/") + "/api/jobs/",
                "body": request, "code": {"sha256": sha256(bundle.tar_gz()), **bundle.summary()},
                "notes": _notes(spec)}

    def submit(self, spec: JobSpec) -> RayClusterJob:
        """Upload the bundle and start the job; returns a handle that follows it."""
        return self.submit_entrypoint(spec, ENTRYPOINT)

    def submit_entrypoint(self, spec: JobSpec, entrypoint: str) -> RayClusterJob:
        """Submit the spec's bundle with another entrypoint (e.g. a smoke-test command)."""
        from ray.job_submission import JobSubmissionClient

        check(spec)
        name = job_name(spec)
        address = spec.backend.ray.address  # validate refused one with a credential in it: it may be shown
        with tempfile.TemporaryDirectory(prefix="workbench-bundle-") as tmp:
            working_dir = build_bundle(spec, self._root).write_dir(Path(tmp) / "code")
            request = build_request(spec, name, str(working_dir))
            request["entrypoint"] = entrypoint
            with access_errors(lambda e: _access_error(e, address)):  # the client checks the dashboard first
                client = JobSubmissionClient(address, headers=_auth_headers())
                _submit_with_retry(client, request)
        return RayClusterJob(client, name)


def _access_error(e: Exception, address: str) -> Exception | None:
    """Ray's job-submission client's connection and token errors -> one line (see backends/base.py)."""
    import requests
    from ray.exceptions import AuthenticationError

    if isinstance(e, (ConnectionError, requests.ConnectionError, requests.Timeout)):
        return CloudAccessError.unreachable(
            f"ray: cannot reach the Ray dashboard at {address} ({first_line(e)}). Is the cluster up, and its "
            "dashboard port (8265 by default) reachable from here? Check backend.ray.address, then dispatch again.")
    if isinstance(e, AuthenticationError):
        return CloudAccessError.no_credentials(
            f"ray: the Ray dashboard at {address} refused the request ({first_line(e)}). Set RAY_AUTH_TOKEN (or "
            "RAY_AUTH_TOKEN_PATH) to the cluster's token, then dispatch again.")
    return None


def _submit_with_retry(client, request: dict, timeout_s: float = 60.0) -> None:
    """submit_job (which first uploads working_dir), retried while a freshly started head's job
    agent is not up yet ("No available agent to submit job")."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.submit_job(**request)
            return
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


class RayClusterJob:
    """A job on a Ray cluster: status, logs, metrics events from the logs, stop."""

    def __init__(self, client, submission_id: str):
        self.job_id = submission_id
        self._client = client

    def status(self) -> JobStatus:
        info = self._client.get_job_info(self.job_id)
        state = _STATES.get(str(info.status.value if hasattr(info.status, "value") else info.status),
                            JobState.PENDING)
        return JobStatus(state, info.message or "", 0, {"status": str(info.status), "entrypoint": info.entrypoint})

    def logs(self, tail: int = 100) -> str:
        return "\n".join(self._client.get_job_logs(self.job_id).splitlines()[-tail:])

    def metrics(self) -> list[dict]:
        """The metrics events (the contract, docs/architecture.md) the job printed as JSON lines."""
        events = []
        for line in self._client.get_job_logs(self.job_id).splitlines():
            if line.startswith('{"event"'):
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return events

    def cancel(self) -> None:
        self._client.stop_job(self.job_id)

    def wait(self, timeout_s: float | None = None, poll_s: float = 1.0) -> JobStatus:
        return poll_until_done(self.status, timeout_s, poll_s)


def quote(args: list[str]) -> str:
    """A shell-safe entrypoint from an argument list."""
    return " ".join(shlex.quote(a) for a in args)
