"""SpawnPool fails fast when a rank's process dies (as under the OOM killer): the error names the
rank and the signal, and the live ranks, blocked in a collective with the dead one, do not hold
the job until its timeout."""
import os
import signal
import time

import pytest

from workbench.errors import WorkerError
from workbench.runtime.spawn import SpawnPool

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def nothing(spec: dict, sink) -> None:
    sink({"event": "ok"})


def kill_rank_1(spec: dict, sink) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does
    dist.barrier()  # rank 0 waits here for a rank that will never come


def test_a_killed_rank_fails_the_job_at_once_naming_rank_and_signal():
    pool = SpawnPool(2)
    try:
        assert len(pool.run({}, fn=nothing, timeout_s=90)) == 2  # the ranks are up (torch imported)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL.*OOM killer"):
            pool.run({}, fn=kill_rank_1, timeout_s=90)
        elapsed = time.monotonic() - start
        assert elapsed < 20, f"took {elapsed:.1f} s to notice the dead rank (the job's timeout is 90 s)"
        assert not any(p.is_alive() for p in pool._procs)  # rank 0, stuck in the barrier, was killed too
    finally:
        pool.close()
