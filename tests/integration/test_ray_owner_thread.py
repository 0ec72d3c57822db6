"""Ray started from a thread that then exits (the notebook's Run button) keeps its daemons.

Ray forks gcs_server and raylet with PR_SET_PDEATHSIG: when the forking *thread* exits they are
killed at once (zombies), and the driver dies 60 s later. `ensure_ray` must not let that happen.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(200)]

_SCRIPT = textwrap.dedent("""
    import json, os, threading, time
    from backends.local_ray import ensure_ray

    t = threading.Thread(target=ensure_ray, args=(1,))
    t.start(); t.join()  # the starting thread is gone
    time.sleep(2)  # PDEATHSIG is immediate; give the kernel time to deliver it anyway
    daemons = {}
    for pid in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if int(rest[1]) == os.getpid() and name in ("gcs_server", "raylet"):
            daemons[name] = rest[0]
    print(json.dumps(daemons))
    import ray
    print(ray.get(ray.remote(lambda: 41 + 1).remote(), timeout=60))
""")


def test_ray_started_from_a_passing_thread_survives_it():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "RAY_ADDRESS": "local"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    daemons, answer = proc.stdout.split("\n")[-3:-1]
    states = json.loads(daemons)
    assert set(states) == {"gcs_server", "raylet"} and "Z" not in states.values(), states  # Z: killed
    assert answer == "42"
