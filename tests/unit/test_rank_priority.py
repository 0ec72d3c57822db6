"""A rank's scheduling priority: Ray starts its workers at nice 15 (a `ray start` cluster's
default `worker_niceness`) and a rank inherits its worker's; the rank takes nice 0 back where the
OS allows it (root, CAP_SYS_NICE), and otherwise runs on at Ray's value."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ("import os; from backends.ray_relay import _normal_priority; _normal_priority(); "
         "print(os.getpriority(os.PRIO_PROCESS, 0))")


@pytest.mark.skipif(not hasattr(os, "setpriority") or not shutil.which("nice"), reason="POSIX nice")
def test_a_rank_started_at_nice_15_runs_at_nice_0_where_allowed():
    out = subprocess.run(["nice", "-n", "15", sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert int(out.stdout) == (0 if os.geteuid() == 0 else 15), out.stderr
