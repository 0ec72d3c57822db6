"""Every notebook under notebooks/ runs top to bottom in a real kernel (nbclient, headless).

Pressing the quickstart's Run button, and what follows in the page, is the browser tests' job
(tests/browser/test_ui.py); the run panel without a browser is tests/integration/test_ui_run_resume.py.

The fast loop starts a kernel for the quickstart and the memory planner; the cloud dispatch
notebook's kernel (9-10 s: it imports the four cloud SDKs again) runs in the whole suite, and its
cells run in this process in the fast loop (`run_cells`), where the cloud tests imported the SDKs.
"""
import ast
import contextlib
import importlib
import io
import os
import shutil
from pathlib import Path
from unittest import mock

import pytest

from bench.common import popen_own_group

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipywidgets")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"


def has(module: str, attr: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), attr)
    except ImportError:
        return False


def execute(name: str, tmp_path: Path, extra_cells: list[str] = (), timeout: int = 300, parameters: str = ""):
    """Run a copy of the notebook in tmp_path (outputs and files stay out of the repo).
    `parameters`: a cell run right after the one tagged "parameters" (papermill's convention)."""
    shutil.copy(NOTEBOOKS / name, tmp_path / name)
    nb = nbformat.read(tmp_path / name, as_version=4)
    if parameters:
        (at,) = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
        nb.cells.insert(at + 1, nbformat.v4.new_code_cell(parameters))
    nb.cells += [nbformat.v4.new_code_cell(src) for src in extra_cells]
    # The kernel imports this checkout's workbench, whatever is installed in the environment.
    # RAY_ADDRESS=local: start an embedded cluster, never attach to another process's `ray start` one.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
               RAY_ADDRESS="local")
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    # jupyter_client starts every kernel in a session of its own: keep it in this one (procs.py)
    with mock.patch("jupyter_client.launcher.Popen", popen_own_group):
        client.execute(env=env)  # starts the kernel with env, runs every cell, shuts the kernel down
    return nb


def run_cells(name: str, tmp_path: Path) -> list[tuple[str, object]]:
    """The notebook's code cells in this process, top to bottom in one namespace, from a copy in
    tmp_path (the working folder, as `execute` gives its kernel): per cell (markdown too), what it
    printed and the value of its last expression (what a kernel displays as its result)."""
    shutil.copy(NOTEBOOKS / name, tmp_path / name)
    nb = nbformat.read(tmp_path / name, as_version=4)
    namespace: dict = {"__name__": "__main__"}
    results = []
    with contextlib.chdir(tmp_path):
        for i, cell in enumerate(nb.cells):
            tree = ast.parse(cell.source if cell.cell_type == "code" else "")
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            printed, value = io.StringIO(), None
            with contextlib.redirect_stdout(printed):
                exec(compile(tree, f"{name} cell {i}", "exec"), namespace)
                if last is not None:
                    value = eval(compile(ast.Expression(last.value), f"{name} cell {i}", "eval"), namespace)
            results.append((printed.getvalue(), value))
    return results


def present_backends() -> list[str]:
    """The remote backends this installation can build requests for (their SDK imports)."""
    backends = importlib.import_module("backends")
    present = []
    for name in ("ray", "sagemaker", "vertex", "azureml"):
        try:
            backends.get_backend(name)
            present.append(name)
        except ImportError:
            pass
    return present


def outputs(cell) -> str:
    return "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for o in cell.get("outputs", []))


@pytest.mark.timeout(240)
def test_quickstart_notebook_runs(tmp_path):
    """Top to bottom. Pressing its Run button is what the browser tests do, in a real page
    (tests/browser/test_ui.py: live curves, Stop, Resume, the report of a run)."""
    nb = execute("quickstart.ipynb", tmp_path)
    assert "JobSpec('quickstart'" in outputs(nb.cells[3])  # a cell that raises fails execute() itself


@pytest.mark.timeout(240)
def test_memory_planner_notebook(tmp_path):
    if not (has("workbench.memory", "estimate_memory") and has("workbench.planner", "plan")):
        pytest.skip("workbench.memory / workbench.planner are not in this build yet")
    nb = execute("memory_planner.ipynb", tmp_path)
    text = "".join(outputs(c) for c in nb.cells)
    assert "llama-70b" in text and "does NOT fit" in text  # plain DP cannot hold 70B per GPU
    assert "fits=True" in text


@pytest.mark.slow  # the same cells in this process are the fast test below; a kernel is the quickstart's test
@pytest.mark.timeout(240)
def test_cloud_dispatch_notebook(tmp_path):
    nb = execute("cloud_dispatch.ipynb", tmp_path)
    present = present_backends()
    listed = outputs(nb.cells[5])
    assert listed.strip() == repr(sorted(present))
    text = "".join(outputs(c) for c in nb.cells)
    for name in present:
        assert f"== {name}:" in text


@pytest.mark.timeout(240)
def test_cloud_dispatch_notebook_cells_in_process(tmp_path):
    """The cells of test_cloud_dispatch_notebook without a kernel: every dry-run request it prints,
    the list of backends it built one for, the dispatch panel's request (the last cell)."""
    cells = run_cells("cloud_dispatch.ipynb", tmp_path)
    present = present_backends()
    assert cells[5][1] == sorted(present)
    text = "".join(printed for printed, _ in cells)
    for name in present:
        assert f"== {name}:" in text
    assert type(cells[-1][1]).__name__ == "Workbench"


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_train_on_text_notebook(tmp_path):
    nb = execute("train_on_text.ipynb", tmp_path, timeout=300)
    text = "".join(outputs(c) for c in nb.cells)
    assert "bytes/token" in text and "status completed" in text
    diff = float(text.split("max |logit difference| = ")[1].split()[0])
    assert diff < 1e-4
    first, last = (float(v) for v in text.split("validation loss ")[1].split(",")[0].split(" -> "))
    assert last < first  # it learned something about the text
    assert outputs(nb.cells[-1]).startswith("Four score and seven")
    assert (tmp_path / "hf-model" / "model.safetensors").is_file() and any((tmp_path / "tensorboard").iterdir())


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_finetune_notebook(tmp_path):
    """Pretrain, export, fine-tune from the folder on man-page Q/A, generate (#29 item 5)."""
    from workbench.manpages import man_pages

    if len(man_pages("1")) < 200:
        pytest.skip(f"/usr/share/man/man1 has {len(man_pages('1'))} pages here; the demo's instruction set needs ~200")
    # The demo at about a third of its length (400 + 150 steps): the same path, and still 0.3 nats learned
    nb = execute("finetune.ipynb", tmp_path, timeout=600, parameters="PRETRAIN_STEPS, FINETUNE_STEPS = 160, 60")
    text = "".join(outputs(c) for c in nb.cells)
    assert text.count("status completed") == 2
    before, after = (float(v) for v in text.split("held-out completion loss: released ")[1].split(" (")[0].split(" -> fine-tuned "))
    assert after < before - 0.3  # the answers of commands it never saw got more likely
    last_eval = float(text.split("the run's last eval: ")[1].split(")")[0])
    assert abs(last_eval - after) < 2e-3  # transformers' loss on the export is the run's own eval
    assert "fine-tuned: '" in text and (tmp_path / "fine-tuned-model" / "model.safetensors").is_file()
