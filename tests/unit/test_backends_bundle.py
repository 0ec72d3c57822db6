"""The code bundle: what travels to a remote job and what never does."""
from __future__ import annotations

import io
import json
import os
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


def test_git_venvs_caches_checkpoints_and_links_are_left_out(tmp_path):
    root = _tree(tmp_path, {"train.py": "", ".git/HEAD": "", "env1/pyvenv.cfg": "", "env1/lib/x.py": "",
                            "conda/conda-meta/history": "", "pkg/__pycache__/m.pyc": "", "checkpoints/s1": "",
                            "runs/ckpt/step1": "", "pkg.egg-info/PKG-INFO": "", ".aws/config": ""})
    os.symlink("/etc", tmp_path / "etc_link")
    spec = load_spec({"checkpoint": {"uri": "runs/ckpt"}})
    b = B.build_bundle(spec, root)
    shipped = {n for n in b.files}
    assert "train.py" in shipped
    for banned in (".git", "env1", "conda", "__pycache__", "checkpoints", "runs/ckpt", "egg-info", ".aws", "etc_link"):
        assert not any(banned in n for n in shipped), banned


@pytest.mark.parametrize("name,text", [
    (".env", "TOKEN=x"), ("deploy.pem", "x"), ("svc-service-account.json", "{}"), ("id_rsa", "x"),
    ("settings.py", "KEY = '" + "AKIA" + "ABCDEFGHIJKLMNOP'"),
    ("notes.txt", "-----BEGIN RSA PRIVATE KEY-----\n" + "M" * 64),
    ("conn.cfg", "AccountKey=" + "a" * 44),
    ("sa.json", json.dumps({"private" + "_key": "-----BEGIN PRIVATE KEY-----\nabc"})),
])
def test_credentials_by_name_or_content_are_excluded_and_reported(tmp_path, name, text):
    _tree(tmp_path, {"ok.py": "x = 1", name: text})
    b = B.collect(tmp_path)
    assert set(b.files) == {"ok.py"} and b.excluded_secrets == [name]


def test_tarball_is_reproducible_and_carries_spec_and_requirements(tmp_path):
    _tree(tmp_path, {"m.py": "x = 1"})
    spec = load_spec({"name": "t"})
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
    with pytest.raises(ConfigError, match=r"3\.\d MiB exceeds 2 MiB\. Largest files: big.bin.*gitignore"):
        B.build_bundle(load_spec({}), tmp_path)


def test_job_names_and_checkpoint_prefixes():
    spec = load_spec({"name": "My run_2!"})
    name = B.job_name(spec)
    assert name.startswith("My-run-2-") and len(name) <= 63
    assert B.checkpoint_uri(spec, "s3://", "s3://b", "SageMaker") == ("s3://b/workbench/My-run_2/checkpoints/", "")
    spec = load_spec({"checkpoint": {"uri": "s3://b/x"}})
    assert B.checkpoint_uri(spec, "s3://", "s3://b", "SageMaker")[0] == "s3://b/x/"
