"""A rank process started before its job (backends/ray_relay.py `_rank_main(fd, standby=True)`,
#35): it imports torch and the runtime first and says so with its timings, serves rank 0's
TCPStore when asked, and applies the job's environment before the job runs. The real process over
a real pipe; the test plays the relay."""
import os
import subprocess
import sys
from multiprocessing import Pipe

import pytest

from backends.ray_relay import _CHILD

pytestmark = pytest.mark.timeout(240)


def start_standby():
    conn, child_end = Pipe()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(child_end.fileno()), "standby"],
                            pass_fds=[child_end.fileno()], env=env)
    child_end.close()
    return conn, proc


def test_a_standby_rank_imports_first_serves_the_store_then_runs_its_job_in_its_environment():
    from datetime import timedelta

    from torch.distributed import TCPStore

    from tests.helpers.stepping import env_probe

    conn, proc = start_standby()
    try:
        assert conn.poll(180), "the standby rank never said it was ready"
        kind, timings = conn.recv()
        assert kind == "ready"
        assert set(timings) == {"import_torch_s", "import_workbench_s", "import_dynamo_s"}
        assert all(v >= 0 for v in timings.values()) and timings["import_torch_s"] > 0
        conn.send(("store", "127.0.0.1"))
        assert conn.poll(60)
        kind, port = conn.recv()
        assert kind == "store" and port > 0
        client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        client.set("k", "v")  # the rank's process serves it
        assert client.get("k") == b"v"
        conn.send({"spec": {"names": ["WB_STANDBY_PROBE", "RANK"]}, "resume": False, "attempt": 0,
                   "entry": env_probe, "env": {"WB_STANDBY_PROBE": "job's", "RANK": "3"}})
        assert conn.poll(60)
        assert conn.recv() == ("event", {"event": "note", "message": {"WB_STANDBY_PROBE": "job's", "RANK": "3"}})
        assert conn.recv() == ("done", None)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
