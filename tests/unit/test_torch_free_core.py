"""The planning core (spec, shapes, validate, memory, step time, planner, catalog, prices) imports no
torch, Ray or cloud SDK: `workbench plan`, `memory` and `validate` answer without paying for them."""
import subprocess
import sys

HEAVY = ["torch", "ray", "plotly", "ipywidgets", "boto3", "sagemaker_core", "google.cloud.aiplatform",
         "google.cloud.storage", "azure.ai.ml", "numpy"]  # (namespace .pth files may pre-register bare "google")

CORE = ("workbench.spec", "workbench.shapes", "workbench.validate", "workbench.memory", "workbench.memory.estimate",
        "workbench.steptime", "workbench.planner", "workbench.catalog", "workbench.prices", "workbench.cli",
        "workbench.parallelism")


def test_plan_memory_validate_import_no_torch():
    code = (
        "import sys, importlib\n"
        f"for m in {CORE!r}: importlib.import_module(m)\n"
        "from workbench.cli import main\n"
        "for cmd in ('validate', 'memory', 'plan'):\n"
        "    assert main([cmd, 'examples/llama-70b-plan.yaml']) == 0\n"
        f"print('heavy:' + ','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.splitlines()[-1] == "heavy:"
