"""The fast loop keeps one case of each strategy and feature; the rest of a matrix runs in the whole
suite (`slow`), as docs/testing.md's markers table says."""
import pytest


def fast_first(names, fast) -> list:
    """`names` as parametrize values: those in `fast` run in the fast loop, the others are `slow`."""
    names, fast = list(names), set(fast)
    unknown = fast - set(names)
    assert not unknown, f"fast cases {sorted(unknown)} are not in the matrix"
    return [pytest.param(n, marks=[] if n in fast else [pytest.mark.slow]) for n in names]
