"""Azure ML backend: a command job with PyTorch distribution, Spot tier and a read-write mounted
output folder for checkpoints, on a curated ACPT PyTorch environment (or the user's).

azure-ai-ml builds the job and uploads the code bundle as a code asset; credentials come from
azure-identity's DefaultAzureCredential (environment, workload/managed identity, Azure CLI login).

Azure ML does not restart a preempted job (on a compute cluster "you have to restart a preempted
job"): the handle's `wait()` is the supervisor that does. A spot job (or one with
`backend.max_failures`) that ends Failed after it ran is resubmitted as `<name>-r<k>`, with the same
checkpoint output and run id, so the new job's entrypoint resumes from the newest complete
checkpoint; `python -m backends.azureml watch SPEC JOB` does the same for a job submitted earlier.
"""
from __future__ import annotations

import logging
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from backends import instances
from backends.base import CloudAccessError, JobState, JobStatus, access_errors, first_line, poll_until_done
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
DEFAULT_RESUBMITS = 3  # a spot job's resubmissions when backend.max_failures is 0
# What MLClient adds to the PUT at submit, that no dry-run can know in advance.
FILLED_AT_SUBMIT = {"properties.codeId": "the ARM id of the code asset MLClient creates when it uploads the bundle "
                                         "(a new random name, version 1)"}
_URL_PASSWORD = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://[^/@:]*:)[^/@]*@")  # the password of a URL's user part
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
    check_runnable(spec, read_remote_data=False)  # what the job could not run is refused here, not after the machines start
    az = spec.backend.azureml
    for field, example in (("subscription_id", "00000000-0000-0000-0000-000000000000"),
                           ("resource_group", "my-rg"), ("workspace", "my-workspace")):
        if not getattr(az, field):
            raise ConfigError(f"backend.azureml.{field} is required to find the workspace, e.g. {field}: {example} "
                              "(see `az ml workspace show`).")
    if not re.fullmatch(r"[0-9a-fA-F]{8}-([0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}", az.subscription_id):
        raise ConfigError(f"backend.azureml.subscription_id {az.subscription_id!r} is not a subscription id (a GUID "
                          "like 00000000-0000-0000-0000-000000000000); see `az account show --query id`.")


