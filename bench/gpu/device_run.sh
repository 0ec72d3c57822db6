#!/usr/bin/env bash
# The one command for a lent GPU machine (issue #35 item 5): run from the repository root, it
# installs what the machine's image lacks from a carried wheel folder, runs every GPU arm of
# bench/gpu/run_all.py within the budget, and leaves the result JSON, the regenerated
# docs/benchmarks.md and the log in $OUT (what the device tool brings back).
#
# The image holds torch, numpy and pyyaml but (as listed in 2026-11) not pydantic, fsspec or tqdm,
# and reaches no registry. Prepare the wheels here, for its Python 3.12, once:
#   echo /.gpu-wheels/ >> .git/info/exclude
#   python -m pip download --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 -d .gpu-wheels pydantic fsspec tqdm
# then call the device tool's run with command "bash bench/gpu/device_run.sh", carry [".gpu-wheels"]
# and timeout_s 590 (BUDGET_S, default 480 s, covers the arms; start-up and the report add ~30 s).
set -euo pipefail
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
py=${PYTHON:-$(command -v python3)}  # the image's python3 holds torch
if [ -d .gpu-wheels ]; then
    "$py" -m pip install -q --no-index --find-links .gpu-wheels pydantic fsspec tqdm
fi
nvidia-smi --query-gpu=index,name,memory.total --format=csv 2>&1 | tee "$out/nvidia-smi.txt" || true
status=0
PYTHONPATH=$PWD "$py" -m bench.gpu.run_all --device cuda --budget-s "${BUDGET_S:-480}" 2>&1 | tee "$out/run_all.log" \
    || status=$?
cp bench/results/gpu.json docs/benchmarks.md "$out/" 2>/dev/null || true
exit "$status"
