"""How the suite starts a process it must be able to end with everything that process started.

`OWN_GROUP`: a process group of its own (`os.killpg(proc.pid, sig)` reaches the process and its
children), inside pytest's session. Not `start_new_session=True`: with Linux's autogroup (on by
default, /proc/sys/kernel/sched_autogroup_enabled) every session is a scheduling group of its
own, and on a loaded host (one busy process per core beside the suite) processes in sessions of
their own were left runnable for minutes with 2-4 % of a core (docs/testing.md). Python 3.10 has
no `process_group`; there the new session is the only way to a group of its own.
"""
import sys

OWN_GROUP: dict = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
