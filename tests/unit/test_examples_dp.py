"""The data-parallel example specs are valid and runnable as written."""
import pytest

from workbench.spec import load_spec
from workbench.validate import check_runnable


@pytest.mark.parametrize("path", ["examples/zero3-bf16.yaml", "examples/zero1-fp16-nvme.yaml",
                                  "examples/zero2-cpu-offload.yaml"])
def test_example_is_runnable(path):
    spec = load_spec(path)
    check_runnable(spec)
    assert spec.layout.dp == 2 and spec.layout.zero > 0
