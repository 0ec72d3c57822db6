"""Vertex AI backend: a CustomJob on Spot VMs whose worker pools come from `resources`.

Uses google-cloud-aiplatform's generated v1 layer (JobServiceClient + the CustomJob proto): the
request is built once as the REST JSON body, validated by the proto (unknown fields and enum
names fail), shown by dry_run and sent by submit. No aiplatform.init() globals. Credentials come
from Application Default Credentials (gcloud auth, GOOGLE_APPLICATION_CREDENTIALS, metadata server).
"""
from __future__ import annotations

import json
import re
import shlex
from typing import TYPE_CHECKING

from backends import instances
from backends.base import CloudAccessError, JobState, JobStatus, access_errors, first_line, poll_until_done
from backends.bundle import SPEC_FILE, build_bundle, checkpoint_uri, job_name, sha256, slug
from workbench.errors import ConfigError
from workbench.validate import check_runnable

if TYPE_CHECKING:
    from workbench.spec import JobSpec

BOOT_DISK_GB = 100
_STATES = {
    "JOB_STATE_QUEUED": JobState.PENDING, "JOB_STATE_PENDING": JobState.PENDING, "JOB_STATE_PAUSED": JobState.PENDING,
    "JOB_STATE_RUNNING": JobState.RUNNING, "JOB_STATE_UPDATING": JobState.RUNNING,
    "JOB_STATE_SUCCEEDED": JobState.COMPLETED, "JOB_STATE_PARTIALLY_SUCCEEDED": JobState.FAILED,
    "JOB_STATE_FAILED": JobState.FAILED, "JOB_STATE_EXPIRED": JobState.FAILED,
    "JOB_STATE_CANCELLING": JobState.STOPPED, "JOB_STATE_CANCELLED": JobState.STOPPED,
}


def _sdk():
    try:
        from google.cloud import aiplatform_v1
    except ImportError:
        raise ConfigError("the vertex backend needs google-cloud-aiplatform: pip install 'workbench[gcp]'.") from None
    return aiplatform_v1


def _bucket(spec: JobSpec) -> str:
    return (spec.backend.vertex.bucket or "").removeprefix("gs://").strip("/")


def check(spec: JobSpec) -> None:
    """Vertex-specific rules, before anything is built or sent. Raises ConfigError."""
    check_runnable(spec, read_remote_data=False)  # what the job could not run is refused here, not after the machines start
    vx = spec.backend.vertex
    if not vx.project:
        raise ConfigError("backend.vertex.project is required: the GCP project id that runs the job, e.g. "
                          "project: my-project (see `gcloud config get-value project`).")
    if not re.fullmatch(r"[a-z][a-z0-9-]{4,28}[a-z0-9]", vx.project):
        raise ConfigError(f"backend.vertex.project {vx.project!r} is not a project id (6-30 lowercase letters, "
                          "digits, hyphens). Use the id, not the display name.")
    if not _bucket(spec):
        raise ConfigError("backend.vertex.bucket is required: a gs:// bucket in the job's region for the code "
                          "bundle, outputs and checkpoints, e.g. bucket: gs://my-training-bucket.")
    instances.check_region("vertex", vx.region)


def _labels(spec: JobSpec) -> dict:
    return {"workbench": "true", "workbench-job": re.sub(r"[^a-z0-9_-]", "-", spec.name.lower())[:63]}


def _entry_script(code_path: str) -> str:
    # Vertex mounts every bucket the job can read under /gcs (Cloud Storage FUSE): no gsutil needed.
    return (f"set -e; mkdir -p /tmp/workbench && cd /tmp/workbench && tar -xzf {shlex.quote(code_path)} && "
            "python -m pip install --quiet --no-warn-script-location -r requirements.txt && "
            f"exec python -m workbench.cloud_entry --spec {SPEC_FILE}")


