"""SageMaker backend: one CreateTrainingJob on the PyTorch DLC, managed spot, S3 checkpoints.

Raw boto3, not the SageMaker Python SDK: CreateTrainingJob is one call whose every field we set
ourselves, and boto3 is ~15 MB against ~450 MB for sagemaker-core. The container contract we rely
on is script mode's smallest one: `sagemaker_program` and `sagemaker_submit_directory`, with no
distribution flag, so the DLC's toolkit starts our entrypoint once per instance (its ProcessRunner).
Our entrypoint then starts torchrun itself with the spec's ranks per node (the DLC's own torchrun
launcher takes its process count from the GPU count, 0 on CPU instances, and exits 1 when a rank
exits 75), restarts a crashed rank group per `backend.max_failures` and exits 75 after a
preemption. Credentials come from boto3's standard chain (env, profile, SSO, instance role).
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

from backends import instances
from backends.base import CloudAccessError, JobState, JobStatus, access_errors, first_line, poll_until_done
from backends.bundle import SPEC_FILE, build_bundle, checkpoint_uri, job_name, sha256, slug
from workbench.errors import ConfigError
from workbench.validate import check_runnable

if TYPE_CHECKING:
    from workbench.spec import JobSpec

LOCAL_CHECKPOINTS = "/opt/ml/checkpoints"  # SageMaker syncs this folder with CheckpointConfig.S3Uri
ENTRY_SCRIPT = "workbench/cloud_entry.py"
MAX_RUNTIME_S = 28 * 24 * 3600  # the service's upper limit
SERVICE_RETRIES = 3  # RetryStrategy: SageMaker retries only its own InternalServerError, never a crashed rank
VOLUME_GB = 100

_PENDING = {"Starting", "Pending", "LaunchingMLInstances", "PreparingTrainingStack", "DownloadingTrainingImage"}


def _sdk():
    try:
        import boto3
        import botocore
    except ImportError:
        raise ConfigError("the sagemaker backend needs boto3: pip install 'workbench[aws]'.") from None
    return boto3, botocore


def _bucket(spec: JobSpec) -> str:
    return (spec.backend.sagemaker.bucket or "").removeprefix("s3://").strip("/")


def check(spec: JobSpec) -> None:
    """SageMaker-specific rules, before anything is built or sent. Raises ConfigError."""
    check_runnable(spec, read_remote_data=False)  # what the job could not run is refused here, not after the machines start
    sm, b = spec.backend.sagemaker, spec.backend
    if not sm.role:
        raise ConfigError("backend.sagemaker.role is required: the IAM role ARN the training job runs as, e.g. "
                          "arn:aws:iam::123456789012:role/SageMakerTraining (it needs read/write on the bucket).")
    if not sm.role.startswith("arn:aws") or ":role/" not in sm.role:
        raise ConfigError(f"backend.sagemaker.role {sm.role!r} is not an IAM role ARN. Use the form "
                          "arn:aws:iam::<12-digit account>:role/<name>.")
    if not _bucket(spec):
        raise ConfigError("backend.sagemaker.bucket is required: the S3 bucket for the code bundle, checkpoints "
                          "and outputs, e.g. bucket: my-training-bucket (in the job's region).")
    instances.check_region("sagemaker", sm.region)
    if b.max_runtime_s > MAX_RUNTIME_S:
        raise ConfigError(f"backend.max_runtime_s({b.max_runtime_s}) exceeds SageMaker's limit of {MAX_RUNTIME_S} s "
                          "(28 days). Lower it; spot jobs resume from checkpoints in a new job.")
    if sm.instance_type and not sm.instance_type.startswith("ml."):
        raise ConfigError(f"backend.sagemaker.instance_type {sm.instance_type!r}: SageMaker instance types start "
                          "with 'ml.', e.g. ml.p5.48xlarge.")


def build_request(spec: JobSpec, name: str, code_uri: str, ckpt_uri: str) -> tuple[dict, list[str]]:
    """CreateTrainingJob parameters for the spec (pure: no SDK, no network).

    Returns:
        (params, notes): notes explain defaults a reviewer should know about.
    """
    sm, b, res = spec.backend.sagemaker, spec.backend, spec.resources
    notes = []
    instance = sm.instance_type or instances.sagemaker_instance(res.gpu, res.gpus_per_node, res.nodes)
    if sm.image:
        image = sm.image
    else:
        img = instances.sagemaker_image(sm.region, res.gpu)
        image = img.uri
        notes += [img.note] if img.note else []
    prefix = f"s3://{_bucket(spec)}/workbench/{slug(spec.name)}"
    stopping = {"MaxRuntimeInSeconds": b.max_runtime_s}
    if b.spot:
        stopping["MaxWaitTimeInSeconds"] = b.max_wait_s
    params = {
        "TrainingJobName": name,
        "RoleArn": sm.role,
        "AlgorithmSpecification": {"TrainingImage": image, "TrainingInputMode": "File"},
        # Script mode of the PyTorch DLC: it downloads sagemaker_submit_directory, pip-installs its
        # requirements.txt and runs `python workbench/cloud_entry.py --spec workbench_job.json` once
        # on every instance (no distribution flag); the entrypoint starts this node's ranks itself.
        "HyperParameters": {
            "sagemaker_program": json.dumps(ENTRY_SCRIPT),
            "sagemaker_submit_directory": json.dumps(code_uri),
            "sagemaker_region": json.dumps(sm.region),
            "spec": json.dumps(SPEC_FILE),
        },
        "OutputDataConfig": {"S3OutputPath": f"{prefix}/output/"},
        "ResourceConfig": {"InstanceType": instance, "InstanceCount": res.nodes, "VolumeSizeInGB": VOLUME_GB},
        "StoppingCondition": stopping,
        "EnableManagedSpotTraining": b.spot,
        # The trailing '/' matters: without it the prefix also matches sibling runs' folders, which
        # SageMaker would sync into /opt/ml/checkpoints on restart.
        "CheckpointConfig": {"S3Uri": ckpt_uri, "LocalPath": LOCAL_CHECKPOINTS},
        "RetryStrategy": {"MaximumRetryAttempts": SERVICE_RETRIES},
        "Environment": {"WORKBENCH_CLOUD": "sagemaker", "WORKBENCH_JOB": name},
        "Tags": [{"Key": "workbench", "Value": "true"}, {"Key": "workbench-job", "Value": spec.name}],
    }
    return params, notes


class SageMakerBackend:
    """Submit a JobSpec as a SageMaker training job."""

    name = "sagemaker"

    def __init__(self, session=None, root=None):
        self._session = session  # a boto3.Session; default: the standard credential chain
        self._root = root  # project directory to bundle; default: the current directory

    def _prepare(self, spec: JobSpec):
        check(spec)
        ckpt, note = checkpoint_uri(spec, "s3://", f"s3://{_bucket(spec)}", "SageMaker")
        run_spec = spec.replace(**{"checkpoint.uri": ckpt})
        name = job_name(spec)
        code_key = f"workbench/{slug(spec.name)}/{name}/source/sourcedir.tar.gz"
        code_uri = f"s3://{_bucket(spec)}/{code_key}"
        params, notes = build_request(run_spec, name, code_uri, ckpt)
        return run_spec, params, code_key, notes + ([note] if note else [])

    def dry_run(self, spec: JobSpec) -> dict:
        """The validated, serialized CreateTrainingJob request; no credentials, no network."""
        _, botocore = _sdk()
        from botocore.awsrequest import AWSResponse
        from botocore.config import Config

        run_spec, params, code_key, notes = self._prepare(spec)
        # UNSIGNED: botocore never looks for credentials; before-call fires after validation and
        # serialization, and answering it skips the HTTP send.
        client = botocore.session.Session().create_client(
            "sagemaker", region_name=spec.backend.sagemaker.region,
            config=Config(signature_version=botocore.UNSIGNED))
        captured = {}

        def capture(params, model, **kw):
            captured.update(url=params["url"], target=params["headers"].get("X-Amz-Target"),
                            body=json.loads(params["body"]))
            return AWSResponse(params["url"], 200, {}, None), {"TrainingJobArn": "arn:dry-run"}

        client.meta.events.register("before-call.sagemaker.CreateTrainingJob", capture)
        client.create_training_job(**params)
        bundle = build_bundle(run_spec, self._root)
        data = bundle.tar_gz()
        code = {"upload": f"s3://{_bucket(spec)}/{code_key}", "sha256": sha256(data), **bundle.summary()}
        return {"operation": "CreateTrainingJob", "endpoint": captured["url"], "target": captured["target"],
                "body": captured["body"], "code": code, "notes": notes}

    def submit(self, spec: JobSpec) -> SageMakerJob:
        """Upload the code bundle to S3 and create the training job.

        Raises:
            ConfigError: invalid spec, the aws extra missing, or a request AWS refused (no such bucket...).
            CloudAccessError: no usable credentials (exit_code 77) or AWS unreachable (69).
        """
        boto3, _ = _sdk()
        run_spec, params, code_key, _ = self._prepare(spec)
        data = build_bundle(run_spec, self._root).tar_gz()
        with access_errors(_access_error):  # credentials are first looked for here, then used
            session = self._session or boto3.Session(region_name=spec.backend.sagemaker.region)
            session.client("s3").put_object(Bucket=_bucket(spec), Key=code_key, Body=data)
            client = session.client("sagemaker")
            client.create_training_job(**params)
        return SageMakerJob(client, params["TrainingJobName"], session)


# ClientError codes that mean the credentials in use are wrong, expired or lack a permission.
_AUTH_CODES = {"InvalidClientTokenId", "UnrecognizedClientException", "ExpiredToken", "ExpiredTokenException",
               "SignatureDoesNotMatch", "InvalidAccessKeyId", "InvalidToken", "RequestExpired", "AuthFailure",
               "AccessDenied", "AccessDeniedException"}
_LOGIN = "Run `aws sso login` (or `aws configure`), or set AWS_PROFILE to a profile that can, then dispatch again."


def _access_error(e: Exception) -> Exception | None:
    """botocore's credential, connection and service errors -> one line (see backends/base.py)."""
    from botocore import exceptions as bx

    if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError, bx.CredentialRetrievalError,
                      bx.TokenRetrievalError, bx.SSOError, bx.ProfileNotFound)):
        return CloudAccessError.no_credentials(
            f"sagemaker: no usable AWS credentials ({first_line(e)}; boto3 looks in the environment, ~/.aws, SSO "
            f"and the instance role). {_LOGIN}")
    if isinstance(e, (bx.ConnectionError, bx.HTTPClientError)):
        return CloudAccessError.unreachable(
            f"sagemaker: cannot reach AWS ({first_line(e)}). Check the network or proxy (HTTPS_PROXY) and "
            "backend.sagemaker.region, then dispatch again.")
    if isinstance(e, bx.ClientError):
        error = e.response.get("Error", {})
        code = error.get("Code", "?")
        what = f"{e.operation_name}: {code}: {error.get('Message', '')}".strip()
        if code in _AUTH_CODES or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (401, 403):
            return CloudAccessError.no_credentials(
                f"sagemaker: AWS refused the credentials in use ({what}). They are wrong, expired or lack the "
                f"permission: {_LOGIN}")
        return ConfigError(f"sagemaker: AWS refused the request ({what}). Fix the setting it names "
                           "(backend.sagemaker.*) and dispatch again.")
    return None


