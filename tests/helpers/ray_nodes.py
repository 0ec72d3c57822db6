"""A real Ray cluster of several nodes on this host, for the Ray backend's tests: `ray start --head`
plus `ray start --address` worker nodes, each a separate node (its own raylet, node id, ports,
temp dir and resources) on 127.0.0.1, with token authentication as Ray's default.

Every node runs in a process group of its own and is ended by that group's id, never `ray stop`
(which would end every Ray process on the machine, other test runs' included).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.common import OWN_GROUP

# GCS declares a node dead after `period x threshold` without a health-check answer (default
# 3 s x 5); shorter here so that a killed node is noticed in seconds.
HEALTH_CHECK_ENV = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "6"}
_START_S = 150


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@dataclass
class Node:
    name: str
    proc: subprocess.Popen
    temp_dir: Path
    log_path: Path

    def raylet_pid(self) -> int:
        """The pid of this node's raylet (a child of its `ray start --block` process)."""
        import psutil

        for child in psutil.Process(self.proc.pid).children(recursive=True):
            if child.name() == "raylet":
                return child.pid
        raise RuntimeError(f"node {self.name}: no raylet process\n{self.log_tail()}")

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # SIGTERM shutdown of --block can take 30 s
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


class RayNodes:
    """Head and worker nodes of one cluster. `address` is the dashboard's (the Jobs API)."""

    def __init__(self, token: str):
        self.token = token
        self.nodes: list[Node] = []
        self.gcs_port = self.address = None

    def _env(self, temp_dir: Path) -> dict:
        bin_dir = str(Path(sys.executable).parent)
        # jsonschema imports rfc3987_syntax when installed (jupyter-events pulls it in) and that
        # builds a lark grammar at import: ~3 s of CPU in every Ray process, enough on a busy
        # 2-core machine for the dashboard agent to miss the raylet's fixed start window.
        shim = temp_dir / "shim"
        shim.mkdir(exist_ok=True)
        (shim / "rfc3987_syntax.py").write_text("raise ImportError('not loaded in this test cluster')\n")
        return {**os.environ, **HEALTH_CHECK_ENV, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
                "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, "PYTHONPATH": str(shim)}

    def _start(self, name: str, args: list[str], ready) -> Node | None:
        # short: Ray's socket paths have a length limit
        temp_dir = Path(tempfile.mkdtemp(prefix=f"wb{name}-", dir="/tmp"))
        agent_http, agent_grpc, metrics, rt_env, node_mgr, obj_mgr = free_ports(6)
        cmd = [str(Path(sys.executable).parent / "ray"), "start", "--block", "--node-ip-address", "127.0.0.1",
               "--dashboard-agent-listen-port", str(agent_http), "--dashboard-agent-grpc-port", str(agent_grpc),
               "--metrics-export-port", str(metrics), "--runtime-env-agent-port", str(rt_env),
               "--node-manager-port", str(node_mgr), "--object-manager-port", str(obj_mgr),
               "--temp-dir", str(temp_dir), "--object-store-memory", str(100 * 2**20), "--disable-usage-stats", *args]
        log_path = temp_dir / "node.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, env=self._env(temp_dir), stdout=log, stderr=subprocess.STDOUT,
                                    **OWN_GROUP)
        node = Node(name, proc, temp_dir, log_path)
        deadline = time.monotonic() + _START_S
        while proc.poll() is None and time.monotonic() < deadline:
            if "Ray runtime started" in log_path.read_text(errors="replace") and ready():
                return node
            time.sleep(0.5)
        self.last_failure = node.log_tail()
        node.stop()
        return None

    def start_head(self, num_cpus: int, attempts: int = 3) -> None:
        """The head node, with the dashboard (Jobs API) on a free port. A 2-core machine busy with
        other test runs can miss the raylet's fixed start window: a failed start gets another try."""
        for _ in range(attempts):
            gcs, dash, client = free_ports(3)
            self.address, self.gcs_port = f"http://127.0.0.1:{dash}", gcs
            head = self._start("head", ["--head", "--port", str(gcs), "--dashboard-host", "127.0.0.1",
                                        "--dashboard-port", str(dash), "--ray-client-server-port", str(client),
                                        "--include-dashboard", "true", "--num-cpus", str(num_cpus)],
                               ready=lambda: self._get("/api/version") is not None)
            if head is not None:
                self.nodes.append(head)
                return
        raise RuntimeError("ray head did not start:\n" + self.last_failure)

    def add_worker(self, name: str, num_cpus: int, attempts: int = 3) -> Node:
        """A worker node with `num_cpus` CPUs and one unit of the resource `name` (how tests find
        its node id)."""
        for _ in range(attempts):
            node = self._start(name, ["--address", f"127.0.0.1:{self.gcs_port}", "--num-cpus", str(num_cpus),
                                      "--resources", json.dumps({name: 1})],
                               ready=lambda: self.node_id(name) is not None)
            if node is not None:
                self.nodes.append(node)
                return node
        raise RuntimeError(f"ray worker {name} did not start:\n" + self.last_failure)

    def _get(self, path: str):
        req = urllib.request.Request(self.address + path, headers={"Authorization": f"Bearer {self.token}"})
        try:
            return json.loads(urllib.request.urlopen(req, timeout=5).read())
        except OSError:
            return None

    def node_states(self) -> list[dict]:
        """The cluster's nodes as the GCS sees them (the state API): node_id, state, resources_total."""
        reply = self._get("/api/v0/nodes?limit=100&detail=true")
        return reply["data"]["result"]["result"] if reply else []

    def node_id(self, name: str, state: str = "ALIVE") -> str | None:
        for n in self.node_states():
            if name in n.get("resources_total", {}) and n["state"] == state:
                return n["node_id"]
        return None

    def wait_dead(self, name: str, timeout_s: float = 60.0) -> str:
        """Wait until the GCS has declared the node dead; its node id."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = self.node_id(name, state="DEAD")
            if dead is not None:
                return dead
            time.sleep(0.5)
        raise TimeoutError(f"node {name} still alive after {timeout_s} s: {self.node_states()}")

    def alive_workers(self) -> list[Node]:
        return [n for n in self.nodes if n.name != "head" and self.node_id(n.name) is not None]

    def kill(self, node: Node) -> str:
        """Node loss: SIGKILL the node's raylet and wait until the GCS declares the node dead; its id."""
        os.kill(node.raylet_pid(), signal.SIGKILL)
        return self.wait_dead(node.name)

    def set_workers(self, count: int, num_cpus: int) -> list[Node]:
        """Exactly `count` live worker nodes: new ones added, surplus ones lost (raylet killed)."""
        alive = self.alive_workers()
        for node in alive[count:]:
            self.kill(node)
        for _ in range(count - len(alive)):
            alive.append(self.add_worker(f"wb_node{len(self.nodes)}", num_cpus))
        return alive[:count]

    def name_of(self, node_id: str) -> str:
        """The worker name (its resource) of a node id."""
        for n in self.node_states():
            if n["node_id"] == node_id:
                return next((k for k in n.get("resources_total", {}) if k.startswith("wb_")), "head")
        raise KeyError(node_id)

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def stop(self) -> None:
        for node in reversed(self.nodes):  # workers first, the head last
            node.stop()
        self.nodes.clear()
