"""bench/gpu/train_1b.py's CPU path: the same code the GPU run takes, with a tiny model."""
import json

import pytest


@pytest.mark.timeout(120)
def test_train_1b_cpu_smoke(tmp_path):
    from bench.gpu import train_1b

    out = tmp_path / "gpu.json"
    result = train_1b.main(["--device", "cpu", "--preset", "gpt-tiny", "--steps", "4", "--warmup", "1", "--reps", "1",
                            "--global-batch", "4", "--micro-batch", "2", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["name"] == "gpu_1b" and saved["config"]["device"] == "cpu"
    for v in result["variants"].values():
        assert v["tokens_per_s"]["median"] > 0
    # same model, same data, both bf16: the first losses agree closely
    rt, plain = result["first_losses"]["runtime"], result["first_losses"]["plain"]
    assert rt[0] == pytest.approx(plain[0], rel=2e-2)


def test_flops_and_catalog_names():
    from bench.gpu.train_1b import flops_per_token, gpu_catalog_name
    from workbench.spec import load_spec

    shape = load_spec({"model": {"preset": "gpt-1.3b"}}).model.shape()
    assert 1.2e9 < shape.num_params() < 1.5e9
    assert flops_per_token(shape) == 6 * shape.num_params() + 12 * 24 * 2048 * 2048
    assert gpu_catalog_name("NVIDIA H200") == "h200" and gpu_catalog_name("NVIDIA H100 80GB HBM3") == "h100-80gb"
