"""The step-time model against published training runs (workbench/calibration.yaml).

The constants marked "fitted" in workbench/steptime.py come from the `fit` rows only (at most a
third of the set, chosen by the rule at the top of each section of the file); the held-out rows
are what the model is judged on.
"""
import pytest

from workbench.calibration import errors, load_cases, priced

CASES = errors()
HELD_OUT = [(c, p, q) for c, p, q in CASES if c.split == "held_out"]
# Held-out rows the model misses by more than 25%, each with what we know of why. xfail(strict):
# when a change brings one inside, the test fails until it leaves this list.
KNOWN_MISSES = {
    "llama3-405b-16k": "Meta's 16k-GPU run: its pipeline schedule and overlap are Meta's own (not published in detail); predicted 0.65x",
    "mcore-gpt-32b-384": "Megatron-Core tp 8 x dp 48: the fp32 gradient reduce-scatter over one NIC per rank is priced exposed; the published run hides it (0.70x)",
    "mcore-gpt-177b-strong-4608": "Megatron-Core strong-scaling end point: 1F1B assumed with 12 micro-batches per pipeline (the README's interleaving is not given); 0.71x",
    "mpt-13b-h100-s2048-g16-mb2": "llm-foundry 13B on H100 at micro-batch 2: 1.27x, as its neighbours at g32/g64; the 13B H100 rows run below the other sizes' MFU",
    "mpt-13b-h100-s2048-g32-mb2": "as mpt-13b-h100-s2048-g16-mb2",
    "mpt-13b-h100-s2048-g64-mb2": "as mpt-13b-h100-s2048-g16-mb2",
    "mpt-70b-a100-40-s2048-g64-mb2": "llm-foundry 70B on 64 A100-40GB at micro-batch 2 with full recompute: 1.37x (memory pressure on a 40 GB card: the allocator's retries are not modelled)",
    "mpt-1b-a100-40-s2048-g32-mb10": "llm-foundry 1B on 32 A100-40GB: 1.27x while the same model on 8 and 16 GPUs is within 10%",
}


def test_every_case_cites_its_source_and_the_fit_split_is_at_most_a_third():
    cases = load_cases()
    assert {c.split for c in cases} == {"fit", "held_out"}
    assert 3 * sum(c.split == "fit" for c in cases) <= len(cases)
    for c in cases:
        assert c.source and c.where and c.attention in ("flash", "unfused")
        assert c.flops in ("megatron", "model")
        assert c.global_batch % (c.layout["dp"] * c.micro_batch) == 0
        assert not (c.split == "fit" and not c.catalog_match), f"{c.name}: fitted on hardware the catalog lacks"
    assert sum(not priced(c) for c in cases) < len(cases) / 10  # fp8 rows are the only ones not priced


@pytest.mark.parametrize(
    "case, predicted, published",
    [pytest.param(c, p, q, id=c.name, marks=[pytest.mark.xfail(reason=KNOWN_MISSES[c.name], strict=True)]
                  if c.name in KNOWN_MISSES else []) for c, p, q in HELD_OUT])
def test_held_out_within_25_percent_of_published_tokens_per_s_per_gpu(case, predicted, published):
    assert predicted == pytest.approx(published, rel=0.25), f"{case.name}: {case.where}"


def test_held_out_errors_summary():
    """docs/planning.md quotes these: most held-out rows within 20%, the mean error under 10%."""
    errs = [abs(p / q - 1) for _, p, q in HELD_OUT]
    assert len(errs) >= 150
    assert sum(e <= 0.20 for e in errs) >= 0.9 * len(errs)
    assert sum(errs) / len(errs) < 0.10


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
