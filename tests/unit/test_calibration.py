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
    # (llama3-405b-16k was 0.65x with 2 virtual stages assumed; the paper's sec. 3.3.2 gives its split, one layer per
    # chunk with the first chunk only the embedding and the last only the head: 8 virtual stages, 0.82x now.)
    # (llm-foundry's 13B H100 rows at micro-batch 2 were 1.27x until FSDP1's BACKWARD_POST prefetch, Composer's
    # default for those runs, was priced: 1.12-1.14x now; the 1B row on 32 A100-40GB is 1.25x, at the limit.)
    "mcore-gpt-32b-384": "Megatron-Core r0.8 tp 8 x dp 48: the source confirms what is priced (bf16 forces "
                         "accumulate_allreduce_grads_in_fp32, arguments.py 299-305 at f2e5db4: an fp32 "
                         "reduce-scatter of 16 GB per rank; launched only in the last micro-batch's backward, "
                         "param_and_grad_buffer.py register_grad_ready): over the node's 8 x 400 Gb/s it needs "
                         ">= 0.31 s at line rate, so at micro-batch 1 (4 micro-batches) the published 0.89 s step is "
                         "out of reach; the README gives no micro-batch (at 2: 0.85x, at 4: 1.02x); 0.70x",
    "mcore-gpt-177b-strong-4608": "Megatron-Core strong-scaling end point (layout assumed tp 8 x pp 6, micro-batch 1, "
                                  "12 micro-batches): the README's 'pipeline-parallel communication overlap (enabled by "
                                  "default)' implies the interleaved schedule (arguments.py 254-276 at f2e5db4 turns it "
                                  "off otherwise) but the virtual stages are not given; under 1F1B the bubble is 29% and "
                                  "the published 47% -> 42% MFU drop is unreachable (v 2: 0.82x, v 4: 0.88x); 0.71x",
    "mpt-70b-a100-40-s2048-g64-mb2": "llm-foundry 70B on 64 A100-40GB at micro-batch 2, one micro-batch per step, full "
                                     "recompute: 1.28x, where the same model on 128 A100-40GB (micro-batch 4) is 0.98x; "
                                     "the table prints nothing that differs but the micro-batch (a 40 GB card near "
                                     "full: the allocator's retries are not printed)",
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
