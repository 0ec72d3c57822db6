"""No secret leaves the machine (issue 31): a corpus of planted credentials of each kind, built at
run time, never reaches a code bundle, a dispatch request or a dry-run output; a URL field with a
credential is refused everywhere; the scanner reads files of any size as a stream."""
import io
import json
import tarfile

import pytest
import yaml

from backends import bundle as B
from backends.secrets import MAX_LINE_CHARS, Scanner, credential_name
from workbench.cli import main as cli_main
from workbench.errors import ConfigError
from workbench.spec import load_spec

ALNUM = "Xq7Lm2Rt9Vb4Nc8Kd3Wf6Hj1Pz5Sg0Ya"


def k(n: int, alphabet: str = ALNUM) -> str:
    """n characters that look random (no literal secret lives in this file)."""
    return (alphabet * (n // len(alphabet) + 1))[:n]


AWS_SECRET = k(40, ALNUM + "+/")
HEX = "0123456789abcdef"
ENTRA_SECRET = "Xy78Q~" + k(34, ALNUM + "_.-~")  # an Entra ID client secret's shape
ADO_PAT = k(52, "abcdefghijklmnopqrstuvwxyz234567")  # an Azure DevOps personal access token's shape
# (file name, content): each must refuse the dispatch by content
BY_CONTENT = {
    "settings.py": f"AWS_SECRET_ACCESS_KEY = '{AWS_SECRET}'\n",
    "conf.ini": f'aws_secret_access_key = "{AWS_SECRET}"\n',
    "big_corpus.txt": "the quick brown fox jumps over the lazy dog\n" * 50_000 + "id AKIA" + k(16).upper() + "\n",
    "gh.py": "TOKEN = 'ghp_" + k(36) + "'\n",
    "hf.py": "HF = 'hf_" + k(34, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJ") + "'\n",
    "openai.py": "client = OpenAI(api_key='sk-" + k(20) + "T3BlbkFJ" + k(20) + "')\n",
    "oauth.json": json.dumps({"installed": {"client_id": "1.apps", "client_secret": "GOCSPX-" + k(28)}}),
    "user.json": json.dumps({"type": "authorized_user", "refresh_token": "1//0" + k(60)}),
    "cluster.yaml": "users:\n- name: u\n  user:\n    token: eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0."
                    "dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U\n",
    "deploy.txt": "-----BEGIN OPENSSH PRIVATE KEY-----\n" + k(64) + "\n-----END OPENSSH PRIVATE KEY-----\n",
    "storage.cfg": "DefaultEndpointsProtocol=https;AccountName=a;AccountKey=" + k(86, ALNUM + "+/") + "==\n",
    "notify.py": "SLACK = 'xoxb-" + "1234567890-1234567890-" + k(24) + "'\n",
    "db.py": 'db_password = "' + k(14) + '"\n',
    "npm.txt": "//registry.npmjs.org/:_authToken=npm_" + k(36) + "\n",
    "analysis.ipynb": json.dumps({"cells": [{"cell_type": "code", "source": ["import os\n", "os.environ"],
                                             "outputs": [{"output_type": "execute_result", "data": {
                                                 "text/plain": ["{'AWS_ACCESS_KEY_ID': 'AKIA" + k(16).upper() + "'}"]}}]}]}),
    "long_line.json": "[" + '"x",' * (3 * MAX_LINE_CHARS // 4) + '"ghp_' + k(36) + '"]',
    # found from outside: unquoted shell assignments, UTF-16, archives, more vendors' tokens
    "scripts/env.sh": f"#!/bin/sh\nexport AWS_SECRET_ACCESS_KEY={AWS_SECRET}\nexport MLFLOW_TRACKING_PASSWORD=s3cr3t-pa55\n",
    "wandb.sh": "WANDB_API_KEY=" + k(40, "0123456789abcdef") + "\n",
    "keys_utf16.txt": ("notes\nid AKIA" + k(16).upper() + "\n").encode("utf-16"),
    "backup.tgz": None,  # a gzipped tar holding env.sh, made below
    "databricks.cfg": "[DEFAULT]\nhost = https://x.cloud.databricks.com\ntoken = dapi" + k(32, "0123456789abcdef") + "\n",
    "vault.txt": "hvs." + k(26) + "\n",
    # found from outside (review_cloud finding 1): keys without a vendor prefix, unquoted or in URLs
    "nb_stream.ipynb": None,  # a notebook that printed a W&B key, an Entra secret and ~/.netrc: made below
    "load_data.py": 'SAS = "https://acct.blob.core.windows.net/d/x.bin?sv=2022-11-02&sr=b&sp=r&sig=' + k(43)
                    + '%3D"\n',
    "gcs.py": 'URL = "https://storage.googleapis.com/b/x?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Signature='
              + k(512, HEX) + '"\n',
    "s3.md": "curl 'https://b.s3.amazonaws.com/x?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature=" + k(64, HEX)
             + "'\n",
    "requirements.txt": "torch\ngit+https://" + ADO_PAT + "@dev.azure.com/acme/ml/_git/tok\n",
    "setup_notes.txt": "pip install git+https://ci-bot:" + k(40, HEX) + "@git.example.com/acme/pkg.git\n",
    "deploy.conf": "[db]\nDB_PASSWORD=correcthorse" + "batterystaple\n",
    "aws_config": "[profile ci]\naws_session_token = IQoJb3JpZ2luX2Vj" + k(200, ALNUM + "+/") + "\n",
    "staging.yaml": "auth:\n  client_secret: " + ENTRA_SECRET + "\n",
    "ci.sh": "export DEPLOY_TOKEN=" + k(30, "QwErTyUiOpAsDfGhJkLzXcVbNm") + "\n",
}


def _tgz() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = BY_CONTENT["scripts/env.sh"].encode()
        info = tarfile.TarInfo("home/env.sh")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def notebook(outputs: list[str], source: str = "import os\n") -> str:
    """A notebook (nbformat 4, as Jupyter saves it: one JSON string a line) with one stream output."""
    cell = {"cell_type": "code", "execution_count": 1, "id": "c1", "metadata": {}, "source": [source],
            "outputs": [{"name": "stdout", "output_type": "stream", "text": outputs}]}
    return json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}, indent=1)


BY_CONTENT["backup.tgz"] = _tgz()
BY_CONTENT["nb_stream.ipynb"] = notebook([k(40, HEX) + "\n", ENTRA_SECRET + "\n", "machine api.wandb.ai\n",
                                          "  password " + k(40, HEX) + "\n"])
BY_NAME = [".envrc", "key.ppk", "kaggle.json", ".pgpass", ".npmrc", "client_secret_42.apps.json", "token.json",
           ".config/gcloud/credentials.db", ".kube/config", ".aws/credentials", ".env.production", "backup.env.gz",
           ".bash_history", ".databrickscfg", ".vault-token", ".s3cfg", "PROD.ENV", ".env-staging", ".env_local"]
SECRETS = [AWS_SECRET, "ghp_", "hf_", "T3BlbkFJ", "GOCSPX-", "1//0", "eyJhbGci", "PRIVATE KEY", "AccountKey=",
           "xoxb-", "_authToken", "AKIA", "s3cr3t-pa55", "dapi", "hvs.", k(40, HEX), "8Q~", k(43), ADO_PAT[:20],
           "correcthorse", "IQoJb3", "QwErTyUiOp"]


def project(root, files: dict):
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            (root / name).write_bytes(content)
        else:
            (root / name).write_text(content)
    return root


@pytest.mark.parametrize("name", BY_CONTENT)
def test_each_planted_credential_refuses_the_dispatch_naming_file_line_and_kind(tmp_path, name, capsys):
    root = project(tmp_path, {"train.py": "x = 1\n", name: BY_CONTENT[name]})
    spec = {"name": "s", "backend": {"include": ["*.py", name]}}
    with pytest.raises(ConfigError) as err:
        B.build_bundle(load_spec(spec), root)
    message = str(err.value)
    assert (f"{name}, line " in message or f"{name}!" in message) and "backend.secrets_allowlist" in message
    assert not any(s in message for s in SECRETS)
    spec_file = root / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    import os

    cwd = os.getcwd()
    os.chdir(root)
    try:
        backend = ("sagemaker", "vertex", "azureml", "ray")[list(BY_CONTENT).index(name) % 4]
        assert cli_main(["dispatch", str(spec_file), "--backend", backend, "--dry-run"]) == 2
    finally:
        os.chdir(cwd)
    out = capsys.readouterr()
    assert not any(s in out.out + out.err for s in SECRETS) and "Traceback" not in out.err
    spec["backend"]["secrets_allowlist"] = [name]  # a false positive the user vouches for ships
    assert name in B.build_bundle(load_spec(spec), root).files


def test_credential_files_never_travel_and_the_rest_does(tmp_path):
    root = project(tmp_path, {"train.py": "x = 1\n", **{n: "x = 1\n" for n in BY_NAME}})
    b = B.build_bundle(load_spec({"backend": {"include": ["*", ".*", ".*/**/*"]}}), root)
    assert "train.py" in b.files and not set(b.files) & set(BY_NAME)
    assert all(credential_name(n) for n in BY_NAME) and not credential_name("train.py")
    with tarfile.open(fileobj=io.BytesIO(b.tar_gz())) as tar:
        assert not set(tar.getnames()) & set(BY_NAME)


# Ordinary code, settings and notebooks that name credentials without holding one: each must ship.
CLEAN = {
    "train.py": 'import getpass, os\npassword = getpass.getpass()\ntoken = os.environ["HF_TOKEN"]\n'
                'api_key = os.getenv("WANDB_API_KEY")\nsas_url = f"https://acct.blob.core.windows.net/c/x?{sas}"\n'
                'signed = f"{base}?X-Goog-Signature={signature}"\nrepo = "ssh://git@github.com/acme/train.git"\n'
                'max_tokens = 1024\ndocs = "https://docs.example.com/auth?lang=en&page=2"\n',
    "requirements.txt": "torch>=2.1\ngit+https://${GITHUB_TOKEN}@github.com/acme/private-pkg.git\n"
                        "git+ssh://git@github.com/acme/other.git@v1.2.0\n"
                        "https://download.pytorch.org/whl/torch-2.1.0-cp311-linux_x86_64.whl#sha256=" + k(64, HEX) + "\n",
    "configs/tokenizer.yaml": 'pad_token: "<pad>"\neos_token: </s>\npad_token: eos_token\npad_token_id: 0\n'
                              "max_tokens: 1024\ntoken_url: https://oauth2.googleapis.com/token\n"
                              "password: ${DB_PASSWORD}\npassword_file: /run/secrets/db_password\n"
                              "auth_token: property\n",
    "configs/db.ini": "[db]\nhost = db.internal\npassword = %(db_pass)s\nuser = trainer\ntoken = xxxxxxxx\n",
    "scripts/run.sh": 'export HF_TOKEN=$(cat ~/.cache/huggingface/token)\nTOKEN="${TOKEN:-}"\nexport WANDB_API_KEY\n'
                      "DB_PASSWORD=changeme\nHF_TOKEN=your_hf_token_here\n",
    "docs/notes.md": "Clone ssh://git@github.com/acme/x.git; tokens: see https://example.com/help?topic=auth.\n",
    "notebooks/train.ipynb": notebook(["step 10 | loss 2.3456 | lr 3.0e-04 | 41.2 ms\n",
                                       "saved /root/.cache/huggingface/hub/models--gpt2/snapshots/607a30d783dfa66\n",
                                       "100%|##########| 200/200 [00:04<00:00, 45.71it/s]\n",
                                       "model.layers.11.self_attn.q_proj.weight torch.Size([4096, 4096])\n"],
                                      source="model = AutoModelForCausalLM.from_pretrained('gpt2')\n"),
}


def test_ordinary_code_settings_and_notebooks_ship(tmp_path):
    """The other side of the corpus above: names of credentials, references, templates, placeholders
    and tokenizer settings are not credentials."""
    root = project(tmp_path, CLEAN)
    b = B.build_bundle(load_spec({"name": "s", "backend": {"include": list(CLEAN)}}), root)
    assert set(CLEAN) <= set(b.files)


OURS = {"Credential in a URL", "Bare key in a notebook cell", "Secret in a settings file"}
NOTEBOOKS = B.Path(__file__).parents[1] / "fixtures" / "notebooks"  # with outputs, from outside (SOURCE.md)


@pytest.mark.parametrize("name", sorted(p.name.removesuffix(".json") for p in NOTEBOOKS.glob("*.ipynb.json")))
def test_real_notebooks_with_outputs_hold_nothing_until_a_key_is_printed(name):
    """Nothing is found in published notebooks saved with their outputs (their PNG figures, which
    detect-secrets' own entropy rule flags, are image data and not scanned); one stream output of a
    printed key, added to such a notebook as Jupyter would save it, is found on its line."""
    text = (NOTEBOOKS / f"{name}.json").read_text()
    with Scanner() as scanner:
        assert not {kind for _, kind in every_finding(scanner, text.encode(), name) if kind in OURS}
        nb = json.loads(text)
        nb["cells"][-1]["outputs"] = [{"name": "stdout", "output_type": "stream", "text": ["loss 2.31\n", k(40, HEX) + "\n"]}]
        planted = json.dumps(nb, indent=1)
        line = next(i for i, t in enumerate(planted.splitlines(), 1) if k(40, HEX) in t)
        assert (line, "Bare key in a notebook cell") in every_finding(scanner, planted.encode(), name)
        # and a bundle ships the notebook: its saved figures are image data, not keys (they refused the dispatch)
        assert scanner.scan_bytes(text.encode(), name) is None
        assert scanner.scan_bytes(planted.encode(), name).kind == "Bare key in a notebook cell"


def test_a_secret_in_the_spec_itself_refuses_the_dispatch(tmp_path):
    spec = load_spec({"model": {"factory": "m:build", "kwargs": {"token": "hf_" + k(34, "abcdefghijklmnopqrstuvwxyzAB")},
                                "vocab": 256, "seq_len": 16}})
    (tmp_path / "m.py").write_text("def build(**kw):\n    pass\n")
    with pytest.raises(ConfigError, match=r"workbench_job.json, line \d+: "):
        B.build_bundle(spec, tmp_path)


@pytest.mark.parametrize("field,url", [
    ("backend.ray.address", "http://user:PASSWORD@host:8265"),
    ("tracking.mlflow", "https://bob:hunter2@mlflow.example.com"),
    ("checkpoint.uri", "https://acct.blob.core.windows.net/c/ckpt?sv=2024-01-01&sig=abcdef"),
    ("data.path", "https://bucket.s3.amazonaws.com/tokens?X-Amz-Credential=A%2F1&X-Amz-Signature=ff"),
    # found from outside: a token as the user name, other parameter names, a fragment, ';' separators
    ("tracking.mlflow", "https://Tr0ub4dorToken@mlflow.example.com"),
    ("tracking.mlflow", "https://gitlab.example.com/api?private_token=abc123"),
    ("tracking.mlflow", "https://host/x?x-api-key=abc123"),
    ("tracking.mlflow", "https://host/cb#access_token=abc123"),
    ("checkpoint.uri", "https://host/c?a=1;sig=abc123"),
    ("tracking.mlflow", "http://[user:PASSWORD@host/"),
    # a token as the user part of a git or ssh URL (review_cloud finding 3)
    ("data.path", "git+https://Tr0ub4dorPAT52charsxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx@dev.azure.com/acme/ml/_git/corpus"),
    ("data.path", "ssh://Tr0ub4dorPAT@host/corpus"),
    ("data.path", "git+ssh://Tr0ub4dor@github.com/acme/corpus.git"),
])
def test_credentials_in_url_fields_are_refused_before_anything_prints(tmp_path, field, url, capsys):
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({"name": "u"}))
    for argv in (["validate"], ["dispatch", "--backend", "ray", "--dry-run"], ["export-config", "--to", "deepspeed"]):
        assert cli_main([argv[0], str(spec_file), *argv[1:], "--set", f"{field}={url}"]) == 2
        out = capsys.readouterr()
        assert field in out.err and ("would travel with the spec" in out.err or "not a well-formed URL" in out.err)
        assert not any(s in out.out + out.err for s in (":PASSWORD", "hunter2", "abc123", "abcdef", "Tr0ub4dor"))


def test_urls_without_credentials_still_pass():
    for field, url in (("backend.ray.address", "https://ray.example.com:8265"),
                       ("checkpoint.uri", "abfs://container@account.dfs.core.windows.net/ckpt"),
                       ("checkpoint.uri", "abfss://container@account.dfs.core.windows.net/ckpt"),
                       ("checkpoint.uri", "wasbs://container@account.blob.core.windows.net/ckpt"),
                       ("checkpoint.uri", "az://container@account/ckpt"),
                       ("tracking.mlflow", "http://mlflow:5000/?experiment=3")):
        load_spec({}, [f"{field}={url}"])


def test_the_scanner_streams_files_of_any_size(tmp_path):
    """A key after 5 MiB of binary data, and one across a cut of a 200 kB line, are both found."""
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        for _ in range(5):
            f.write(bytes(range(256)) * (1 << 12))
        f.write(b"AKIA" + k(16).upper().encode() + b"\n")
    line = "a " * (MAX_LINE_CHARS // 2 - 10) + "ghp_" + k(36) + " b" * MAX_LINE_CHARS
    with Scanner() as scanner:
        assert scanner.scan_file(big, "big.bin").kind == "AWS Access Key"
        assert scanner.scan_bytes(line.encode(), "one_line.txt").kind == "GitHub Token"
        assert scanner.scan_bytes(b"plain words and numbers 12345\n" * 1000, "clean.txt") is None


def test_workbench_itself_ships_clean():
    """Every bundle ships our packages: the scanner must find nothing in them."""
    b = B.build_bundle(load_spec({}), B.Path(__file__).parent)
    assert any(n.startswith("workbench/") for n in b.files)


def test_the_line_gates_find_what_every_pattern_on_every_line_finds():
    """The plugins' slow expressions run only on lines holding one of their required words
    (backends/secrets.py `_REQUIRED_GROUPS`, the keyword list): on lines of each gated vendor's and
    keyword's secret, in both cases, among Latin-1 bytes and a line whose lower case is longer ('İ'),
    each line's findings (every plugin's) are those of a scanner that runs every expression on every
    line. (A line filter that drops lines fails here: the IBM key's line is found by its gate alone.)"""
    hexes, lower = "0123456789abcdef", "abcdefghijklmnopqrstuvwxyz"
    lines = [f"cloudant_password = '{k(64, hexes)}'", f"ibm_cloud_iam_api_key: {k(44)}",
             f"ibm_cos_hmac_secret_access_key = {k(48, hexes)}", f"softlayer_api_key = {k(64, lower + '0123456789')}",
             f'db_password = "{k(14)}"', f'aws_secret_key = "{k(40, ALNUM + "+/")}"', f"api_key: '{k(32)}'",
             f'secret = "{k(20)}"', 'contraseña = "' + k(16) + '"']
    lines += [line.upper() for line in lines] + [f"İ {line}" for line in lines[:3]]
    noise = bytes(range(256)).decode("latin-1").replace("\n", " ")
    with Scanner() as gated:
        everywhere = Scanner()
        everywhere.patterns = [(None, [p for _, patterns in gated.patterns for p in patterns])]
        found = 0
        for line in lines:
            for text in (line, f"{noise}\n{line}\n{noise}"):
                data = text.encode("latin-1" if "İ" not in text else "utf-8", errors="strict")
                want = every_finding(everywhere, data)
                assert every_finding(gated, data) == want, (text, want)
                found += len(want)
        assert found >= 2 * len(lines), found  # each line holds secrets to both: the comparison is not vacuous
        assert sum(isinstance(gate, tuple) for gate, _ in gated.patterns) >= 3


def every_finding(scanner, data: bytes, filename: str = "x.py") -> set[tuple[int, str]]:
    """(line, kind) of every secret every plugin reports (`scan_bytes` stops at the first)."""
    from detect_secrets.core.scan import _process_line_based_plugins

    from backends.secrets import _blocks

    return {(n, secret.type) for lines in _blocks(io.BytesIO(data)) for n, text in scanner._candidates(lines)
            for secret in _process_line_based_plugins([(n, text)], filename=filename)}