def map_status(desc: dict) -> JobStatus:
    """DescribeTrainingJob -> JobStatus (SecondaryStatus carries the spot lifecycle)."""
    primary, secondary = desc.get("TrainingJobStatus"), desc.get("SecondaryStatus", "")
    if primary == "Completed":
        state = JobState.COMPLETED
    elif primary == "Failed":
        state = JobState.FAILED
    elif primary == "Stopped":
        state = JobState.STOPPED
    elif secondary == "Interrupted":
        state = JobState.INTERRUPTED
    elif secondary == "Restarting":
        state = JobState.RESTARTING
    elif secondary in _PENDING:
        state = JobState.PENDING
    else:
        state = JobState.RUNNING
    transitions = desc.get("SecondaryStatusTransitions") or []
    interruptions = sum(1 for t in transitions if t.get("Status") == "Interrupted")
    message = desc.get("FailureReason") or desc.get("StatusMessage") or (transitions[-1].get("StatusMessage", "")
                                                                         if transitions else "")
    raw = {k: desc.get(k) for k in ("TrainingJobStatus", "SecondaryStatus", "BillableTimeInSeconds",
                                     "TrainingTimeInSeconds") if k in desc}
    return JobStatus(state, message, interruptions, raw)


class SageMakerJob:
    """A submitted training job: poll DescribeTrainingJob, read CloudWatch logs, stop it."""

    def __init__(self, client, name: str, session=None):
        self.job_id = name
        self._client, self._session = client, session
        self._seen_interruptions = 0
        self._last_secondary = None

    def status(self) -> JobStatus:
        status = map_status(self._client.describe_training_job(TrainingJobName=self.job_id))
        # Count Interrupted phases we saw ourselves too: short polls may miss the transitions list.
        secondary = status.raw.get("SecondaryStatus")
        if secondary == "Interrupted" and self._last_secondary != "Interrupted":
            self._seen_interruptions += 1
        self._last_secondary = secondary
        status.interruptions = max(status.interruptions, self._seen_interruptions)
        return status

    def logs(self, tail: int = 100) -> str:
        logs = self._session.client("logs") if self._session else None
        if logs is None:
            return ""
        from botocore.exceptions import ClientError

        group = "/aws/sagemaker/TrainingJobs"
        try:
            streams = logs.describe_log_streams(logGroupName=group, logStreamNamePrefix=f"{self.job_id}/")
        except ClientError:  # no log group yet: the job has not started
            return ""
        lines = []
        for stream in streams.get("logStreams", []):
            events = logs.get_log_events(logGroupName=group, logStreamName=stream["logStreamName"], limit=tail)
            lines += [e["message"] for e in events.get("events", [])]
        return "\n".join(lines[-tail:])

    def cancel(self) -> None:
        self._client.stop_training_job(TrainingJobName=self.job_id)

    def wait(self, timeout_s: float | None = None, poll_s: float = 30.0) -> JobStatus:
        return poll_until_done(self.status, timeout_s, poll_s)
