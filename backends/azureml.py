"""Azure ML backend: a command job with PyTorch distribution, Spot tier and a read-write mounted
output folder for checkpoints, on a curated ACPT PyTorch environment (or the user's).

azure-ai-ml builds the job and uploads the code bundle as a code asset; credentials come from
azure-identity's DefaultAzureCredential (environment, workload/managed identity, Azure CLI login).
"""
from __future__ import annotations

import logging
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from backends import instances
from backends.base import JobState, JobStatus, poll_until_done
from backends.bundle import SPEC_FILE, build_bundle, checkpoint_uri, job_name, sha256
from workbench.errors import ConfigError
from workbench.validate import check_runnable

if TYPE_CHECKING:
    from workbench.spec import JobSpec

DEFAULT_DATASTORE = "azureml://datastores/workspaceblobstore/paths"
SHM_SIZE = "16g"  # NCCL and DataLoader workers need more than Docker's 64 MB default
# Azure starts process_count_per_instance copies of the command per node: the lock makes the
# first one install the requirements and the others find them installed.
COMMAND = ("flock /tmp/workbench-pip.lock python -m pip install --quiet --no-warn-script-location -r requirements.txt"
           f" && python -m workbench.cloud_entry --spec {SPEC_FILE} --checkpoint-dir ${{{{outputs.checkpoints}}}}")
CODE_PLACEHOLDER = "<code asset: the bundle below, uploaded by submit()>"
_PENDING = {"NotStarted", "Starting", "Provisioning", "Preparing", "Queued"}
_STATES = {"Running": JobState.RUNNING, "Finalizing": JobState.RUNNING, "Completed": JobState.COMPLETED,
           "Failed": JobState.FAILED, "NotResponding": JobState.FAILED, "Canceled": JobState.STOPPED,
           "CancelRequested": JobState.STOPPED, "Paused": JobState.INTERRUPTED}


def _sdk():
    try:
        import azure.ai.ml as ml
    except ImportError:
        raise ConfigError("the azureml backend needs azure-ai-ml and azure-identity: "
                          "pip install 'workbench[azure]'.") from None
    # queue_settings (the Spot tier) is flagged "experimental" in the SDK and warns on every CLI
    # run; the REST field is stable, so keep that notice out of the user's terminal.
    logging.getLogger("azure.ai.ml._utils._experimental").setLevel(logging.ERROR)
    return ml


def check(spec: JobSpec) -> None:
    """Azure-specific rules, before anything is built or sent. Raises ConfigError."""
    check_runnable(spec)  # what the job could not run is refused here, not after the machines start
    az = spec.backend.azureml
    for field, example in (("subscription_id", "00000000-0000-0000-0000-000000000000"),
                           ("resource_group", "my-rg"), ("workspace", "my-workspace")):
        if not getattr(az, field):
            raise ConfigError(f"backend.azureml.{field} is required to find the workspace, e.g. {field}: {example} "
                              "(see `az ml workspace show`).")
    if not re.fullmatch(r"[0-9a-fA-F]{8}-([0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}", az.subscription_id):
        raise ConfigError(f"backend.azureml.subscription_id {az.subscription_id!r} is not a subscription id (a GUID "
                          "like 00000000-0000-0000-0000-000000000000); see `az account show --query id`.")


def build_job(spec: JobSpec, name: str, code_dir: str, ckpt_uri: str):
    """The azure-ai-ml command job for the spec (no network).

    Returns:
        (job, notes)
    """
    ml = _sdk()
    from azure.ai.ml.entities import Environment

    az, b, res = spec.backend.azureml, spec.backend, spec.resources
    notes = []
    vm_size = instances.azure_vm_size(res.gpu, res.gpus_per_node, res.nodes)  # refuses shapes Azure lacks
    if az.environment:
        environment = az.environment if az.environment.startswith("azureml:") else f"azureml:{az.environment}"
    elif az.image:
        environment = Environment(image=az.image, name=f"workbench-{spec.name}"[:254])
    else:
        img = instances.azure_environment()
        environment, notes = img.uri, ([img.note] if img.note else [])
    extra = {}
    if az.compute:
        extra["compute"] = az.compute
        notes.append(f"compute cluster {az.compute!r} decides the VM size; {vm_size} has "
                     f"{res.gpus_per_node} x {res.gpu} as the spec asks.")
        if b.spot:
            notes.append("on a compute cluster, spot capacity comes from the cluster's tier (create it with "
                         "tier: low_priority); queue_settings.job_tier applies to serverless compute.")
    else:
        extra["instance_type"] = vm_size  # serverless compute
    if b.spot:
        extra["job_tier"] = "Spot"
        notes.append(f"Azure ML has no total-wait limit: backend.max_wait_s ({b.max_wait_s}) is not sent.")
    job = ml.command(
        name=name, display_name=spec.name, experiment_name="workbench", code=code_dir, command=COMMAND,
        environment=environment, instance_count=res.nodes,
        distribution=ml.PyTorchDistribution(process_count_per_instance=res.gpus_per_node),
        outputs={"checkpoints": ml.Output(type="uri_folder", mode="rw_mount", path=ckpt_uri)},
        environment_variables={"WORKBENCH_CLOUD": "azureml", "WORKBENCH_JOB": name},
        timeout=b.max_runtime_s, shm_size=SHM_SIZE, tags={"workbench": "true", "workbench-job": spec.name}, **extra)
    return job, notes


