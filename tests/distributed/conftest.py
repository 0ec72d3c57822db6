"""Shared fixtures for multi-process tests: one persistent gloo pool per world size per session.

Starting a process group costs 5-15 s on a small machine, so test modules share pools. A pool
whose job failed is closed by SpawnPool.run; the fixture then starts a fresh one.
"""
import pytest

from workbench.runtime.spawn import SpawnPool


class _Pools:
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
