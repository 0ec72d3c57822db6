"""The step-time model against published training runs (workbench/calibration.yaml)."""
import pytest

from workbench.calibration import errors, load_cases

CASES = errors()


def test_every_case_cites_its_source_and_both_splits_exist():
    cases = load_cases()
    assert {c.split for c in cases} == {"fit", "held_out"}
    assert sum(c.split == "held_out" for c in cases) >= sum(c.split == "fit" for c in cases)
    for c in cases:
        assert c.source and c.where and c.attention in ("flash", "unfused") and c.flops in ("megatron", "model")
        assert c.global_batch % (c.layout["dp"] * c.micro_batch) == 0


@pytest.mark.parametrize("case, predicted, published", CASES, ids=[c.name for c, _, _ in CASES])
def test_within_20_percent_of_published_tokens_per_s_per_gpu(case, predicted, published):
    assert predicted == pytest.approx(published, rel=0.20), f"{case.name}: {case.where}"


def test_megatron_table1_rises_with_model_size_as_published():
    """Table 1's TFLOP/s per GPU rises from 137 (1.7B) to 163 (1T); the model must not be flat."""
    table1 = [(c, p) for c, p, _ in CASES if c.name.startswith("megatron-")]
    tflops = {c.name: p * c.tflops_per_gpu / c.published_tokens_per_s_per_gpu() for c, p in table1}
    assert tflops["megatron-145.6b"] > tflops["megatron-18.4b"] * 1.03


def test_mis_cited_anchor_is_the_145b_row():
    """148 TFLOP/s on 1536 GPUs is Table 1's 145.6B (80 layers, pp 8); GPT-3 175B (pp 12) is Table 2."""
    c = {c.name: c for c in load_cases()}
    assert c["megatron-145.6b"].tflops_per_gpu == 148 and c["megatron-145.6b"].model["layers"] == 80
    assert c["gpt3-175b-ptdp-1536"].tflops_per_gpu == 141 and c["gpt3-175b-ptdp-1536"].layout["pp"] == 12
