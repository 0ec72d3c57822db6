"""The launcher's death is a preemption notice (runtime/preemption.py): SIGHUP, which Linux may
repeat once per dying launcher thread, never exits at once; a second SIGTERM still does."""
import os
import signal
import subprocess
import sys
import time

import pytest

from workbench.runtime.preemption import PreemptionNotice


def test_repeated_sighup_is_one_notice_and_a_second_sigterm_exits():
    with PreemptionNotice() as notice:
        for _ in range(3):
            os.kill(os.getpid(), signal.SIGHUP)
        assert notice.requested
        os.kill(os.getpid(), signal.SIGTERM)  # the first SIGTERM: still the same notice
        with pytest.raises(SystemExit) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
    assert stop.value.code == 128 + signal.SIGTERM


def test_a_child_gets_the_notice_when_its_parent_is_killed(tmp_path):
    """stop_with_parent: a process whose parent dies by SIGKILL receives the notice."""
    marker = tmp_path / "noticed"
    child = ("import time, sys; from workbench.runtime.preemption import PreemptionNotice, stop_with_parent\n"
             "with PreemptionNotice() as n:\n"
             "    stop_with_parent(); print('ready', flush=True)\n"
             "    while not n.requested: time.sleep(0.01)\n"
             f"open({str(marker)!r} + '.tmp', 'w').write('yes'); import os; os.replace({str(marker)!r} + '.tmp', {str(marker)!r})\n")
    parent = ("import subprocess, sys\n"
              f"p = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE, text=True)\n"
              "print(p.pid, p.stdout.readline().strip(), flush=True)\n"
              "import time; time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    _, ready = proc.stdout.readline().split()
    assert ready == "ready"
    proc.kill()
    proc.wait(timeout=60)
    deadline = time.monotonic() + 120  # the child stops by itself once noticed; this only bounds a failure
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert marker.read_text() == "yes"
