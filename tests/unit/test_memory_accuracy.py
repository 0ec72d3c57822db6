"""Predicted memory against the runtime's measured memory events, on 2 gloo ranks."""
import pytest

from bench.memory_compare import LAYOUTS, THRESHOLDS, build_spec, compare, runnable

# A few layouts; the ones the runtime does not run yet are reported, not silently passed.
CHOSEN = ("dp2", "dp2 zero1 bf16", "dp2 zero3", "dp2 full ckpt", "dp2 zero3 offload cpu", "tp2 bf16", "pp2 1f1b bf16")


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_predicted_memory_matches_measured_within_thresholds(pool2):
    jobs = [(label, build_spec("gpt-tiny", layout, dtype)) for label, layout, dtype in LAYOUTS if label in CHOSEN]
    runnable_jobs = [(label, spec) for label, spec in jobs if runnable(spec) is None]
    assert runnable_jobs, "the runtime runs none of the chosen layouts"
    rows = []
    for label, spec in runnable_jobs:
        rows += compare("gpt-tiny", label, spec, pool2.run(spec, timeout_s=120))
    assert {r.rank for r in rows} == {0, 1}
    assert {"params", "activations"} <= {r.component for r in rows}
    over = [f"{r.layout} rank {r.rank} {r.component}: predicted {r.predicted} measured {r.measured} "
            f"({r.error:+.1%} > {THRESHOLDS[r.component]:.0%})" for r in rows if not r.within]
    assert not over, "\n".join(over)