def build_body(spec: JobSpec, name: str, code_key: str, ckpt_uri: str) -> tuple[dict, list[str]]:
    """The CreateCustomJob REST body (camelCase JSON) for the spec. Pure: no SDK, no network."""
    vx, b, res = spec.backend.vertex, spec.backend, spec.resources
    notes = []
    machine = instances.vertex_machine(res.gpu, res.gpus_per_node, res.nodes)
    if vx.image:
        image = vx.image
    else:
        img = instances.vertex_image()
        image, notes = img.uri, ([img.note] if img.note else [])
    machine_spec = {"machineType": vx.machine_type or machine.machine_type}
    if machine.accelerator_type:
        machine_spec |= {"acceleratorType": machine.accelerator_type, "acceleratorCount": res.gpus_per_node}
    # Vertex sets AIP_CHECKPOINT_DIR = <baseOutputDirectory>/checkpoints/; point it at ours when the
    # prefix has that shape, and pass it explicitly otherwise.
    env = [{"name": "WORKBENCH_CLOUD", "value": "vertex"}, {"name": "WORKBENCH_JOB", "value": name}]
    if ckpt_uri.rstrip("/").endswith("/checkpoints"):
        base = ckpt_uri.rstrip("/")[: -len("/checkpoints")] + "/"
    else:
        base = f"gs://{_bucket(spec)}/workbench/{slug(spec.name)}/"
        env.append({"name": "WORKBENCH_CHECKPOINT_DIR", "value": ckpt_uri})
    pool = {"machineSpec": machine_spec, "replicaCount": "1",
            "diskSpec": {"bootDiskType": "pd-ssd", "bootDiskSizeGb": BOOT_DISK_GB},
            "containerSpec": {"imageUri": image,
                              "command": ["bash", "-c", _entry_script(f"/gcs/{_bucket(spec)}/{code_key}")],
                              "env": env}}
    pools = [pool] + ([{**pool, "replicaCount": str(res.nodes - 1)}] if res.nodes > 1 else [])
    scheduling = {"timeout": f"{b.max_runtime_s}s"}
    if b.spot:
        # Spot VMs; a preempted worker is recreated and the whole job restarts from the checkpoint.
        scheduling |= {"strategy": "SPOT", "restartJobOnWorkerRestart": True}
        notes.append(f"Vertex bounds a job by its run time (timeout {b.max_runtime_s}s); it has no total-wait "
                     f"limit for Spot, so backend.max_wait_s ({b.max_wait_s}) is not sent.")
    job_spec = {"workerPoolSpecs": pools, "scheduling": scheduling,
                "baseOutputDirectory": {"outputUriPrefix": base}}
    if vx.service_account:
        job_spec["serviceAccount"] = vx.service_account
    return {"displayName": name, "labels": _labels(spec), "jobSpec": job_spec}, notes


class VertexBackend:
    """Submit a JobSpec as a Vertex AI CustomJob."""

    name = "vertex"

    def __init__(self, credentials=None, api_endpoint: str | None = None, storage_endpoint: str | None = None,
                 root=None):
        self._credentials = credentials  # default: Application Default Credentials
        self._api_endpoint, self._storage_endpoint, self._root = api_endpoint, storage_endpoint, root

    def _prepare(self, spec: JobSpec):
        check(spec)
        ckpt, note = checkpoint_uri(spec, "gs://", f"gs://{_bucket(spec)}", "Vertex AI")
        run_spec = spec.replace(**{"checkpoint.uri": ckpt})
        name = job_name(spec, max_len=128)
        code_key = f"workbench/{slug(spec.name)}/{name}/code.tar.gz"
        body, notes = build_body(run_spec, name, code_key, ckpt)
        job = _sdk().CustomJob.from_json(json.dumps(body))  # validates names, enums and types
        return run_spec, job, code_key, notes + ([note] if note else [])

    def _parent(self, spec: JobSpec) -> str:
        return f"projects/{spec.backend.vertex.project}/locations/{spec.backend.vertex.region}"

    def dry_run(self, spec: JobSpec) -> dict:
        """The validated CreateCustomJob request; no credentials, no network."""
        aiplatform_v1 = _sdk()
        run_spec, job, code_key, notes = self._prepare(spec)
        data = build_bundle(run_spec, self._root)
        bundle = data.tar_gz()
        host = f"https://{spec.backend.vertex.region}-aiplatform.googleapis.com"
        return {"operation": "CreateCustomJob", "endpoint": f"{host}/v1/{self._parent(spec)}/customJobs",
                # Enum names for reading; the REST transport sends the same values as integers.
                "body": json.loads(aiplatform_v1.CustomJob.to_json(job, indent=None, use_integers_for_enums=False,
                                                                   always_print_fields_with_no_presence=False)),
                "code": {"upload": f"gs://{_bucket(spec)}/{code_key}", "sha256": sha256(bundle), **data.summary()},
                "notes": notes}

    def submit(self, spec: JobSpec) -> VertexJob:
        """Upload the code bundle to the bucket and create the CustomJob.

        Raises:
            ConfigError: invalid spec, or a request Google refused (no such bucket, a bad field).
            CloudAccessError: no usable credentials (exit_code 77) or Google unreachable (69).
        """
        aiplatform_v1 = _sdk()
        from google.api_core.client_options import ClientOptions
        from google.cloud import storage

        run_spec, job, code_key, _ = self._prepare(spec)
        vx = spec.backend.vertex
        data = build_bundle(run_spec, self._root).tar_gz()
        gcs_options = ClientOptions(api_endpoint=self._storage_endpoint) if self._storage_endpoint else None
        with access_errors(_access_error):  # Application Default Credentials are looked for here, then used
            gcs = storage.Client(project=vx.project, credentials=self._credentials, client_options=gcs_options)
            gcs.bucket(_bucket(spec)).blob(code_key).upload_from_string(data, content_type="application/gzip")
            endpoint = self._api_endpoint or f"{vx.region}-aiplatform.googleapis.com"
            client = aiplatform_v1.JobServiceClient(credentials=self._credentials, transport="rest",
                                                    client_options=ClientOptions(api_endpoint=endpoint))
            created = client.create_custom_job(parent=self._parent(spec), custom_job=job)
        return VertexJob(client, created.name)


