"""The reference run that parity, resume and chaos tests compare their runs against: the same spec,
uninterrupted, from step 1."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from tests.helpers.events import final_state, loss_by_step, losses
from workbench.runtime.loop import train, train_with_state


@dataclass(frozen=True)
class Reference:
    events: list[dict]
    state: dict | None = None  # full fp32 weights by name after the last step (gather_state)

    def losses(self, kind: str = "step") -> list[float]:
        """The `kind` ("step" or "eval") losses in step order (tests.helpers.events.losses)."""
        return losses(self.events, kind)

    def loss_by_step(self, kind: str = "step") -> dict[int, float]:
        return loss_by_step(self.events, kind)


# In-process references by (spec, gather_state), for the whole session: the parity modules share
# specs (test_parity_dp, test_parity_tp_pp and test_parity_3d train the same BASE). Training in
# one process is deterministic, so a second module gets the first one's run, copied.
_DONE: dict[str, Reference] = {}


def reference_run(spec: dict, *, gather_state: bool = False, pool=None, timeout_s: float = 240) -> Reference:
    """`spec` trained uninterrupted. Without `pool`: in this process (`train`, no process group),
    the single-process reference of a parity test, computed once per session for a spec without a
    checkpoint or tracking section (with one it writes files a test may read: it always trains). With `pool`
    (a SpawnPool): on its ranks, as `pool.run(spec, timeout_s=timeout_s)` (with
    `train_with_state` when `gather_state`).

    The run must complete: a reference cut short would let every comparison pass on a prefix."""
    key = json.dumps([spec, gather_state], sort_keys=True, default=str)
    if pool is None and not {"checkpoint", "tracking"} & set(spec):
        if key not in _DONE:
            _DONE[key] = _run(spec, gather_state, None, timeout_s)
        return copy.deepcopy(_DONE[key])
    return _run(spec, gather_state, pool, timeout_s)


def _run(spec: dict, gather_state: bool, pool, timeout_s: float) -> Reference:
    if pool is None:
        events: list[dict] = []
        result = train(spec, events.append, gather_state=gather_state)
        state = result.get("state") if gather_state else None
    else:
        events = pool.run(spec, fn=train_with_state if gather_state else None, timeout_s=timeout_s)
        state = final_state(events) if gather_state else None
    ends = [e for e in events if e["event"] == "end"]
    assert [e["status"] for e in ends] == ["completed"], f"the reference run did not complete: {ends}"
    if gather_state:
        assert state, "the reference run gathered no state"
    return Reference(events, state)
