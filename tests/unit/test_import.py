"""`import workbench` stays light: no Ray, plotting, widget or cloud SDK imports."""
import subprocess
import sys

HEAVY = ["ray", "plotly", "ipywidgets", "anywidget", "boto3", "sagemaker_core", "google.cloud.aiplatform",
         "azure.ai.ml", "tqdm"]  # (namespace .pth files may pre-register bare "google"/"azure")


def test_import_workbench_is_light():
    code = ("import sys, workbench, workbench.spec, workbench.cli, backends; "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