_LOGIN = ("Run `gcloud auth application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS to a service-account "
          "key file, then dispatch again.")


def _access_error(e: Exception) -> Exception | None:
    """google-auth's and google-api-core's credential, connection and service errors -> one line
    (see backends/base.py)."""
    import requests
    from google.api_core import exceptions as api
    from google.auth import exceptions as gauth

    if isinstance(e, gauth.DefaultCredentialsError):
        return CloudAccessError.no_credentials(f"vertex: no usable Google credentials ({first_line(e)}). {_LOGIN}")
    if isinstance(e, (gauth.RefreshError, api.Unauthenticated, api.Unauthorized, api.PermissionDenied, api.Forbidden)):
        return CloudAccessError.no_credentials(
            f"vertex: Google refused the credentials in use ({first_line(e)}). They are wrong, expired or lack the "
            f"permission: {_LOGIN}")
    if isinstance(e, (gauth.TransportError, requests.ConnectionError, requests.Timeout, api.ServiceUnavailable,
                      api.RetryError, api.DeadlineExceeded)):
        return CloudAccessError.unreachable(
            f"vertex: cannot reach Google Cloud ({first_line(e)}). Check the network or proxy (HTTPS_PROXY) and "
            "backend.vertex.region, then dispatch again.")
    if isinstance(e, api.ClientError):
        return ConfigError(f"vertex: Google refused the request ({first_line(e)}). Fix the setting it names "
                           "(backend.vertex.*) and dispatch again.")
    return None


def map_state(state_name: str, error: str = "") -> JobStatus:
    """A Vertex JobState name -> JobStatus. Vertex restarts preempted Spot workers inside RUNNING and
    does not report interruptions, so `interruptions` stays 0 here."""
    return JobStatus(_STATES.get(state_name, JobState.PENDING), error, 0, {"state": state_name})


class VertexJob:
    """A submitted CustomJob: poll its state, cancel it."""

    def __init__(self, client, name: str):
        self.job_id = name  # projects/P/locations/R/customJobs/ID
        self._client = client

    def status(self) -> JobStatus:
        job = self._client.get_custom_job(name=self.job_id)
        return map_state(job.state.name, job.error.message if job.error else "")

    def logs(self, tail: int = 100) -> str:
        project, region, job_id = self.job_id.split("/")[1], self.job_id.split("/")[3], self.job_id.split("/")[-1]
        return (f"Vertex job logs are in Cloud Logging: resource.labels.job_id={job_id} (project {project}); "
                f"console: https://console.cloud.google.com/vertex-ai/locations/{region}/training/{job_id}"
                f"?project={project}")

    def cancel(self) -> None:
        self._client.cancel_custom_job(name=self.job_id)

    def wait(self, timeout_s: float | None = None, poll_s: float = 30.0) -> JobStatus:
        return poll_until_done(self.status, timeout_s, poll_s)
