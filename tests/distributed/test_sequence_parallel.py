"""Megatron-style sequence parallelism: the column-parallel linears keep the sequence shard and
all-gather it again in backward, so a block's activations are divided by tp (Korthikanti et al.
2022) and the memory model's prediction is what the runtime measures; losses match one process."""
import pytest

from bench.memory_compare import build_spec, compare
from tests.helpers.events import losses
from tests.helpers.reference import reference_run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def test_sequence_parallel_memory_is_predicted_and_losses_match(spawn_pools):
    reference = reference_run(build_spec("gpt-tiny", {}, "fp32")).losses()
    rows = {}
    for label, layout in (("tp2", {"tp": 2}), ("tp2 sp", {"tp": 2, "sequence_parallel": True})):
        spec = build_spec("gpt-tiny", layout, "fp32")
        events = spawn_pools.get(2).run(spec, timeout_s=240)
        assert losses(events) == pytest.approx(reference, rel=1e-5)
        rows[label] = {(r.rank, r.component): r for r in compare("gpt-tiny", label, spec, events)}
    for r in rows["tp2 sp"].values():
        assert r.within, f"{r.component} rank {r.rank}: predicted {r.predicted} measured {r.measured} ({r.error:+.1%})"
    act_sp, act_tp = rows["tp2 sp"][(0, "activations")], rows["tp2"][(0, "activations")]
    # Blocks divide by tp; the embedding, head and logits do not: 0.81x of tp2 for gpt-tiny, where
    # DTensor's sequence parallel (keeping the gathered inputs) measured 0.90x (docs/memory-accuracy.md).
    assert act_sp.measured < 0.85 * act_tp.measured