def build_job(spec: JobSpec, name: str, code_dir: str, ckpt_uri: str, run_id: str | None = None):
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
        # The ARM id MLClient would turn the short name into at submit: the dry-run shows what is sent.
        extra["compute"] = az.compute if az.compute.startswith("/subscriptions/") else (
            f"/subscriptions/{az.subscription_id}/resourceGroups/{az.resource_group}/providers/"
            f"Microsoft.MachineLearningServices/workspaces/{az.workspace}/computes/{az.compute}")
        notes.append(f"compute cluster {az.compute!r} decides the VM size; {vm_size} has "
                     f"{res.gpus_per_node} x {res.gpu} as the spec asks.")
        if b.spot:
            notes.append(f"on a compute cluster, spot capacity comes from the cluster's tier: create "
                         f"{az.compute!r} with tier: low_priority (no job tier is sent; Azure documents job_tier "
                         "Spot for serverless compute). A preempted job is not restarted by Azure: wait() "
                         "resubmits it.")
    else:
        extra["instance_type"] = vm_size  # serverless compute
        if b.spot:
            extra["job_tier"] = "Spot"
            notes.append("serverless spot (queue_settings.job_tier: Spot); a job that ends Failed after a "
                         "preemption is resubmitted by wait().")
    if b.spot:
        notes.append(f"Azure ML has no total-wait limit: backend.max_wait_s ({b.max_wait_s}) is not sent.")
    job = ml.command(
        name=name, display_name=spec.name, experiment_name="workbench", code=code_dir, command=COMMAND,
        environment=environment, instance_count=res.nodes,
        distribution=ml.PyTorchDistribution(process_count_per_instance=res.gpus_per_node),
        outputs={"checkpoints": ml.Output(type="uri_folder", mode="rw_mount", path=ckpt_uri)},
        # WORKBENCH_RUN_ID: the run's resubmissions are one run for the checkpoint lease (a preempted
        # job's lease is this run's, not another writer's).
        environment_variables={"WORKBENCH_CLOUD": "azureml", "WORKBENCH_JOB": name,
                               "WORKBENCH_RUN_ID": run_id or name},
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
        """The REST body of the job PUT, as MLClient sends it (the compute's ARM id, the git properties
        it adds); the one field only the upload decides is left out and named in `filled_at_submit`.
        No credentials, no network."""
        run_spec, ckpt, name, notes = self._prepare(spec)
        bundle = build_bundle(run_spec, self._root)
        with tempfile.TemporaryDirectory(prefix="workbench-bundle-") as tmp:
            job, more = build_job(run_spec, name, tmp, ckpt)
            body = job._to_job()._to_rest_object().as_dict()
        body.pop("name", None)  # the name travels in the URL
        body["properties"].pop("codeId", None)
        git, git_notes = _git_properties()
        body["properties"].setdefault("properties", {}).update(git)
        az = spec.backend.azureml
        url = (f"https://management.azure.com/subscriptions/{az.subscription_id}/resourceGroups/{az.resource_group}"
               f"/providers/Microsoft.MachineLearningServices/workspaces/{az.workspace}/jobs/{name}")
        return {"operation": "PUT job", "endpoint": url, "body": body, "filled_at_submit": dict(FILLED_AT_SUBMIT),
                "code": {"upload": "workspace code asset (workspaceblobstore)", "sha256": sha256(bundle.tar_gz()),
                         **bundle.summary()},
                "notes": notes + more + git_notes}

    def client(self, spec: JobSpec):
        ml = _sdk()
        az = spec.backend.azureml
        credential = self._credential
        if credential is None:
            from azure.identity import DefaultAzureCredential

            # Its warning lists every source it tried, over ~10 lines: a failed submit says it in one
            # (_access_error), and the full message stays on the CloudAccessError's cause.
            logging.getLogger("azure.identity").setLevel(logging.ERROR)
            credential = DefaultAzureCredential()
        return ml.MLClient(credential, az.subscription_id, az.resource_group, az.workspace,
                           enable_telemetry=False, show_progress=False)

    def submit(self, spec: JobSpec, name: str | None = None, run_id: str | None = None,
               client=None) -> AzureMLJob:
        """Upload the bundle as a code asset and create the job in the workspace.

        Args:
            name: the job's name (default: a new one from the spec's name and the time).
            run_id: the run this job continues (a resubmission): its checkpoint lease is this run's.
        Raises:
            ConfigError: invalid spec, or a request Azure refused (no such workspace, a bad field).
            CloudAccessError: no usable credentials (exit_code 77) or Azure unreachable (69).
        """
        run_spec, ckpt, default, _ = self._prepare(spec)
        name = name or default
        with tempfile.TemporaryDirectory(prefix="workbench-bundle-") as tmp:
            code_dir = build_bundle(run_spec, self._root).write_dir(Path(tmp) / "code")
            job, _ = build_job(run_spec, name, str(code_dir), ckpt, run_id=run_id or name)
            with access_errors(_access_error):  # the first token is asked for when the code is uploaded
                client = client or self.client(spec)
                created = client.jobs.create_or_update(job)
        return AzureMLJob(client, created.name, spec=spec, backend=self, run_id=run_id or name)


def _git_properties() -> tuple[dict, list[str]]:
    """The git properties MLClient adds to every job it creates (from the current directory), with
    MLClient's own rule applied: `JobOperations.create_or_update` drops the repository URL, branch,
    commit and dirty flag when `has_pat_token(url)` (an `https://token@...` remote), so the dry-run
    neither shows that token nor differs from the real PUT. A password the rule misses (in the user
    part of an http:// remote, which MLClient does send) is masked here and named in a note.

    Returns:
        (properties, notes)
    """
    try:
        from azure.ai.ml.constants._common import GitProperties
        from azure.ai.ml.operations._job_ops_helper import get_git_properties, has_pat_token
    except ImportError:  # another SDK layout: the dry-run then lacks them
        return {}, []
    props = get_git_properties()
    url_key = GitProperties.PROP_MLFLOW_GIT_REPO_URL
    if has_pat_token(props.get(url_key)):
        for key in (url_key, GitProperties.PROP_MLFLOW_GIT_BRANCH, GitProperties.PROP_MLFLOW_GIT_COMMIT,
                    GitProperties.PROP_DIRTY):
            props.pop(key, None)
        return props, ["the git remote URL carries a token, so MLClient sends no git properties (repository, "
                       "branch, commit); `git remote set-url origin <url without the token>` brings them back."]
    masked = _URL_PASSWORD.sub(r"\1***@", props.get(url_key) or "")
    if masked != (props.get(url_key) or ""):
        props[url_key] = masked
        return props, [f"the git remote URL carries a password, which MLClient sends in {url_key} (shown masked "
                       "here): `git remote set-url origin <url without it>` before you submit."]
    return props, []


_LOGIN = ("Run `az login` (or set AZURE_TENANT_ID, AZURE_CLIENT_ID and AZURE_CLIENT_SECRET for a service "
          "principal), then dispatch again.")


def _access_error(e: Exception) -> Exception | None:
    """azure-core's credential, connection and service errors -> one line (see backends/base.py).
    DefaultAzureCredential's own message lists every source it tried, over many lines: only the
    first one is kept."""
    from azure.core import exceptions as az

    if isinstance(e, az.ClientAuthenticationError):  # CredentialUnavailableError too
        return CloudAccessError.no_credentials(
            f"azureml: no Azure token ({first_line(e)}; DefaultAzureCredential tries the environment, workload "
            "and managed identity, then the Azure CLI; a source it cannot reach, login.microsoftonline.com "
            f"included, also fails). {_LOGIN}")
    if isinstance(e, (az.ServiceRequestError, az.ServiceResponseError)):
        return CloudAccessError.unreachable(
            f"azureml: cannot reach Azure ({first_line(e)}). Check the network or proxy (HTTPS_PROXY), then "
            "dispatch again.")
    if isinstance(e, az.HttpResponseError):
        if e.status_code in (401, 403):
            return CloudAccessError.no_credentials(
                f"azureml: Azure refused the credentials in use ({first_line(e)}). They are wrong, expired or "
                f"lack a role on the workspace: {_LOGIN}")
        return ConfigError(f"azureml: Azure refused the request ({first_line(e)}). Fix the setting it names "
                           "(backend.azureml.*) and dispatch again.")
    return None


def resubmits_allowed(spec: JobSpec) -> int:
    """How many times the supervisor resubmits: backend.max_failures, else DEFAULT_RESUBMITS for spot."""
    if spec.backend.max_failures:
        return spec.backend.max_failures
    return DEFAULT_RESUBMITS if spec.backend.spot else 0


def map_status(status: str, has_run: bool) -> JobState:
    """An Azure ML job status -> JobState. A low-priority node taken back sends a running job back to
    Queued/Preparing: seen after running, that is a restart."""
    if status in _PENDING:
        return JobState.RESTARTING if has_run else JobState.PENDING
    return _STATES.get(status, JobState.PENDING)


class AzureMLJob:
    """A submitted Azure ML job: poll, cancel; interruptions counted from running -> queued again.

    With `spec` and `backend` (what submit() gives), `wait()` also supervises: Azure ML does not
    restart a preempted job, so a job that ends Failed after it ran is resubmitted (`resubmit()`),
    up to `resubmits_allowed(spec)` times; `job_id` then names the newest job and `jobs` all of them.
    A job that fails before it ever ran (a bad environment, quota) is not resubmitted, nor one that
    was canceled.
    """

    def __init__(self, client, name: str, spec: JobSpec | None = None, backend: AzureMLBackend | None = None,
                 run_id: str | None = None):
        self.job_id = name
        self.jobs = [name]
        self._client, self._spec, self._backend = client, spec, backend
        self.run_id = run_id or name
        self._has_run = False
        self._last = None
        self._interruptions = 0
        self._canceled = False

    def status(self) -> JobStatus:
        job = self._client.jobs.get(self.job_id)
        state = map_status(job.status, self._has_run)
        if state is JobState.RESTARTING and self._last is JobState.RUNNING:
            self._interruptions += 1
        self._has_run |= state is JobState.RUNNING
        self._last = state
        return JobStatus(state, "", self._interruptions, {"status": job.status, "studio_url": job.studio_url,
                                                          "jobs": list(self.jobs)})

    def should_resubmit(self, status: JobStatus) -> bool:
        """A failed job that ran, of a spec that may be resubmitted, with resubmissions left."""
        return (status.state is JobState.FAILED and self._has_run and not self._canceled
                and self._spec is not None and self._backend is not None
                and len(self.jobs) - 1 < resubmits_allowed(self._spec))

    def resubmit(self) -> None:
        """Submit the spec again as `<run id>-r<k>`: the same checkpoint output, the same run for the
        lease; its entrypoint resumes from the newest complete checkpoint."""
        assert self._spec is not None and self._backend is not None
        name = f"{self.run_id}-r{len(self.jobs)}"[:100]
        new = self._backend.submit(self._spec, name=name, run_id=self.run_id, client=self._client)
        self.job_id = new.job_id
        self.jobs.append(new.job_id)
        self._interruptions += 1
        self._has_run, self._last = False, None

    def logs(self, tail: int = 100) -> str:
        job = self._client.jobs.get(self.job_id)
        return f"Azure ML job logs: {job.studio_url} (or `az ml job stream --name {self.job_id}`)"

    def cancel(self) -> None:
        self._canceled = True
        self._client.jobs.begin_cancel(self.job_id)

    def wait(self, timeout_s: float | None = None, poll_s: float = 30.0) -> JobStatus:
        """Follow the job to its end, resubmitting it after a failure (see the class)."""
        import time

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            status = poll_until_done(self.status, left, poll_s)
            if not self.should_resubmit(status):
                return status
            assert self._spec is not None
            print(f"workbench: Azure ML job {self.job_id} failed after it ran (a preemption: Azure does not "
                  f"restart it); resubmitting, {len(self.jobs)} of {resubmits_allowed(self._spec)}", flush=True)
            self.resubmit()


def main(argv: list[str] | None = None) -> int:
    """`python -m backends.azureml watch SPEC JOB`: supervise a job submitted earlier, resubmitting it
    after a preemption until it completes; exit 0 when it did, 1 otherwise."""
    import argparse

    from workbench.spec import load_spec

    p = argparse.ArgumentParser(prog="python -m backends.azureml")
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("watch", help="follow JOB, resubmitting it after a preemption")
    w.add_argument("spec")
    w.add_argument("job")
    w.add_argument("--poll-s", type=float, default=30.0)
    args = p.parse_args(argv)
    spec = load_spec(args.spec)
    backend = AzureMLBackend()
    handle = AzureMLJob(backend.client(spec), args.job, spec=spec, backend=backend,
                        run_id=args.job.rsplit("-r", 1)[0] if re.search(r"-r\d+$", args.job) else args.job)
    status = handle.wait(poll_s=args.poll_s)
    print(f"workbench: {handle.job_id}: {status.state.value} (jobs: {', '.join(handle.jobs)})")
    return 0 if status.state is JobState.COMPLETED else 1


if __name__ == "__main__":
    import sys

    try:
        sys.exit(main())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
