"""Run the per-rank loop on N local gloo processes without Ray: parity tests and benchmarks.

`SpawnPool` keeps its processes alive across jobs, because starting them (torch import) costs
seconds each on a small machine; every job gets a fresh process group.
"""
from __future__ import annotations

import gc
import glob
import itertools
import os
import queue
import tempfile
import traceback

import torch.multiprocessing as mp

from workbench.errors import WorkerError

_STOP = "__stop__"


def _worker(rank: int, world: int, rendezvous: str, jobs, results, threads: int, backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if backend == "nccl":
        torch.cuda.set_device(rank)  # one GPU per rank
    from workbench.runtime.loop import train

    for num_job in itertools.count():
        job = jobs.get()
        if job == _STOP:
            break
        fn, spec = job
        # A process group per job, destroyed with every group the job made (its mesh's dp/tp/pp
        # groups): each gloo group keeps threads polling its sockets, so groups left from earlier
        # jobs pile up in a long-lived pool (9 threads per dp=2 ZeRO-3 job) and load the machine.
        # A file rendezvous, one per job: a free TCP port found in advance can be taken by another
        # process before rank 0 binds it.
        dist.init_process_group(backend, init_method=f"file://{rendezvous}.{num_job}", rank=rank, world_size=world)
        events: list[dict] = []
        try:
            if fn is None:
                train(spec, events.append)
            else:
                fn(spec, events.append)
            results.put((rank, events, None))
        except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
            results.put((rank, events, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        finally:
            dist.destroy_process_group()
            gc.collect()  # the job's model, optimizer and mesh hold its groups in reference cycles


class SpawnPool:
    """`world` processes (gloo, or nccl with one GPU each) that run jobs one after another.

    Usage:
        with SpawnPool(2) as pool:
            events = pool.run(spec_dict)
    """

    def __init__(self, world: int, threads_per_rank: int = 1, backend: str = "gloo"):
        self.world = world
        ctx = mp.get_context("spawn")
        self._jobs = [ctx.Queue() for _ in range(world)]
        self._results = ctx.Queue()
        # This empty file reserves the name; the jobs' rendezvous files are `<name>.<job>`, each
        # new (a stale one would hold old ranks).
        fd, self._rendezvous = tempfile.mkstemp(prefix="workbench-pg-")
        os.close(fd)
        self._procs = [
            ctx.Process(target=_worker, args=(r, world, self._rendezvous, self._jobs[r], self._results, threads_per_rank,
                                              backend), daemon=True)
            for r in range(world)
        ]
        for p in self._procs:
            p.start()

    def run(self, spec: dict, fn=None, timeout_s: float = 300) -> list[dict]:
        """Run `fn(spec, sink)` (default: the training loop) on every rank; return all events.

        Raises:
            WorkerError: a rank failed (its traceback is in the message) or the job timed out.
        """
        for q in self._jobs:
            q.put((fn, spec))
        events, errors = [], []
        for _ in range(self.world):
            try:
                rank, rank_events, error = self._results.get(timeout=timeout_s)
            except queue.Empty:
                self.close()
                raise WorkerError(f"spawned job did not finish within {timeout_s} s") from None
            events.extend(rank_events)
            if error:
                errors.append(f"rank {rank}: {error}")
        if errors:
            self.close()
            raise WorkerError("\n".join(errors))
        return events

    def close(self) -> None:
        for q, p in zip(self._jobs, self._procs):
            if p.is_alive():
                q.put(_STOP)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        for path in [*glob.glob(glob.escape(self._rendezvous) + ".*"), self._rendezvous]:
            if os.path.exists(path):
                os.unlink(path)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

