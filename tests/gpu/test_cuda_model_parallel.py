"""bf16 tensor parallel and 3D layouts on NCCL, one GPU per rank, against the single GPU in bf16
(the tolerances of tests/distributed/test_parity_mixed.py). Skipped without enough GPUs."""
import pytest
import torch

from tests.helpers.events import losses
from tests.helpers.reference import reference_run
from workbench.runtime.spawn import SpawnPool

pytestmark = [pytest.mark.gpu, pytest.mark.distributed, pytest.mark.timeout(600)]
TIED = {"preset": "gpt-tiny", "tie_embeddings": True}
BASE = {"model": TIED, "train": {"steps": 5, "global_batch": 8, "micro_batch": 2, "lr": 3e-3},
        "precision": {"dtype": "bf16"}}
CASES = {
    "tp2-sp": {"tp": 2, "sequence_parallel": True},
    "dp2-tp2-zero3": {"dp": 2, "tp": 2, "zero": 3},
    "tp2-pp2-interleaved": {"tp": 2, "pp": 2, "pp_schedule": "interleaved-1f1b"},
    "dp2-tp2-pp2": {"dp": 2, "tp": 2, "pp": 2, "sequence_parallel": True},
}


def spec(layout: dict | None = None) -> dict:
    world = layout["dp"] * layout["tp"] * layout.get("pp", 1) if layout else 1
    return {**BASE, "layout": {"dp": 1, **(layout or {})}, "resources": {"gpu": "h100-80gb", "gpus_per_node": world}}


@pytest.fixture(scope="module")
def reference():
    return reference_run(spec()).losses()


@pytest.mark.parametrize("name", list(CASES))
def test_bf16_model_parallel_on_nccl_matches_one_gpu(name, reference):
    layout = {"dp": 1, **CASES[name]}
    world = layout["dp"] * layout["tp"] * layout.get("pp", 1)
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    with SpawnPool(world, backend="nccl") as pool:
        got = losses(pool.run(spec(layout), timeout_s=540))
    torch.testing.assert_close(got[0], reference[0], rtol=2e-4, atol=0)
    torch.testing.assert_close(got, reference, rtol=1e-3, atol=0)
