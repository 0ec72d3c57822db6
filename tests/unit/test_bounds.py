"""Bounds of issue #32: the fast stage split equals the exact one, specs at the bounds plan in
bounded time, and `workbench validate` refuses exactly what `workbench run` refuses before any
worker starts, over the whole layout matrix."""
from __future__ import annotations

import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import workbench.launch as launch
from tests.unit.test_layout_matrix import combinations, raw_spec
from workbench import cli
from workbench.errors import ConfigError
from workbench.memory.params import balance_blocks, balance_uniform


@settings(derandomize=True, max_examples=300, deadline=None, database=None)
@given(n=st.integers(1, 48), data=st.data(), block=st.integers(1, 60), first=st.integers(0, 600),
       last=st.integers(0, 600))
def test_uniform_split_equals_the_exact_split(n, data, block, first, last):
    stages = data.draw(st.integers(1, n))
    assert balance_uniform(n, block, first, last, stages) == balance_blocks((block,) * n, first, last, stages)


def test_a_deep_model_plans_without_an_object_per_layer():
    from workbench.memory import estimate_memory

    spec = {"model": {"preset": "gpt-tiny", "layers": 65536}, "layout": {"dp": 1, "pp": 1024},
            "train": {"global_batch": 1024, "micro_batch": 1}}
    est = estimate_memory(spec)
    assert est.world_size == 1024 and len({r.coords["pp"] for r in est.per_rank}) == 1024


@pytest.mark.parametrize("sets, needle", [
    ({"model": {"preset": "gpt-tiny", "layers": 100000000}}, "model.layers: Input should be less than or equal to 65536"),
    ({"layout": {"dp": 2**63}}, "beyond 63 bits"),
    ({"layout": {"dp": 1024, "tp": 1024}, "resources": {"nodes": 1024}}, "more than 131,072"),
    ({"layout": {"pp": 4, "virtual_stages": 512, "pp_schedule": "interleaved-1f1b"}}, "pipeline stages, more than 1,024"),
    ({"train": {"global_batch": 10**18}}, "train.global_batch: Input should be less than or equal to 1048576"),
])
def test_bounds_name_the_rule_and_the_numbers(sets, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        launch.load_spec(sets)


class _Started(Exception):
    pass


def test_validate_refuses_exactly_what_run_refuses_over_the_layout_matrix(monkeypatch):
    """For each of the 12,960 layouts: `workbench validate`'s check and `workbench run`'s pre-start
    checks (launch.run up to the worker start) both accept, or both refuse with the same message."""
    def stop(*_a, **_k):
        raise _Started

    monkeypatch.setattr(launch, "start", stop)
    counts = {"both accept": 0, "both refuse": 0}
    for c in combinations():
        raw = raw_spec(c)
        try:
            cli._validate(argparse.Namespace(spec=raw, overrides=[], trust_factory=False, resume=False,
                                             resume_or_fresh=False))
            validate = None
        except ConfigError as e:
            validate = str(e)
        try:
            launch.run(raw, progress=False)
        except _Started:
            run = None
        except ConfigError as e:
            run = str(e)
        assert validate == run, (c, validate, run)
        counts["both accept" if run is None else "both refuse"] += 1
    assert counts == {"both accept": 3996, "both refuse": 8964}
