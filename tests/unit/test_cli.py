"""The CLI's validate command: exit codes and messages, never a traceback. The first test starts
`python -m workbench.cli` (the entry point and its exit code); the others call main() in this
process (tests/helpers/cli.py), where an escaping exception fails the test."""
import subprocess
import sys

from tests.helpers.cli import run_cli as run

CLI = [sys.executable, "-m", "workbench.cli"]


def test_validate_ok():
    proc = subprocess.run(CLI + ["validate", "examples/quickstart.yaml"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("ok: JobSpec('quickstart'")


def test_validate_reports_config_errors_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nlayuot: {dp: 2}\n")
    proc = run("validate", str(bad))
    assert proc.returncode == 2
    assert "layuot: unknown key. Did you mean 'layout'?" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_overrides_reach_validation():
    proc = run("validate", "examples/quickstart.yaml", "--set", "layout.dp=3")
    assert proc.returncode == 2
    assert "dp(3) x tp(1) x pp(1) = 3 ranks, but resources give 2 GPUs" in proc.stderr


def test_run_refuses_a_planning_only_model_before_starting_workers(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("model: {params: 7.0e9}\n")
    proc = run("run", str(spec))
    assert proc.returncode == 2 and "size alone, for planning" in proc.stderr
