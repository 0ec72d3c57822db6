"""JupyterLab on a free localhost port and Debian's chromium, headless, driven by Playwright.

JupyterLab runs in its own process group with isolated config/data/runtime dirs and this
checkout on PYTHONPATH, so its kernels import the workbench under test; teardown kills the group.
Server and browser are module-scoped: the notebook's kernel and its embedded Ray cluster end with
the browser module instead of idling beside the rest of the suite.
Chromium is the system package (apt-get install chromium), never a Playwright download.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from bench.common import OWN_GROUP

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
CHROME_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-dev-shm-usage"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, timeout: float = 120.0) -> float:
    """Poll until url answers 200; fail fast if the server died."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited early rc={proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"not ready after {timeout}s: {url}")


def isolated_env(home: Path) -> dict:
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    # RAY_ADDRESS=local: the kernel's run must start its own embedded cluster, never attach to a
    # `ray start` cluster that another process left in /tmp/ray/ray_current_cluster.
    env = dict(os.environ, PYTHONUNBUFFERED="1", JUPYTER_PLATFORM_DIRS="1", PYTHONPATH=pythonpath, RAY_ADDRESS="local")
    for var, sub in [("JUPYTER_CONFIG_DIR", "cfg"), ("JUPYTER_RUNTIME_DIR", "rt"), ("JUPYTER_DATA_DIR", "data"),
                     ("JUPYTERLAB_SETTINGS_DIR", "settings"), ("JUPYTERLAB_WORKSPACES_DIR", "ws")]:
        env[var] = str(home / sub)
    # no "official Jupyter news?" toast covering the page
    d = home / "settings" / "@jupyterlab" / "apputils-extension"
    d.mkdir(parents=True, exist_ok=True)
    (d / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    return env


def stop(proc: subprocess.Popen) -> None:
    """End the server and its kernels (and their Ray workers): the whole process group."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers (a kernel's Ray processes) in the same group
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.fixture(scope="session")
def work_dir(tmp_path_factory):
    """A copy of notebooks/, so autosave and checkpoints never touch the repo."""
    d = tmp_path_factory.mktemp("nbs")
    shutil.copytree(ROOT / "notebooks", d, dirs_exist_ok=True)
    return d


@pytest.fixture(scope="session")
def shots():
    """Where screenshots go: $WORKBENCH_SCREENSHOTS if set (CI artifacts), else docs/screenshots/,
    the pictures docs/ui.md shows (so the docs show what the last browser run saw)."""
    d = Path(os.environ.get("WORKBENCH_SCREENSHOTS") or ROOT / "docs" / "screenshots")
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory, work_dir):
    pytest.importorskip("jupyterlab")
    home = tmp_path_factory.mktemp("jhome")
    port = free_port()
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
           "--ServerApp.token=", "--ServerApp.password=", f"--ServerApp.root_dir={work_dir}",
           "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--LabApp.extension_manager=readonly", "--expose-app-in-browser"]
    log = open(home / "lab.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=isolated_env(home), **OWN_GROUP)
    base = f"http://127.0.0.1:{port}"
    try:
        dt = wait_ready(proc, f"{base}/api/status")
        print(f"\n[lab_server] ready in {dt:.1f}s on {base}")
        yield base
    except Exception:
        print((home / "lab.log").read_text()[-3000:])
        raise
    finally:
        stop(proc)
        log.close()


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"chromium not found at {CHROMIUM}: apt-get install -y chromium")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS)
        yield b
        b.close()


@pytest.fixture()
def page(browser):
    ctx = browser.new_context(viewport={"width": 1500, "height": 1100})
    pg = ctx.new_page()
    pg.set_default_timeout(60_000)
    pg.problems = []
    pg.on("pageerror", lambda e: pg.problems.append(f"pageerror: {e}"))
    pg.on("requestfailed", lambda r: pg.problems.append(f"requestfailed: {r.url} {r.failure}"))
    yield pg
    ctx.close()
