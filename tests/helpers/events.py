"""Reading a run's metrics events (what `train`'s sink, `SpawnPool.run`, a backend's `handle.events`
or a metrics JSONL give) the one way every test reads them.

Which rank. `step` and `eval` events come from rank 0 only and carry no rank: their loss is the
dp-mean over the global batch, the same number on every rank. `memory` and `timeline` events come
from every rank and carry `rank`: `measured` picks one (rank 0 unless told). `state` (from
`train_with_state`) is rank 0's gathered full fp32 weights.

Which order. Series are by step, which is also the order rank 0 emits them in. A list in which a
step comes twice, or steps go backwards, holds more than one attempt (a restart inside one run, a
resume appended to its first run, events of two runs): that is an AssertionError, not a silent
choice of one of them; slice the events at the `restart` event first. `SpawnPool`
concatenates the ranks' lists in the order the ranks finish; only rank 0 emits step and eval
events, so that order never matters here.
"""
from __future__ import annotations


def of_one_attempt(events: list[dict], kind: str = "step") -> list[dict]:
    """The `kind` events ("step" or "eval"), checked to be of one attempt: steps strictly increasing."""
    picked = [e for e in events if e["event"] == kind]
    steps = [e["step"] for e in picked]
    assert all(a < b for a, b in zip(steps, steps[1:])), (
        f"{kind} events of more than one attempt (steps {steps}): slice them at the restart event first")
    return picked


def series(events: list[dict], key: str = "loss", kind: str = "step") -> list:
    """`key` ("loss", "lr", "step", "perplexity"...) of the `kind` events of one attempt, in step order."""
    return [e[key] for e in of_one_attempt(events, kind)]


def losses(events: list[dict], kind: str = "step") -> list[float]:
    """The losses of the `kind` events ("step" or "eval") of one attempt, in step order."""
    return series(events, "loss", kind)


def loss_by_step(events: list[dict], kind: str = "step") -> dict[int, float]:
    """step -> loss of one attempt: for runs that start later than step 1 (a resume) or joined parts."""
    return {e["step"]: e["loss"] for e in of_one_attempt(events, kind)}


def final_state(events: list[dict]) -> dict:
    """The full fp32 weights by name from the one `state` event (`train_with_state`, rank 0)."""
    states = [e["state"] for e in events if e["event"] == "state"]
    assert len(states) == 1, f"{len(states)} state events (train_with_state sinks exactly one, from rank 0)"
    return states[0]


def measured(events: list[dict], rank: int = 0) -> dict:
    """`measured` of `rank`'s last memory event (the last step it measured)."""
    mine = [e["measured"] for e in events if e["event"] == "memory" and e["rank"] == rank]
    assert mine, f"no memory event from rank {rank}"
    return mine[-1]

