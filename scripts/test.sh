#!/usr/bin/env bash
# Set up .venv (CPU torch from local disk, every extra) and the headless browser, then lint,
# type-check the core and run the whole test suite. Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not browser"`.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core
  else
    echo "chromium is missing: run 'sudo apt-get install chromium fonts-dejavu-core' (browser tests need it)" >&2
    exit 1
  fi
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q torch==2.13.0 -e '.[all,dev]' -c requirements/constraints.txt 2>&1 | { grep -v '^WARNING: Location' || true; }
# jsonschema imports rfc3987-syntax when it is installed (JupyterLab's jupyter-events pulls it in) and
# compiles its Lark grammar at import: 1.35 s of CPU in every process that imports ray (each Ray
# daemon, worker and relay; an embedded cluster's start-up 17 s -> 5 s of CPU). It only adds the
# iri/uri format checks, which nothing here uses (docs/testing.md).
.venv/bin/pip uninstall -q -y rfc3987-syntax 2>/dev/null || true
.venv/bin/ruff check workbench backends bench tests  # lint (pyproject: [tool.ruff])
.venv/bin/mypy  # types of the torch-free core (pyproject: [tool.mypy])
exec .venv/bin/python -m pytest "$@"
