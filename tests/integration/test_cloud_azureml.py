"""Azure ML backend through MLClient, its HTTP traffic intercepted by `responses`: the SDK uploads the
bundle as a code asset (pending-upload SAS, blob PUTs) and PUTs the job; the test reads both back."""
from __future__ import annotations

import json
import re
import time

import pytest

pytest.importorskip("azure.ai.ml")
responses = pytest.importorskip("responses")

from backends.azureml import AzureMLBackend, map_status  # noqa: E402
from backends.base import JobState  # noqa: E402
from workbench.errors import ConfigError  # noqa: E402
from workbench.spec import load_spec  # noqa: E402

pytestmark = [pytest.mark.cloud, pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore:The `context` parameter is deprecated")]  # azure-ai-ml vs marshmallow

FAKE_TOKEN = "wbFakeAzureToken-" + "DoNotLeak" * 3
BLOB = "https://wbfakeacct.blob.core.windows.net/wb-container/LocalUpload/up1"


class FakeCredential:
    """azure.core TokenCredential: the token only ever goes into Authorization headers."""

    def get_token(self, *scopes, **kwargs):
        from azure.core.credentials import AccessToken

        return AccessToken(FAKE_TOKEN, int(time.time()) + 3600)


class FakeWorkspace:
    """Answers the calls MLClient makes for a code upload and a job PUT/GET; keeps what it got."""

    def __init__(self):
        self.blobs, self.jobs, self.codes = {}, {}, {}
        self.statuses = iter(["Queued", "Running", "Queued", "Running", "Completed"])

    def __call__(self, request):
        url, path = request.url.split("?")[0], request.path_url.split("?")[0]
        json_reply = lambda code, obj: (code, {"Content-Type": "application/json"}, json.dumps(obj))  # noqa: E731
        if "blob.core.windows.net" in url:
            if request.method == "PUT":
                if "comp=metadata" not in request.url:
                    self.blobs[url] = request.body if isinstance(request.body, bytes) else request.body.encode()
                return (200 if "comp=metadata" in request.url else 201,
                        {"ETag": '"0x1"', "Last-Modified": "Mon, 30 Nov 2026 00:00:00 GMT"}, "")
            return 404, {"x-ms-error-code": "BlobNotFound"}, ""
        if "/codes/" in path and request.method == "GET":
            return json_reply(200, {"value": []})  # no code asset with this hash yet: upload it
        if path.endswith("/startPendingUpload"):
            return json_reply(200, {"blobReferenceForConsumption": {
                "blobUri": BLOB, "storageAccountArmId": "/subscriptions/x/resourceGroups/rg/providers/"
                                                        "Microsoft.Storage/storageAccounts/wbfakeacct",
                "credential": {"credentialType": "SAS", "sasUri": BLOB + "?sv=2019-02-02&sig=fakesig"}},
                "pendingUploadId": "up1", "pendingUploadType": "TemporaryBlobReference"})
        if "/codes/" in path and request.method == "PUT":
            self.codes[path] = json.loads(request.body)
            return json_reply(201, dict(self.codes[path], id=path, name=path.rsplit("/", 1)[1]))
        if "/jobs/" in path and request.method == "PUT":
            body = json.loads(request.body)
            self.jobs[path] = dict(body, id=path, name=path.rsplit("/", 1)[1])
            self.jobs[path]["properties"]["status"] = "NotStarted"
            return json_reply(201, self.jobs[path])
        if "/jobs/" in path and request.method == "GET" and path in self.jobs:
            self.jobs[path]["properties"]["status"] = next(self.statuses)
            return json_reply(200, self.jobs[path])
        return json_reply(404, {"error": {"code": "NotFound", "message": f"not faked: {request.method} {path}"}})


def make_project(root):
    root.mkdir(parents=True)
    (root / "my_model.py").write_text("X = 1\n")
    (root / ".azure").mkdir()
    (root / ".azure" / "msal_token_cache.json").write_text(FAKE_TOKEN)
    (root / "conn.txt").write_text("DefaultEndpointsProtocol=https;AccountName=a;AccountKey=" + "wbFake7Kq2+/" * 7
                                   + "Zx==\n")  # a real key is 88 base64 characters
    return root


def test_submit_uploads_code_and_puts_spot_pytorch_job(tmp_path, capsys):
    fake = FakeWorkspace()
    spec = load_spec("examples/cloud-spot.yaml").replace(**{"backend.include": ["*"]})  # the whole project, filtered
    root = make_project(tmp_path / "proj")
    backend = AzureMLBackend(credential=FakeCredential(), root=root)
    with pytest.raises(ConfigError, match=r"conn.txt, line 1: Azure Storage Account access key"):
        backend.dry_run(spec)  # an account key found by its content stops the dispatch
    (root / "conn.txt").unlink()  # as its owner would
    dry = json.dumps(backend.dry_run(spec))
    with responses.RequestsMock(assert_all_requests_are_fired=False) as rsps:
        for method in (responses.GET, responses.PUT, responses.POST, responses.HEAD):
            rsps.add_callback(method, re.compile(r"https://.*"), callback=fake)
        handle = backend.submit(spec)
        states = [handle.status() for _ in range(5)]
        calls = [(c.request.method, c.request.url, dict(c.request.headers)) for c in rsps.calls]

    (path, job), = fake.jobs.items()
    assert path.endswith(f"/workspaces/fake-workspace/jobs/{handle.job_id}")
    props = job["properties"]
    assert "jobTier" not in (props.get("queueSettings") or {})  # a named cluster's tier decides (low_priority)
    assert props["distribution"] == {"distributionType": "PyTorch", "processCountPerInstance": 4}
    assert props["resources"]["instanceCount"] == 2
    assert props["outputs"]["checkpoints"] == {
        "uri": "azureml://datastores/workspaceblobstore/paths/workbench/cloud-spot/checkpoints/",
        "mode": "ReadWriteMount", "jobOutputType": "uri_folder"}
    assert "--checkpoint-dir ${{outputs.checkpoints}}" in props["command"]
    assert "python -m workbench.cloud_entry --spec workbench_job.json" in props["command"]
    assert props["environmentId"].startswith("azureml://registries/azureml/environments/acpt-pytorch-")
    assert props["computeId"].endswith("fake-t4-cluster")
    (code_path, code), = fake.codes.items()
    assert props["codeId"].startswith(code_path.rsplit("/versions", 1)[0])  # the job runs the uploaded code
    assert code["properties"]["codeUri"].startswith(BLOB)

    # What reached blob storage is the bundle: our entrypoint and the spec, no secrets.
    names = {url.split("/up1/", 1)[1].split("/", 1)[1] for url in fake.blobs}
    assert {"workbench/cloud_entry.py", "my_model.py", "workbench_job.json", "requirements.txt"} <= names
    assert not {".azure/msal_token_cache.json", "conn.txt"} & names
    assert all(FAKE_TOKEN.encode() not in data for data in fake.blobs.values())

    # The token went only to ARM, in Authorization headers, never to the SAS-signed blob URLs.
    for _method, url, headers in calls:
        if "blob.core.windows.net" in url:
            assert FAKE_TOKEN not in headers.get("Authorization", "")
    assert [s.state for s in states] == [JobState.PENDING, JobState.RUNNING, JobState.RESTARTING, JobState.RUNNING,
                                         JobState.COMPLETED]
    assert states[-1].interruptions == 1
    out = capsys.readouterr()
    assert FAKE_TOKEN not in dry + out.out + out.err


def test_serverless_spot_gets_vm_size_and_status_map():
    spec = load_spec("examples/cloud-spot.yaml").replace(**{"backend.azureml.compute": None})
    body = AzureMLBackend().dry_run(spec)["body"]["properties"]
    assert body["resources"]["instanceType"] == "Standard_NC64as_T4_v3"
    assert body["queueSettings"]["jobTier"] == "Spot"  # job_tier Spot: documented for serverless compute
    assert "computeId" not in body
    assert map_status("Queued", has_run=False) is JobState.PENDING
    assert map_status("Canceled", has_run=True) is JobState.STOPPED


class ResubmitWorkspace(FakeWorkspace):
    """Each job PUT gets its own status sequence: the first ends Failed after running (a preemption
    Azure does not restart), the resubmitted one completes."""

    def __init__(self, sequences):
        super().__init__()
        self.sequences, self.per_job = list(sequences), {}

    def __call__(self, request):
        path = request.path_url.split("?")[0]
        if "/jobs/" in path and request.method == "GET" and path in self.jobs:
            states = self.per_job.setdefault(path, iter(self.sequences[list(self.jobs).index(path)]))
            self.statuses = states
        return super().__call__(request)


def _put_bodies(fake):
    return [dict(job, properties={k: v for k, v in job["properties"].items() if k != "status"})
            for job in fake.jobs.values()]


def test_dry_run_is_the_put_and_a_preempted_job_is_resubmitted_until_it_completes(tmp_path):
    fake = ResubmitWorkspace([["Queued", "Running", "Failed"], ["Queued", "Running", "Completed"]])
    spec = load_spec("examples/cloud-spot.yaml")
    root = make_project(tmp_path / "proj")
    (root / "conn.txt").unlink()
    backend = AzureMLBackend(credential=FakeCredential(), root=root)
    dry = backend.dry_run(spec)
    with responses.RequestsMock(assert_all_requests_are_fired=False) as rsps:
        for method in (responses.GET, responses.PUT, responses.POST, responses.HEAD):
            rsps.add_callback(method, re.compile(r"https://.*"), callback=fake)
        handle = backend.submit(spec)
        final = handle.wait(poll_s=0)

    first, second = _put_bodies(fake)
    # The dry-run body is the PUT that was sent, but for the job's name (the time it was made) and the
    # one field named in filled_at_submit.
    assert set(dry["filled_at_submit"]) == {"properties.codeId"} and first["properties"]["codeId"]
    sent = json.loads(json.dumps(first["properties"]).replace(handle.jobs[0], "NAME"))
    shown = json.loads(json.dumps(dry["body"]["properties"]).replace(dry["endpoint"].rsplit("/", 1)[1], "NAME"))
    sent.pop("codeId")
    assert shown == sent
    assert final.state is JobState.COMPLETED and final.interruptions == 1
    assert handle.jobs == [handle.jobs[0], handle.jobs[0] + "-r1"] and handle.job_id == handle.jobs[1]
    # The resubmission writes to the same checkpoints, as the same run (the lease), and resumes there.
    assert second["properties"]["outputs"] == first["properties"]["outputs"]
    env1, env2 = first["properties"]["environmentVariables"], second["properties"]["environmentVariables"]
    assert env1["WORKBENCH_RUN_ID"] == env2["WORKBENCH_RUN_ID"] == handle.jobs[0]
    assert "--strict-resume" not in second["properties"]["command"]  # the entrypoint resumes or starts fresh


def test_a_job_that_never_ran_or_was_canceled_is_not_resubmitted(tmp_path):
    for sequence in (["Queued", "Failed"], ["Queued", "Running", "Canceled"]):
        fake = ResubmitWorkspace([sequence, ["Completed"]])
        root = make_project(tmp_path / f"p{len(sequence)}")
        (root / "conn.txt").unlink()
        backend = AzureMLBackend(credential=FakeCredential(), root=root)
        with responses.RequestsMock(assert_all_requests_are_fired=False) as rsps:
            for method in (responses.GET, responses.PUT, responses.POST, responses.HEAD):
                rsps.add_callback(method, re.compile(r"https://.*"), callback=fake)
            handle = backend.submit(load_spec("examples/cloud-spot.yaml"))
            final = handle.wait(poll_s=0)
        assert len(fake.jobs) == 1 and final.state in (JobState.FAILED, JobState.STOPPED)
