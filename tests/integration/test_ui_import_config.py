"""The notebook's "Import config" button, in a real kernel: a DeepSpeed config becomes the edited spec,
once Apply is pressed under the settings it would replace; its unmapped keys are listed, and an
ill-formed file shows its ConfigError and changes nothing.

The same cells run in this process in the fast loop (a kernel start and its imports: 4-9 s); the
kernel run is the whole suite's, beside the notebooks' kernels (test_notebooks.py)."""
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipywidgets")

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "interop" / "ds_zero3_offload_bf16.json"

CELLS = [
    "import datetime, pathlib\nfrom workbench import Workbench\nwb = Workbench()",
    # What the browser sends when a file is picked (ipywidgets 8 FileUpload.value).
    "def pick(name, content):\n"
    "    wb.import_config.upload.value = ({'name': name, 'type': '', 'size': len(content),\n"
    "        'content': memoryview(content), 'last_modified': datetime.datetime.now()},)",
    f"pick('ds_zero3_offload_bf16.json', pathlib.Path({str(FIXTURE)!r}).read_bytes())",
    "assert wb.spec.layout.zero == 0 and 'It would replace' in wb.message.value  # asks first\n"
    "wb.import_config.apply_button.click()",
    "s = wb.spec\n"
    "assert (s.name, s.layout.dp, s.layout.zero, s.layout.offload, s.precision.dtype) == "
    "('ds-zero3-offload-bf16', 8, 3, 'cpu', 'bf16'), s\n"
    "assert wb.name.value == 'ds-zero3-offload-bf16'\n"
    "assert wb.layout_panel.fields['layout.zero'].value == 3 and wb.layout_panel.fields['layout.dp'].value == 8\n"
    "assert 'Imported ds_zero3_offload_bf16.json (deepspeed)' in wb.message.value\n"
    "assert 'zero_optimization.overlap_comm' in wb.message.value\n"
    "assert wb.import_config.upload.value == ()",
    "pick('broken.json', b'{\"train_batch_size\": ')\n"
    "assert 'invalid JSON' in wb.message.value and 'wb-note-error' in wb.message.value\n"
    "assert wb.spec.layout.zero == 3  # unchanged",
]


@pytest.mark.slow
def test_import_config_button_in_a_real_kernel(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=env)  # a failing assert raises CellExecutionError with the cell and its traceback


def test_import_config_button_in_this_process():
    """CELLS, each run as a kernel runs a cell (one namespace): the upload observer of a real
    FileUpload widget, set as the browser sets it."""
    namespace: dict = {"__name__": "__main__"}
    for i, src in enumerate(CELLS):
        exec(compile(src, f"cell {i}", "exec"), namespace)
    assert namespace["wb"].spec.layout.zero == 3
