"""A spec that names a factory is code (issue 31, workbench/factory.py): planted factories, each
verified by the marker file it would create, never run from planning, never run from the standard
library, builtins or a re-export on the run path, and a trusted factory of the user's project
still plans and builds."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import workbench
from workbench.cli import main as cli_main
from workbench.errors import ConfigError
from workbench.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]

# (factory, kwargs) that would each create `marker` if called
STDLIB = [
    ("os:system", lambda m: {"command": f"touch {m}"}),
    ("subprocess:run", lambda m: {"args": ["touch", str(m)]}),
    ("subprocess:check_call", lambda m: {"args": ["touch", str(m)]}),
    ("subprocess:Popen", lambda m: {"args": ["touch", str(m)]}),
    ("builtins:open", lambda m: {"file": str(m), "mode": "w"}),
    ("os:makedirs", lambda m: {"name": str(m)}),
    ("shutil:copyfile", lambda m: {"src": __file__, "dst": str(m)}),
    ("runpy:run_path", lambda m: {"path_name": str(m.parent / "evil_script.py")}),
    ("posix:system", lambda m: {"command": f"touch {m}"}),
    ("workbench.cli:main", lambda m: {"argv": ["data", "prepare", __file__, "--out", str(m), "--tokenizer", "bytes"]}),
    # installed tools that run commands or code, and private names (found from outside)
    ("setuptools._distutils.spawn:spawn", lambda m: {"cmd": ["touch", str(m)]}),
    ("setuptools:_distutils.spawn.spawn", lambda m: {"cmd": ["touch", str(m)]}),
    ("pexpect:run", lambda m: {"command": f"touch {m}"}),
    ("torch.hub:load", lambda m: {"repo_or_dir": str(m.parent), "model": "x", "source": "local"}),
]


def model(factory: str, kwargs: dict, **extra) -> dict:
    return {"factory": factory, "kwargs": kwargs, "vocab": 256, "seq_len": 64, **extra}


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project folder with a module whose import alone, and whose factory, create markers."""
    (tmp_path / "evil_script.py").write_text(f"open({str(tmp_path / 'pwned')!r}, 'w')\n")
    (tmp_path / "my_models.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(tmp_path / 'imported')!r}).touch()\n"
        "from os import system as reexported\n"
        "def build(vocab=256, hidden=8):\n"
        f"    pathlib.Path({str(tmp_path / 'called')!r}).touch()\n"
        "    import torch\n"
        "    return torch.nn.Sequential(torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("my_models", None)


@pytest.mark.filterwarnings("ignore:.*cannot vouch for its own factory")
@pytest.mark.parametrize("factory,kwargs", STDLIB, ids=[f for f, _ in STDLIB])
def test_standard_library_and_builtin_factories_never_run(project, factory, kwargs, capsys):
    marker = project / "pwned"
    spec_file = project / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({"model": model(factory, kwargs(marker), trust_factory=True)}))
    for argv in (["validate"], ["memory"], ["plan"], ["memory", "--trust-factory"], ["export-config", "--to", "deepspeed"],
                 ["dispatch", "--backend", "sagemaker", "--dry-run"], ["run", "--no-progress"]):
        assert cli_main([argv[0], str(spec_file), *argv[1:]]) == 2, argv
        err = capsys.readouterr().err
        assert "model.factory" in err and "Traceback" not in err
    raw = {"model": model(factory, kwargs(marker))}
    for call in (load_spec, workbench.estimate_memory, workbench.build_model):
        with pytest.raises(ConfigError, match="standard library|workbench's own|a tool that runs|private parts"):
            call(raw)
    override = f"model={{factory: '{factory}', vocab: 256, seq_len: 64}}"
    assert cli_main(["memory", str(ROOT / "examples/quickstart.yaml"), "--set", override]) == 2
    assert not marker.exists()


def test_planning_never_imports_a_project_factory_unless_trusted(project, capsys):
    spec_file = project / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({"model": model("my_models:build", {"hidden": 8})}))
    assert cli_main(["validate", str(spec_file)]) == 0  # finds the module without running it
    assert cli_main(["memory", str(spec_file)]) == 2
    err = capsys.readouterr().err
    assert "is code" in err and "model.params" in err and "--trust-factory" in err and "model.trust_factory" in err
    assert cli_main(["plan", str(spec_file)]) == 2
    with pytest.raises(ConfigError, match="is code"):
        workbench.estimate_memory({"model": model("my_models:build", {})})
    assert not (project / "imported").exists() and not (project / "called").exists()
    # with a size beside it, planning uses the size and still imports nothing
    assert cli_main(["memory", str(spec_file), "--set", "model.params=1.5e9", "--json"]) == 0
    assert not (project / "imported").exists()
    # a shared file cannot vouch for itself: its own trust_factory is ignored, with a warning
    spec_file.write_text(yaml.safe_dump({"model": model("my_models:build", {"hidden": 8}, trust_factory=True)}))
    with pytest.warns(UserWarning, match="a file cannot vouch for its own factory"):
        assert cli_main(["memory", str(spec_file)]) == 2
    assert not (project / "imported").exists()
    # the caller opts in: the factory's parameters are counted (on the meta device)
    assert cli_main(["memory", str(spec_file), "--trust-factory", "--json"]) == 0
    assert (project / "called").exists()


def test_the_run_path_builds_a_project_factory_but_not_a_re_export(project):
    built = workbench.build_model({"model": model("my_models:build", {"hidden": 8})})
    assert sum(p.numel() for p in built.parameters()) == 256 * 8 + 8 * 256 + 256
    with pytest.raises(ConfigError, match="not a function or class of your project"):
        workbench.build_model({"model": model("my_models:reexported", {"command": f"touch {project / 'pwned'}"})})
    with pytest.raises(ConfigError, match="does not take model.kwargs"):
        workbench.build_model({"model": model("my_models:build", {"bogus": 1})})
    assert not (project / "pwned").exists()


def test_the_cloud_entry_point_refuses_a_standard_library_factory(tmp_path):
    marker = tmp_path / "pwned"
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({"model": model("os:system", {"command": f"touch {marker}"})}))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-m", "workbench.cloud_entry", "--spec", str(spec_file)], cwd=tmp_path,
                         env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "standard library" in out.stderr and "Traceback" not in out.stderr
    assert not marker.exists()
