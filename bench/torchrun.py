"""`python -m bench.torchrun ARGS` is `torchrun ARGS` (torch.distributed.run), except that each
rank gets a process group of its own inside the caller's session instead of a session of its own.

The benchmarks compare the same training under Ray and under torchrun, so both arms' ranks must
compete for the CPU on the same terms. torchelastic starts every rank with
`start_new_session=True`, and with Linux's autogroup (on by default; see
/proc/sys/kernel/sched_autogroup_enabled) every session is a scheduling group of its own, while
the Ray arm's ranks stay in the benchmark's session. On a host with one busy process per core
the torchrun arm's ranks were left runnable for minutes with 2-4 % of a core (docs/testing.md).
torchelastic ends a rank with `os.killpg(rank_pid, sig)`, which a process group of its own keeps
working.
"""
from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
from torch.distributed.run import main

from bench.common import popen_own_group

if __name__ == "__main__":
    subprocess_handler.Popen = popen_own_group  # the name torchelastic's SubprocessHandler calls
    main()
