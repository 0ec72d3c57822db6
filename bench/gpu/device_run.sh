#!/usr/bin/env bash
# The one command for a lent GPU machine (issue #35 item 5): run from the repository root, it
# installs what the machine's image lacks from a carried wheel folder, runs every GPU arm of
# bench/gpu/run_all.py within its budget, then the GPU tests (marked gpu) within theirs, and leaves
# the result JSON, the calibrated profile, the regenerated docs/benchmarks.md and the logs in $OUT
# (what the device tool brings back).
#
# The image holds torch, numpy, pyyaml, fsspec, tqdm and pytest but (as listed in 2026-11) not
# pydantic, and reaches no registry. Prepare the wheels here, for its Python 3.12, once:
#   echo /.gpu-wheels/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .gpu-wheels pydantic==2.14.4 pydantic_core==2.50.5 \
#       annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
# then call the device tool's run with command "bash bench/gpu/device_run.sh", carry [".gpu-wheels"]
# and timeout_s 590: BUDGET_S (default 420 s) covers the arms, TESTS_S (default 120 s) the tests,
# start-up and the report add ~30 s.
set -uo pipefail
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
py=${PYTHON:-$(command -v python3)}  # the image's python3 holds torch
if [ -d .gpu-wheels ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu-wheels/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>&1 | tee "$out/nvidia-smi.txt"
"$py" -c "import torch, pydantic; print('torch', torch.__version__, 'pydantic', pydantic.VERSION)" 2>&1 \
    | tee -a "$out/nvidia-smi.txt"
"$py" -m bench.gpu.run_all --device cuda --budget-s "${BUDGET_S:-420}" 2>&1 | tee "$out/run_all.log"
status=${PIPESTATUS[0]}
cp bench/results/gpu.json bench/results/gpu-profile.yaml docs/benchmarks.md "$out/" 2>/dev/null
# every test marked gpu: tests/gpu, and the CUDA checks that live beside their CPU twins
timeout "${TESTS_S:-120}" "$py" -m pytest -q -p no:cacheprovider -rs -m gpu tests/gpu tests/unit/test_memory_activations.py \
    2>&1 | tee "$out/tests_gpu.log"
tests=${PIPESTATUS[0]}
echo "run_all exit $status, tests/gpu exit $tests"
exit $(( status || tests ))
