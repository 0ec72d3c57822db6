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
import subprocess
import sys

from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
from torch.distributed.run import main


def _popen(*args, start_new_session: bool = False, **kwargs) -> subprocess.Popen:
    if start_new_session and sys.version_info >= (3, 11):
        return subprocess.Popen(*args, process_group=0, **kwargs)
    return subprocess.Popen(*args, start_new_session=start_new_session, **kwargs)


if __name__ == "__main__":
    subprocess_handler.Popen = _popen  # the name torchelastic's SubprocessHandler calls
    main()
