"""`workbench calibrate --quick` on 2 local CPU ranks through the local-Ray launcher: it writes a
profile that loads, whose figures are physical, and says where it wrote it.

The command runs in this process (tests/helpers/cli.py), on the embedded Ray cluster the
in-process Ray tests share. It is `slow`: its timed budgets (8 s of GEMMs alone) and a Ray job
of two ranks come to 25-30 s. The fast loop runs the same rank code, `calibrate_rank`, on the
session's two gloo ranks (tests/conftest.py) with budgets of a fraction of a second, and builds,
prints, saves and loads the profile from what rank 0 sent, as `calibrate` does."""
import functools
from datetime import datetime, timezone

import pytest
import yaml

from tests.helpers.cli import run_cli
from workbench import calibrate as C
from workbench.hwprofile import default_profile_path, find_profile, load_profile, profile_from_dict, save_profile
from workbench.spec import load_spec

pytestmark = [pytest.mark.timeout(400)]

SPEC = """
name: calibrate-test
model: {preset: gpt-tiny}
train: {steps: 2, global_batch: 8, micro_batch: 4}
layout: {dp: 2}
resources: {gpu: cpu, gpus_per_node: 2, nodes: 1}
"""


@pytest.mark.ray
@pytest.mark.slow
def test_calibrate_quick_on_two_local_ranks(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    proc = run_cli("calibrate", spec, "--quick")
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
    assert all(0 <= a < 5 and 0 <= b < 1 and 0 <= bp < 1e-6 and 0 <= c < 1 and 0 <= cp < 1e-6  # physical, not runaway
               for _, a, b, bp, c, cp in profile.overheads)
    assert "runtime step beyond the modelled work" in proc.stdout
    # the backward GEMMs in autograd's layout (fp32: --quick with an fp32 spec measures no other dtype)
    assert {(p[0], p[1]) for p in profile.gemm_grad} == {("dgrad", "fp32"), ("wgrad", "fp32")}
    # the fused attention core at gpt-tiny's shape (4 sequences, 4 heads of 16, 64 tokens) and the probes'
    assert {p[:6] for p in profile.attention} >= {(k, "fp32", 4, 4, 64, 16) for k in ("fwd", "bwd")}
    assert all(1e-7 < p[6] < 1 for p in profile.attention) and "attention core (causal)" in proc.stdout
    # gpt-tiny's norm and activation (256 tokens, 64 wide, MLP 256) and the probes' (64 tokens)
    assert {p[:5] for p in profile.elementwise} >= {("layer_norm", k, "fp32", 256, 64) for k in ("fwd", "bwd")} | \
        {("gelu_tanh", k, "fp32", 256, 256) for k in ("fwd", "bwd")}
    assert all(1e-8 < p[5] < 1 for p in profile.elementwise) and "norms and activations" in proc.stdout


def test_calibrate_refuses_before_any_worker(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.replace("backend", "x") + "backend: {name: sagemaker}\n")
    proc = run_cli("calibrate", spec, "--quick", "-o", tmp_path)
    assert proc.returncode == 2 and "calibrate runs on this machine" in proc.stderr, proc.stderr
    spec.write_text(SPEC)
    proc = run_cli("calibrate", spec, "--quick", "-o", tmp_path)
    assert proc.returncode == 2 and "it is a folder" in proc.stderr, proc.stderr


# --quick with every timed budget cut to a fraction of a second, fewer sizes: the same benchmarks,
# collectives and strategy probes in the same order, figures too noisy to check against physics.
SMALL = {"sizes": [4 << 10, 64 << 10], "budget_s": 0.002, "elements": 1 << 16, "cubes": [32, 128], "repeats": 1,
         "gemm_budget_s": 0.2, "probe_steps": (1, 2)}


@pytest.mark.distributed
def test_calibrate_ranks_measure_every_figure_of_the_profile(pool2, tmp_path):
    spec = load_spec(yaml.safe_load(SPEC), layout=False)
    options = {**C._options(spec, quick=True), **SMALL}
    events = pool2.run(C._job_spec(spec).to_dict(), fn=functools.partial(C.calibrate_rank, options=options),
                       timeout_s=240)
    (found,) = [e for e in events if e["event"] == "calibration"]  # rank 0's, once
    assert {"event": "end", "status": "completed", "step": 0} in events
    raw = {**found["profile"], "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "backend": "local"}
    seconds = raw.pop("probe_seconds")
    assert len(seconds) == len(options["probes"]) and all(t > 0 for t in seconds)
    profile = C.derive_overheads(profile_from_dict(raw, "(measured)"),
                                 [(f, r, t) for (f, r), t in zip(options["probes"], seconds)])
    assert (profile.device, profile.backend, profile.nodes, profile.ranks_per_node) == ("cpu", "local", 1, 2)
    assert ("fp32", 256, 64, 64) in {p[:4] for p in profile.gemm}  # gpt-tiny's own GEMM shapes
    assert ("fp32", 64, 128, 64) in {p[:4] for p in profile.gemm}  # the probes' (64 tokens into their 128-token head)
    assert profile.gemm_flops("fp32") > 0 and profile.memory_bw > 0 and profile.op_overhead_s > 0
    kinds = {(p[0], p[1], p[2]) for p in profile.collectives}
    assert kinds == {(k, "intra", 2) for k in ("all_reduce", "all_gather", "reduce_scatter", "p2p")}
    assert profile.collective_s("all_reduce", 2, 4096, "intra") > 0
    assert {p[0] for p in profile.probes} == {"single", "ddp", "zero1", "zero2", "zero3", "tp", "pp"}
    assert {p[0] for p in profile.overheads} == {p[0] for p in profile.probes}
    assert {(p[0], p[1]) for p in profile.gemm_grad} == {("dgrad", "fp32"), ("wgrad", "fp32")}
    assert {(p[0], p[1], *p[4:6]) for p in profile.attention} == {(k, "fp32", s, d) for k in ("fwd", "bwd")
                                                                     for s, d in ((64, 16), (32, 8))}
    assert {(p[0], p[1], *p[3:5]) for p in profile.elementwise} == {
        (op, k, rows, cols) for k in ("fwd", "bwd") for op, rows, cols in
        (("layer_norm", 256, 64), ("gelu_tanh", 256, 256), ("layer_norm", 64, 64), ("gelu_tanh", 64, 256))}
    text = C.summary(profile)
    assert "bus bandwidth" in text and "all_reduce intra x2" in text and "runtime step beyond the modelled work" in text
    save_profile(profile, tmp_path / "cpu.yaml")
    assert load_profile(tmp_path / "cpu.yaml") == profile
