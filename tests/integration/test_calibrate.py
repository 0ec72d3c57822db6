"""`workbench calibrate --quick` on 2 local CPU ranks through the local-Ray launcher: it writes a
profile that loads, whose figures are physical, and says where it wrote it."""
import os
import subprocess
import sys

import pytest

from workbench.hwprofile import default_profile_path, find_profile, load_profile

pytestmark = [pytest.mark.ray, pytest.mark.timeout(400)]

SPEC = """
name: calibrate-test
model: {preset: gpt-tiny}
train: {steps: 2, global_batch: 8, micro_batch: 4}
layout: {dp: 2}
resources: {gpu: cpu, gpus_per_node: 2, nodes: 1}
"""


def test_calibrate_quick_on_two_local_ranks(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "calibrate", str(spec), "--quick"],
                          capture_output=True, text=True, timeout=360, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = default_profile_path("cpu")  # under this test's WORKBENCH_HOME (tests/conftest.py)
    assert f"wrote {path}; `workbench plan`" in proc.stdout  # and what else uses it (workbench/cli.py)
    assert "bus bandwidth" in proc.stdout and "all_reduce intra x2" in proc.stdout
    profile = load_profile(path)
    assert find_profile("cpu") == profile
    assert (profile.device, profile.backend, profile.nodes, profile.ranks_per_node) == ("cpu", "local", 1, 2)
    assert profile.label().startswith("calibrated on this cluster, ") and "(2 x cpu, local)" in profile.label()
    # the model's own GEMM shapes were measured: 4 sequences x 64 tokens by gpt-tiny's 64 / 256 widths
    assert ("fp32", 256, 64, 64) in {p[:4] for p in profile.gemm}
    # physical: a CPU core does 1-1000 GFLOP/s, moves 0.1-1000 GB/s, dispatches an op in 0.1-1000 us
    rate = profile.gemm_flops("fp32")
    assert 1e9 < rate < 1e12
    assert profile.gemm_s(512, 512, 512, "fp32") > profile.gemm_s(128, 128, 128, "fp32")
    assert 1e8 < profile.memory_bw < 1e12
    assert 1e-7 < profile.op_overhead_s < 1e-3
    kinds = {(p[0], p[1], p[2]) for p in profile.collectives}
    assert kinds == {(k, "intra", 2) for k in ("all_reduce", "all_gather", "reduce_scatter", "p2p")}
    big, small = (profile.collective_s("all_reduce", 2, n, "intra") for n in (16 << 20, 4096))
    assert big > small > 0
    assert profile.collective_s("all_reduce", 2, 4096, "inter") is None  # one node: nothing across nodes
    # the runtime's own step per strategy family, at two depths each, read against the model
    assert {p[0] for p in profile.probes} == {"single", "ddp", "zero1", "zero2", "zero3", "tp", "pp"}
    assert {p[0] for p in profile.overheads} == {p[0] for p in profile.probes}
    assert all(p[6] > 0 and p[7] > 0 for p in profile.probes) and profile.cpu_cores >= 1
    assert all(0 <= a < 5 and 0 <= b < 1 and 0 <= c < 1e-6 for _, a, b, c in profile.overheads)  # physical, not runaway
    assert "runtime step beyond the modelled work" in proc.stdout
    # the backward GEMMs in autograd's layout (fp32: --quick with an fp32 spec measures no other dtype)
    assert {(p[0], p[1]) for p in profile.gemm_grad} == {("dgrad", "fp32"), ("wgrad", "fp32")}


def test_calibrate_refuses_before_any_worker(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.replace("backend", "x") + "backend: {name: sagemaker}\n")
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "calibrate", str(spec), "--quick",
                           "-o", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "calibrate runs on this machine" in proc.stderr, proc.stderr
    spec.write_text(SPEC)
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "calibrate", str(spec), "--quick",
                           "-o", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "it is a folder" in proc.stderr, proc.stderr
