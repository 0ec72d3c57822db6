"""Comparisons of saved states used by several test modules."""
import torch


def assert_same_state(a: dict, b: dict) -> None:
    """Two MasterOptimizer.state_dict()s hold the same step count and the same tensors per name."""
    assert a.keys() == b.keys() and a["num_steps"] == b["num_steps"]
    for kind in a.keys() - {"num_steps"}:
        assert a[kind].keys() == b[kind].keys()
        for name in a[kind]:
            assert torch.equal(a[kind][name], b[kind][name]), (kind, name)
