"""The code bundle: what travels to a remote job and what never does."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile

import pytest

from backends import bundle as B
from workbench.errors import ConfigError
from workbench.spec import load_spec


def _tree(root, files: dict):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_gitignore_rules_nested_negation_anchoring(tmp_path):
    root = _tree(tmp_path, {
        ".gitignore": "*.log\n/build/\nout/\n!keep.log\n**/cache\n",
        "a.py": "", "run.log": "", "keep.log": "", "build/x.py": "", "src/build/y.py": "",
        "src/out/z.py": "", "src/cache/c.bin": "", "src/.gitignore": "local_*.py\n", "src/local_tmp.py": "",
        "src/main.py": "", "other/local_tmp.py": "",
    })
    got = set(B.collect(root).files)
    assert got == {".gitignore", "a.py", "keep.log", "src/.gitignore", "src/build/y.py", "src/main.py",
                   "other/local_tmp.py"}


def test_git_venvs_caches_checkpoints_and_links_are_left_out_even_when_included(tmp_path):
    root = _tree(tmp_path, {"train.py": "", ".git/HEAD": "", "env1/pyvenv.cfg": "", "env1/lib/x.py": "",
                            "conda/conda-meta/history": "", "pkg/__pycache__/m.pyc": "", "checkpoints/s1": "",
                            "runs/ckpt/step1": "", "pkg.egg-info/PKG-INFO": "", ".aws/config": ""})
    os.symlink("/etc", tmp_path / "etc_link")
    spec = load_spec({"checkpoint": {"uri": "runs/ckpt"}, "backend": {"include": ["*", "**/*"]}})
    b = B.build_bundle(spec, root)
    shipped = {n for n in b.files}
    assert "train.py" in shipped
    for banned in (".git", "env1", "conda", "__pycache__", "checkpoints", "runs/ckpt", "egg-info", ".aws", "etc_link"):
        assert not any(banned in n for n in shipped), banned


def _project(root):
    """A project as people keep them: code, data, a notebook, and everything that must not travel."""
    key = {"type": "service_account", "project_id": "p", "private_key_id": "0123456789abcdef0123456789abcdef01234567",
           "client_email": "x@p.iam.gserviceaccount.com"}
    return _tree(root, {
        "my_model.py": "from helpers import WIDTH\n", "helpers.py": "WIDTH = 8\n", "corpus/tiny.txt": "hello world " * 200,
        "settings.env": "TOKEN=abc\n", "prod.env": "DB_PASSWORD=hunter2\n", "gcp.json": json.dumps(key),
        ".aws/credentials": "[default]\n", ".ssh/id_ed25519": "x", ".git/config": "[core]\n",
        "notebooks/explore.ipynb": "{}", "notebooks/scratch.py": "", "unrelated.py": "", "requirements.txt": "tqdm\n"})


def test_only_what_the_spec_names_travels(tmp_path):
    root = _project(tmp_path)
    spec = load_spec({"model": {"factory": "my_model:build", "vocab": 256, "seq_len": 16},
                      "data": {"source": "text", "path": "corpus/tiny.txt"}, "backend": {"include": ["helpers.py"]}})
    b = B.build_bundle(spec, root)
    project = {n for n in b.files if not n.startswith(("workbench/", "backends/"))}
    assert project == {"my_model.py", "helpers.py", "corpus/tiny.txt", "requirements.txt"}
    assert set(b.generated) == {B.SPEC_FILE}  # the project's requirements.txt, not the default one
    assert b.excluded_secrets == []  # nothing secret was even looked at
    with tarfile.open(fileobj=io.BytesIO(b.tar_gz())) as tar:
        blob = b"".join(tar.extractfile(m).read() for m in tar.getmembers())
    for planted in (b"hunter2", b"TOKEN=abc", b"0123456789abcdef0123456789abcdef01234567", b"[core]"):
        assert planted not in blob


def test_credential_files_are_left_out_by_name_and_refused_by_content(tmp_path):
    root = _project(tmp_path)
    spec = {"backend": {"include": ["*", "notebooks/**"]}}
    with pytest.raises(ConfigError, match=r"gcp.json, line 1: .*backend.secrets_allowlist") as err:
        B.build_bundle(load_spec(spec), root)  # a service-account key under a plain name: found by content
    assert "0123456789abcdef" not in str(err.value)  # the file, line and kind, never the value
    spec["backend"]["secrets_allowlist"] = ["gcp.json"]  # a false positive, shipped on purpose
    b = B.build_bundle(load_spec(spec), root)
    project = {n for n in b.files if not n.startswith(("workbench/", "backends/"))}
    assert sorted(b.excluded_secrets) == [".aws/credentials", ".ssh/id_ed25519", "prod.env", "settings.env"]
    assert not project & {"prod.env", "settings.env", ".aws/credentials", ".ssh/id_ed25519", ".git/config"}
    assert {"notebooks/explore.ipynb", "unrelated.py", "gcp.json"} <= project  # what you include travels


@pytest.mark.parametrize("raw,match", [
    ({"backend": {"include": ["src/*.py"]}}, r"backend.include 'src/\*.py' matches nothing under the project"),
    ({"data": {"source": "text", "path": "corpus/missing.txt"}}, r"data.path 'corpus/missing.txt': no such file or folder"),
    ({"data": {"source": "text", "path": "../outside.txt"}}, r"'../outside.txt' is outside the project directory"),
    ({"backend": {"include": ["../outside.txt"]}}, r"backend.include '../outside.txt': give globs relative to"),
    ({"backend": {"include": ["/etc/*"]}}, r"backend.include '/etc/\*': give globs relative to"),
])
def test_named_paths_that_cannot_travel_are_config_errors(tmp_path, raw, match):
    (tmp_path / "outside.txt").write_text("x" * 100)
    root = _project(tmp_path / "proj")
    with pytest.raises(ConfigError, match=match):
        B.build_bundle(load_spec(raw), root)


@pytest.mark.timeout(120)
def test_the_job_runs_from_the_bundle_alone(tmp_path):
    """Unpacked somewhere else and started as the clouds start it, with nothing of this checkout on
    the path: the shipped packages, the spec and the named data file are all it needs."""
    root = _project(tmp_path / "proj")
    spec = load_spec({"name": "from-bundle", "model": {"preset": "gpt-tiny"}, "train": {"steps": 2, "global_batch": 4},
                      "data": {"source": "text", "path": "corpus/tiny.txt"}})
    with tarfile.open(fileobj=io.BytesIO(B.build_bundle(spec, root).tar_gz())) as tar:
        tar.extractall(tmp_path / "job", filter="data")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    probe = "import workbench, sys; sys.argv[1:] = ['--spec', 'workbench_job.json']; print(workbench.__file__)"
    out = subprocess.run([sys.executable, "-c", probe + "; from workbench.cloud_entry import main; sys.exit(main())"],
                         cwd=tmp_path / "job", env=env, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == str(tmp_path / "job" / "workbench" / "__init__.py")
    events = [json.loads(line) for line in lines[1:] if line.startswith("{")]
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2]
    assert events[-1] == {"event": "end", "status": "completed", "step": 2}
@pytest.mark.parametrize("name", [".env", "deploy.pem", "svc-service-account.json", "id_rsa", ".envrc", "key.ppk",
                                  "kaggle.json", ".pgpass", ".npmrc", "client_secret_123.apps.json", "token.json",
                                  ".config/gcloud/access_tokens.db", ".kube/config"])
def test_credential_files_are_excluded_and_reported_by_name(tmp_path, name):
    _tree(tmp_path, {"ok.py": "x = 1", name: "x"})
    b = B.collect(tmp_path)
    assert set(b.files) == {"ok.py"} and len(b.excluded_secrets) == 1 and name.startswith(b.excluded_secrets[0])


def test_tarball_is_reproducible_and_carries_spec_and_requirements(tmp_path):
    _tree(tmp_path, {"m.py": "x = 1"})
    spec = load_spec({"name": "t", "backend": {"include": ["m.py"]}})
    one, two = B.build_bundle(spec, tmp_path).tar_gz(), B.build_bundle(spec, tmp_path).tar_gz()
    assert one == two
    with tarfile.open(fileobj=io.BytesIO(one)) as tar:
        names = tar.getnames()
        assert json.loads(tar.extractfile(B.SPEC_FILE).read())["name"] == "t"
        assert b"pydantic" in tar.extractfile(B.REQUIREMENTS_FILE).read()
    assert {"m.py", "workbench/cloud_entry.py", "backends/bundle.py"} <= set(names)


def test_too_large_bundle_is_a_config_error(tmp_path, monkeypatch):
    (tmp_path / "big.bin").write_bytes(b"x" * (3 * 2**20))
    monkeypatch.setattr(B, "MAX_BUNDLE_BYTES", 2 * 2**20)
    with pytest.raises(ConfigError, match=r"(\d+\.\d) MiB exceeds 2 MiB\. Largest files: big.bin, .*backend.include") as e:
        B.build_bundle(load_spec({"backend": {"include": ["big.bin"]}}), tmp_path)
    # the whole bundle is counted: the 3 MiB file plus the packages it ships beside it
    assert float(e.value.args[0].split(" MiB")[0].split()[-1]) > 3.0


def test_job_names_and_checkpoint_prefixes():
    spec = load_spec({"name": "My run_2!"})
    name = B.job_name(spec)
    assert name.startswith("My-run-2-") and len(name) <= 63
    assert B.checkpoint_uri(spec, "s3://", "s3://b", "SageMaker") == ("s3://b/workbench/My-run_2/checkpoints/", "")
    spec = load_spec({"checkpoint": {"uri": "s3://b/x"}})
    assert B.checkpoint_uri(spec, "s3://", "s3://b", "SageMaker")[0] == "s3://b/x/"


def test_a_named_code_folder_follows_the_projects_gitignore_and_named_data_ships_whole(tmp_path):
    """Found from outside: a gitignored `mypkg/local_settings.py` travelled because only the named
    folder's own .gitignore was read. Data named by the spec ships whole: `*.bin` in the project's
    .gitignore (data kept out of git) must not drop the token shards."""
    root = _tree(tmp_path, {
        ".gitignore": "mypkg/local_settings.py\n*.local.yaml\n*.bin\n", "mypkg/__init__.py": "",
        "mypkg/model.py": "def build(**kw):\n    pass\n", "mypkg/local_settings.py": "X = 1\n",
        "mypkg/sub/.gitignore": "scratch.py\n", "mypkg/sub/scratch.py": "", "mypkg/sub/keep.py": "",
        "configs/prod.local.yaml": "a: 1\n", "configs/base.yaml": "a: 1\n", "shards/index.json": "{}",
        "shards/shard-00000.bin": "x", "shards/.gitignore": "notes.txt\n", "shards/notes.txt": ""})
    spec = load_spec({"model": {"factory": "mypkg.model:build", "vocab": 256, "seq_len": 16},
                      "data": {"source": "text", "path": "shards"}, "backend": {"include": ["configs"]}})
    shipped = set(B.build_bundle(spec, root).files)
    assert {"mypkg/model.py", "mypkg/sub/keep.py", "configs/base.yaml", "shards/index.json",
            "shards/shard-00000.bin"} <= shipped
    assert not shipped & {"mypkg/local_settings.py", "mypkg/sub/scratch.py", "configs/prod.local.yaml", "shards/notes.txt"}


def test_the_file_limit_holds_however_the_files_are_named_and_a_link_is_named_as_one(tmp_path, monkeypatch):
    root = _tree(tmp_path, {f"data/f{i}.txt": "" for i in range(60)})
    ours = len(B.build_bundle(load_spec({}), root).files)  # the workbench packages, the spec, requirements
    monkeypatch.setattr(B, "MAX_BUNDLE_FILES", ours + 50)
    for include in (["data"], ["data/**"], ["data/*"]):
        with pytest.raises(ConfigError, match=f"more than {ours + 50:,} files"):
            B.build_bundle(load_spec({"backend": {"include": include}}), root)
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "linked")
    with pytest.raises(ConfigError, match=r"matches only what never travels.*linked \(a symbolic link"):
        B.build_bundle(load_spec({"backend": {"include": ["linked"]}}), root)


def test_the_weights_a_fine_tune_starts_from_and_the_files_requirements_name_travel(tmp_path):
    """Found from outside: `model: {init: hf, path: hf-model}` shipped without the folder, and a
    requirements.txt with `-r requirements/base.txt` without the file pip reads beside it."""
    root = _tree(tmp_path, {"hf-model/config.json": "{}", "hf-model/model.safetensors": "x",
                            "requirements.txt": "-r requirements/base.txt\n--constraint=requirements/pins.txt\ntqdm\n",
                            "requirements/base.txt": "-r more.txt\nnumpy\n", "requirements/more.txt": "pyyaml\n",
                            "requirements/pins.txt": "numpy<3\n"})
    spec = load_spec({"model": {"preset": "gpt-tiny"}}).to_dict()
    spec["model"] = {**spec["model"], "init": "checkpoint", "path": "hf-model/model.safetensors"}
    shipped = set(B.build_bundle(load_spec(spec), root).files)
    assert {"hf-model/model.safetensors", "requirements.txt", "requirements/base.txt", "requirements/more.txt",
            "requirements/pins.txt"} <= shipped
    for line in ("-e .", "./vendored/pkg", "--editable=../lib"):
        (root / "requirements.txt").write_text(f"tqdm\n{line}\n")
        with pytest.raises(ConfigError, match=r"requirements.txt, line 2: .* installs a local folder"):
            B.build_bundle(load_spec({}), root)
    (root / "requirements.txt").write_text("-r missing.txt\n")
    with pytest.raises(ConfigError, match=r"line 1: -r missing.txt is not a file in the project"):
        B.build_bundle(load_spec({}), root)
