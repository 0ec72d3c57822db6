"""How the suite starts a process it must be able to end with everything that process started.

`OWN_GROUP`: a process group of its own (`os.killpg(proc.pid, sig)` reaches the process and its
children), inside pytest's session. Not `start_new_session=True`: with Linux's autogroup (on by
default, /proc/sys/kernel/sched_autogroup_enabled) every session is a scheduling group of its
own, and on this machine's kernel a process in another session than busy ones got 2-5 % of a
core (docs/testing.md, "Under load"). Python 3.10 has no `process_group`; there the new session
is the only way to a group of its own.

`popen_own_group`: `subprocess.Popen` for a launcher that asks for a session of its own
(jupyter_client starts every kernel so): a process group of its own instead. bench/torchrun.py
does the same for torchrun's ranks.
"""
import subprocess
import sys

OWN_GROUP: dict = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}


def popen_own_group(*args, start_new_session: bool = False, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(*args, **kwargs, **(OWN_GROUP if start_new_session else {}))