class AzureMLBackend:
    """Submit a JobSpec as an Azure ML command job."""

    name = "azureml"

    def __init__(self, credential=None, root=None):
        self._credential = credential  # default: azure.identity.DefaultAzureCredential()
        self._root = root

    def _prepare(self, spec: JobSpec):
        check(spec)
        ckpt, note = checkpoint_uri(spec, "azureml://", DEFAULT_DATASTORE, "Azure ML")
        run_spec = spec.replace(**{"checkpoint.uri": ckpt})
        return run_spec, ckpt, job_name(spec, max_len=100), [note] if note else []

    def dry_run(self, spec: JobSpec) -> dict:
        """The REST body of the job PUT; no credentials, no network."""
        run_spec, ckpt, name, notes = self._prepare(spec)
        bundle = build_bundle(run_spec, self._root)
        job, more = build_job(run_spec, name, CODE_PLACEHOLDER, ckpt)
        body = job._to_job()._to_rest_object().as_dict()
        az = spec.backend.azureml
        url = (f"https://management.azure.com/subscriptions/{az.subscription_id}/resourceGroups/{az.resource_group}"
               f"/providers/Microsoft.MachineLearningServices/workspaces/{az.workspace}/jobs/{name}")
        return {"operation": "PUT job", "endpoint": url, "body": body,
                "code": {"upload": "workspace code asset (workspaceblobstore)", "sha256": sha256(bundle.tar_gz()),
                         **bundle.summary()},
                "notes": notes + more}

    def submit(self, spec: JobSpec) -> AzureMLJob:
        """Upload the bundle as a code asset and create the job in the workspace."""
        ml = _sdk()
        run_spec, ckpt, name, _ = self._prepare(spec)
        az = spec.backend.azureml
        credential = self._credential
        if credential is None:
            from azure.identity import DefaultAzureCredential

            credential = DefaultAzureCredential()
        client = ml.MLClient(credential, az.subscription_id, az.resource_group, az.workspace,
                             enable_telemetry=False, show_progress=False)
        with tempfile.TemporaryDirectory(prefix="workbench-bundle-") as tmp:
            code_dir = build_bundle(run_spec, self._root).write_dir(Path(tmp) / "code")
            job, _ = build_job(run_spec, name, str(code_dir), ckpt)
            created = client.jobs.create_or_update(job)
        return AzureMLJob(client, created.name)


def map_status(status: str, has_run: bool) -> JobState:
    """An Azure ML job status -> JobState. A low-priority node taken back sends a running job back to
    Queued/Preparing: seen after running, that is a restart."""
    if status in _PENDING:
        return JobState.RESTARTING if has_run else JobState.PENDING
    return _STATES.get(status, JobState.PENDING)


class AzureMLJob:
    """A submitted Azure ML job: poll, cancel; interruptions counted from running -> queued again."""

    def __init__(self, client, name: str):
        self.job_id = name
        self._client = client
        self._has_run = False
        self._last = None
        self._interruptions = 0

    def status(self) -> JobStatus:
        job = self._client.jobs.get(self.job_id)
        state = map_status(job.status, self._has_run)
        if state is JobState.RESTARTING and self._last is JobState.RUNNING:
            self._interruptions += 1
        self._has_run |= state is JobState.RUNNING
        self._last = state
        return JobStatus(state, "", self._interruptions, {"status": job.status, "studio_url": job.studio_url})

    def logs(self, tail: int = 100) -> str:
        job = self._client.jobs.get(self.job_id)
        return f"Azure ML job logs: {job.studio_url} (or `az ml job stream --name {self.job_id}`)"

    def cancel(self) -> None:
        self._client.jobs.begin_cancel(self.job_id)

    def wait(self, timeout_s: float | None = None, poll_s: float = 30.0) -> JobStatus:
        return poll_until_done(self.status, timeout_s, poll_s)
