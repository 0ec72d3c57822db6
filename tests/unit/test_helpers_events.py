"""The shared event readers (tests/helpers/events.py) every parity, resume and chaos test reads its
losses with: one attempt's series in step order, and a list holding two attempts refused."""
import pytest

from tests.helpers.events import final_state, loss_by_step, losses, measured, series
from tests.helpers.specs import tiny_gpt, world


def step(k: int, loss: float) -> dict:
    return {"event": "step", "step": k, "loss": loss, "lr": 0.1 * k}


# What SpawnPool.run gives for 2 ranks: rank 1's events may come first; only rank 0 has steps.
TWO_RANKS = [{"event": "memory", "step": 1, "rank": 1, "measured": {"peak": 7}},
             {"event": "memory", "step": 1, "rank": 0, "measured": {"peak": 5}},
             step(1, 4.0), {"event": "eval", "step": 2, "loss": 3.5}, step(2, 3.0),
             {"event": "memory", "step": 3, "rank": 0, "measured": {"peak": 6}}, step(3, 2.0),
             {"event": "state", "state": {"w": 1}}, {"event": "end", "status": "completed", "step": 3}]


def test_one_attempt_reads_in_step_order():
    assert losses(TWO_RANKS) == [4.0, 3.0, 2.0]
    assert losses(TWO_RANKS, "eval") == [3.5]
    assert loss_by_step(TWO_RANKS) == {1: 4.0, 2: 3.0, 3: 2.0}
    assert series(TWO_RANKS, "step") == [1, 2, 3] and series(TWO_RANKS, "lr") == pytest.approx([0.1, 0.2, 0.3])
    assert measured(TWO_RANKS) == {"peak": 6} and measured(TWO_RANKS, rank=1) == {"peak": 7}  # the rank's last
    assert final_state(TWO_RANKS) == {"w": 1}


@pytest.mark.parametrize("events,cut", [
    ([step(1, 4.0), step(2, 3.0), {"event": "restart", "attempt": 1, "from_step": 1}, step(2, 3.0)], 2),  # a restart
    ([step(2, 3.0), step(1, 4.0)], 1),  # steps going backwards: two runs' events, or a broken loop
])
def test_events_of_two_attempts_are_refused_not_merged(events, cut):
    with pytest.raises(AssertionError, match="more than one attempt"):
        losses(events)
    with pytest.raises(AssertionError, match="more than one attempt"):
        loss_by_step(events)
    assert losses(events[:cut]) and losses(events[cut:])  # each attempt alone reads


def test_missing_state_and_memory_are_errors():
    with pytest.raises(AssertionError, match="0 state events"):
        final_state([step(1, 1.0)])
    with pytest.raises(AssertionError, match="no memory event from rank 2"):
        measured(TWO_RANKS, rank=2)


def test_tiny_gpt_spec():
    assert tiny_gpt() == {"name": "tiny", "model": {"preset": "gpt-tiny"},
                          "train": {"steps": 6, "global_batch": 8, "micro_batch": 4}}
    spec = tiny_gpt("/ckpt", name="x", steps=2, micro_batch=2, model={"tie_embeddings": True}, layout={"dp": 2},
                    dtype="bf16", train={"lr": 1e-2}, every_steps=1)
    assert spec == {"name": "x", "model": {"preset": "gpt-tiny", "tie_embeddings": True},
                    "train": {"steps": 2, "global_batch": 8, "micro_batch": 2, "lr": 1e-2}, "layout": {"dp": 2},
                    "precision": {"dtype": "bf16"}, "checkpoint": {"uri": "/ckpt", "every_steps": 1}}
    with pytest.raises(AssertionError, match="without a uri"):
        tiny_gpt(every_steps=1)
    assert world({"dp": 2, "tp": 2}) == 4 and world({}) == 1
