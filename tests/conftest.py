"""Suite-wide rules and fixtures: GPU tests are skipped without CUDA; gloo process pools are
shared by every test module of the session (unit, distributed and integration alike)."""
import gc

import pytest
import torch

from workbench.runtime.spawn import SpawnPool


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After each module, with its fixtures gone, what is left lives for the session (imported
    modules, session fixtures, caches): frozen, Python's full collections stop walking it again.
    This process holds ~1.4 M objects by the end; its full collections took 16 s of the fast
    loop's unit tests, 6.5 s frozen (docs/testing.md). Refcounting still frees frozen objects."""
    result = yield
    if nextitem is None or nextitem.module is not item.module:
        gc.collect()
        gc.freeze()
    return result


class _Pools:
    """One persistent SpawnPool per world size. Starting one costs a process per rank (torch
    import, process group: 5-15 s on a small machine), so modules share them. A pool whose job
    failed is closed by SpawnPool.run; `get` then starts a fresh one."""

    def __init__(self):
        self._pools: dict[int, SpawnPool] = {}

    def get(self, world: int) -> SpawnPool:
        pool = self._pools.get(world)
        if pool is None or not all(p.is_alive() for p in pool._procs):
            pool = self._pools[world] = SpawnPool(world)
        return pool

    def close(self):
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(scope="session")
def spawn_pools():
    """`spawn_pools.get(world)` -> a SpawnPool(world) shared by the whole session."""
    pools = _Pools()
    yield pools
    pools.close()


@pytest.fixture
def pool2(spawn_pools):
    return spawn_pools.get(2)


@pytest.fixture(autouse=True)
def _isolated_profiles(tmp_path_factory, monkeypatch):
    """No test reads or writes the user's hardware profiles (~/.workbench/profiles): each test gets
    a WORKBENCH_HOME of its own and no WORKBENCH_PROFILE (workbench/hwprofile.py)."""
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path_factory.mktemp("workbench_home")))
    monkeypatch.delenv("WORKBENCH_PROFILE", raising=False)
