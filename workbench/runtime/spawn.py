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
import signal
import tempfile
import time
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

    # What the imports made lives as long as the process: kept out of every collection (below), a
    # job's gc.collect() walks only what the job made (0.11 s -> 0.01 s per job and rank).
    gc.freeze()
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
            gc.freeze()  # what is left lives on (modules a job imported, caches)


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

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, in rank order (e.g. to put them in a memory cgroup)."""
        return [p.pid for p in self._procs]

    def run(self, spec: dict, fn=None, timeout_s: float = 300) -> list[dict]:
        """Run `fn(spec, sink)` (default: the training loop) on every rank; return all events.

        Raises:
            WorkerError: a rank failed (its traceback is in the message), a rank's process died
                (killed by a signal, e.g. SIGKILL from the OOM killer: named at once, the other
                ranks, stuck in a collective with it, are killed), or the job timed out.
        """
        for q in self._jobs:
            q.put((fn, spec))
        events, errors = [], []
        deadline = time.monotonic() + timeout_s
        for _ in range(self.world):
            while True:
                try:
                    # Short waits: a rank killed by a signal never puts its result, so between
                    # waits the processes are checked instead of waiting out the whole timeout.
                    wait = min(1.0, max(deadline - time.monotonic(), 0.0))
                    rank, rank_events, error = self._results.get(timeout=wait)
                    break
                except queue.Empty:
                    dead = self._dead()
                    if dead:
                        self._abort()
                        raise WorkerError(dead) from None
                    if time.monotonic() >= deadline:
                        self.close()
                        raise WorkerError(f"spawned job did not finish within {timeout_s} s") from None
            events.extend(rank_events)
            if error:
                errors.append(f"rank {rank}: {error}")
        if errors:
            self.close()
            raise WorkerError("\n".join(errors))
        return events

    def _dead(self) -> str:
        """What ended the pool's processes that are gone ("" when all live): a worker only exits
        on _STOP, so during a job any exit is a failure."""
        out = []
        for rank, p in enumerate(self._procs):
            code = p.exitcode
            if code is None:
                continue
            if code < 0:
                name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
                hint = (" (the kernel's OOM killer sends SIGKILL when memory runs out: see dmesg, or the "
                        "memory limit of the job's cgroup)") if -code == signal.SIGKILL else ""
                out.append(f"rank {rank} (pid {p.pid}) was killed by {name} while running a job{hint}")
            else:
                out.append(f"rank {rank} (pid {p.pid}) exited with code {code} while running a job")
        return "; ".join(out)

    def _abort(self) -> None:
        """Kill every process now: the live ranks wait in a collective on the dead one."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        self.close()

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

