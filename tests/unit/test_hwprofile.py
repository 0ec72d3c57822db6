"""Hardware profiles (workbench/hwprofile.py): round trip, hostile files, the GEMM fit's shape,
collectives scaled between rank counts, where profiles are found."""
import math
import os

import pytest
import yaml

from workbench.errors import ConfigError
from workbench.hwprofile import (
    HardwareProfile,
    default_profile_path,
    find_profile,
    fit_gemm,
    load_profile,
    profile_from_dict,
    save_profile,
)

RATE, T0 = 50e9, 8e-6  # a made-up device: 50 GFLOP/s, 8 us per call
AM, AN, AK = 24.0, 8.0, 96.0  # rows fill at ~24, columns at ~8, a short reduction costs most


def _gemm_points(dtype="fp32", rate=RATE):
    sizes = [(64, 64, 64), (256, 256, 256), (1024, 1024, 1024), (256, 192, 64), (256, 64, 64), (256, 256, 64),
             (256, 64, 256), (8, 512, 512), (2048, 128, 32)]
    return tuple((dtype, m, n, k, T0 + 2 * (m + AM) * (n + AN) * (k + AK) / rate) for m, n, k in sizes)


def _colls(ranks=2):
    # a ring of `ranks` with 20 us per step and 1 GB/s of bus bandwidth
    out = []
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "p2p"):
        steps = 1 if kind == "p2p" else (2 * (ranks - 1) if kind == "all_reduce" else ranks - 1)
        share = 1 if kind == "p2p" else steps / ranks
        for nbytes in (4096, 65536, 1 << 20, 16 << 20):
            out.append((kind, "intra", ranks, nbytes, steps * 20e-6 + share * nbytes / 1e9))
    return tuple(out)


def _profile(**kw):
    base = dict(device="cpu", created="2026-12-02T10:00:00+00:00", host="box", backend="local", nodes=1,
                ranks_per_node=2, threads_per_rank=1, gemm=_gemm_points() + _gemm_points("bf16", RATE / 4),
                memory_bw=5e9, op_overhead_s=4e-6, collectives=_colls())
    base.update(kw)
    return HardwareProfile(**base)


def test_round_trip(tmp_path):
    p = _profile()
    path = tmp_path / "sub" / "cpu.yaml"
    save_profile(p, path)
    assert load_profile(path) == p
    assert [f.name for f in tmp_path.joinpath("sub").iterdir()] == ["cpu.yaml"]  # no temporary left behind
    assert p.label() == "calibrated on this cluster, 2026-12-02 (2 x cpu, local)"
    assert _profile(nodes=2, ranks_per_node=8).label() == \
        "calibrated on this cluster, 2026-12-02 (2 nodes x 8 x cpu, local)"


def test_gemm_fit_recovers_the_law_and_is_monotone():
    fit = fit_gemm([p[1:] for p in _gemm_points()])
    assert fit.rate == pytest.approx(RATE, rel=0.05)
    assert fit.worst < 0.05
    p = _profile()
    for m, n, k in [(64, 64, 64), (1024, 1024, 1024), (8, 512, 512)]:
        assert p.gemm_s(m, n, k, "fp32") == pytest.approx(T0 + 2 * (m + AM) * (n + AN) * (k + AK) / RATE, rel=0.05)
    # increasing in every dimension, including far outside the measured range
    for dim in range(3):
        last = 0.0
        for x in [1, 2, 7, 64, 100, 1000, 4096, 65536, 1 << 20]:
            shape = [128, 128, 128]
            shape[dim] = x
            t = p.gemm_s(*shape, "fp32")
            assert t > last and math.isfinite(t)
            last = t
    # extrapolated: twice the rows of a big GEMM take about twice the time
    assert p.gemm_s(1 << 16, 4096, 4096, "fp32") / p.gemm_s(1 << 15, 4096, 4096, "fp32") == pytest.approx(2, rel=0.01)
    # per dtype, and an unmeasured dtype priced as its nearest measured one
    assert p.gemm_s(1024, 1024, 1024, "bf16") == pytest.approx(4 * p.gemm_s(1024, 1024, 1024, "fp32"), rel=0.1)
    assert p.gemm_s(512, 512, 512, "fp16") == p.gemm_s(512, 512, 512, "bf16")
    only32 = _profile(gemm=_gemm_points())
    assert only32.gemm_s(512, 512, 512, "bf16") == only32.gemm_s(512, 512, 512, "fp32")


def test_gemm_fit_of_noisy_points_stays_sane():
    # real timings scatter; the fit must stay positive, increasing and near the points
    noise = [1.3, 0.8, 1.1, 0.9, 1.2, 0.85, 1.0, 1.15, 0.95]
    pts = [(m, n, k, t * f) for (_, m, n, k, t), f in zip(_gemm_points(), noise)]
    fit = fit_gemm(pts)
    assert fit.rate > 0 and fit.t0 >= 0 and min(fit.a) >= 0
    assert fit.worst < 0.5
    assert fit.seconds(2048, 2048, 2048) > fit.seconds(1024, 1024, 1024) > fit.seconds(8, 8, 8) > 0


def test_gemm_fit_of_launch_bound_points_stays_bounded():
    # A GPU's small GEMMs all take ~12 us (launch-bound), as `calibrate --quick` of gpt-tiny measured
    # on an H200: the fit had widths of 3e11 and a rate of 1.8e29 GFLOP/s. Widths stay within 4x the
    # largest size measured, the rate within the data sheet's peak, and the points are still met.
    cubes = [32, 64, 128, 256, 512]
    noise = [1.02, 0.97, 1.05, 0.99, 1.01, 0.98, 1.03, 1.0, 0.96, 1.04, 1.01]
    shapes = [(c, c, c) for c in cubes] + [(4 * c, c, c) for c in cubes[1:-1]] + [(c, 4 * c, c) for c in cubes[1:-1]]
    pts = [(m, n, k, 12e-6 * f) for (m, n, k), f in zip(shapes, noise)]
    fit = fit_gemm(pts, max_rate=989e12)
    assert max(fit.a) <= 4 * 2048 and fit.rate <= 989e12
    assert fit.worst < 0.1
    # a profile of such points on a GPU prices a large GEMM no faster than the peak allows
    gpu = _profile(device="h200", gemm=[("bf16", *p) for p in pts])
    assert gpu.gemm_flops("bf16") <= 989e12
    assert gpu.gemm_s(8192, 8192, 8192, "bf16") >= 2 * 8192**3 / 989e12


def test_collectives_interpolate_and_scale_by_ring_factors():
    p = _profile()
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "p2p"):
        ts = [p.collective_s(kind, 2, b, "intra") for b in (1, 4096, 10_000, 65536, 1e6, 16 << 20, 1 << 30)]
        assert all(a <= b for a, b in zip(ts, ts[1:])), (kind, ts)
    # at the measured points: exact
    assert p.collective_s("all_reduce", 2, 1 << 20, "intra") == pytest.approx(2 * 20e-6 + (1 << 20) / 1e9)
    # past the largest: linear at the measured bandwidth
    big = p.collective_s("all_reduce", 2, 1 << 30, "intra")
    assert big == pytest.approx(2 * 20e-6 + (1 << 30) / 1e9, rel=0.01)
    # 8 ranks from a 2-rank measurement: ring steps 2 -> 14, share of the tensor 1 -> 7/4
    truth8 = _profile(collectives=_colls(8))
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        for nbytes in (4096, 1 << 20, 16 << 20, 1 << 28):
            scaled = p.collective_s(kind, 8, nbytes, "intra")
            assert scaled == pytest.approx(truth8.collective_s(kind, 8, nbytes, "intra"), rel=0.02), (kind, nbytes)
    # and back down: the 8-rank measurement predicts 2 ranks
    assert truth8.collective_s("all_gather", 2, 16 << 20, "intra") == \
        pytest.approx(p.collective_s("all_gather", 2, 16 << 20, "intra"), rel=0.02)
    # more ranks never make a ring faster for the same full tensor
    assert p.collective_s("all_reduce", 16, 1 << 20, "intra") > p.collective_s("all_reduce", 4, 1 << 20, "intra")
    assert p.collective_s("all_reduce", 1, 1 << 20, "intra") == 0.0
    assert p.collective_s("all_reduce", 2, 1 << 20, "inter") is None  # not measured
    assert p.bus_bw("all_reduce", "intra", 16 << 20) == pytest.approx(1e9, rel=0.01)
    with pytest.raises(ConfigError, match="all_reduce"):
        p.collective_s("allreduce", 2, 1, "intra")


def _write(tmp_path, data, name="p.yaml"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("field,value,says", [
    ("device", "h100", "device"),
    ("device", ["cpu"], "device"),
    ("created", "yesterday", "created"),
    ("host", "a\nb", "host"),
    ("host", "x" * 300, "host"),
    ("backend", "sagemaker", "backend"),
    ("nodes", 0, "nodes"),
    ("nodes", True, "nodes"),
    ("nodes", 1.5, "nodes"),
    ("ranks_per_node", 1 << 40, "ranks_per_node"),
    ("threads_per_rank", "2", "threads_per_rank"),
    ("memory_bw", -1.0, "memory_bw"),
    ("memory_bw", float("inf"), "memory_bw"),
    ("memory_bw", float("nan"), "memory_bw"),
    ("memory_bw", 1e-300, r"memory_bw: .*bytes/s from 1e\+06 to 1e\+14"),  # would price a step at ~forever
    ("memory_bw_dtype", {"bf16": 1e20}, "memory_bw_dtype bf16"),
    ("op_overhead_s", "fast", "op_overhead_s"),
    ("gemm", [], "gemm"),
    ("gemm", {"a": 1}, "gemm"),
    ("gemm", [["fp32", 1, 2, 3]], r"gemm\[0\]"),
    ("gemm", [["fp8", 1, 2, 3, 1e-3]], r"gemm\[0\] dtype"),
    ("gemm", [["fp32", 0, 2, 3, 1e-3]], r"gemm\[0\] m"),
    ("gemm", [["fp32", 1, 2, 3, 0.0]], r"gemm\[0\] seconds"),
    ("gemm", [["fp32", 1, 2, 3, 1e-3]] * 1501, "gemm"),
    ("collectives", [["all_reduce", "intra", 1, 4096, 1e-4]], r"collectives\[0\] ranks"),
    ("collectives", [["broadcast", "intra", 2, 4096, 1e-4]], r"collectives\[0\] kind"),
    ("collectives", [["p2p", "nvlink", 2, 4096, 1e-4]], r"collectives\[0\] link"),
    ("collectives", "all_reduce", "collectives"),
    ("format", "workbench-hwprofile/9", "format"),
    ("pickle", "!!python/object", "pickle"),
])
def test_bad_fields_are_config_errors_naming_the_field(tmp_path, field, value, says):
    data = _profile().to_dict()
    data[field] = value
    with pytest.raises(ConfigError, match=says):
        load_profile(_write(tmp_path, data))


def test_missing_field_and_hostile_files(tmp_path):
    data = _profile().to_dict()
    del data["memory_bw"]
    with pytest.raises(ConfigError, match="memory_bw: missing"):
        load_profile(_write(tmp_path, data))
    for text, says in [
        ("- just\n- a list\n", "mapping"),
        ("device: [unclosed\n", "not valid YAML"),
        ("!!python/object/apply:os.system ['echo pwned']\n", "YAML"),  # no code: safe loading refuses tags
        ("a: &a [1,1,1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
         "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]\n", "alias"),
    ]:
        with pytest.raises(ConfigError, match=says):
            load_profile(_write(tmp_path, text))
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * ((1 << 20) + 1))
    with pytest.raises(ConfigError, match="too large"):
        load_profile(big)
    with pytest.raises(ConfigError, match="does not exist"):
        load_profile(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not a regular file"):
        load_profile(tmp_path)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage\x00\x81")
    with pytest.raises(ConfigError):
        load_profile(binary)


def test_save_refuses_an_unwritable_place(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="cannot write"):
        save_profile(_profile(), blocker / "cpu.yaml")


def test_where_profiles_are_found(tmp_path, monkeypatch):
    home = os.environ["WORKBENCH_HOME"]  # set per test by tests/conftest.py
    assert default_profile_path("cpu") == type(default_profile_path("cpu"))(home) / "profiles" / "cpu.yaml"
    assert find_profile("cpu") is None
    default = _profile(host="default")
    save_profile(default, default_profile_path("cpu"))
    assert find_profile("cpu") == default
    assert find_profile("h100-80gb") is None
    env = _profile(host="env")
    save_profile(env, tmp_path / "env.yaml")
    monkeypatch.setenv("WORKBENCH_PROFILE", str(tmp_path / "env.yaml"))
    assert find_profile("cpu") == env
    assert find_profile("h100-80gb") is None  # the variable's profile is for another device: passed over
    explicit = _profile(host="explicit")
    save_profile(explicit, tmp_path / "explicit.yaml")
    assert find_profile("cpu", str(tmp_path / "explicit.yaml")) == explicit
    with pytest.raises(ConfigError, match="measured on cpu, but the spec plans for h100-80gb"):
        find_profile("h100-80gb", str(tmp_path / "explicit.yaml"))
    with pytest.raises(ConfigError, match="not in the catalog"):
        default_profile_path("../../etc/passwd")
    monkeypatch.delenv("WORKBENCH_HOME")
    assert default_profile_path("cpu") == type(default_profile_path("cpu")).home() / ".workbench" / "profiles" / "cpu.yaml"


def test_runtime_overheads_round_trip_and_older_profiles_still_load(tmp_path):
    p = _profile(memory_bw_dtype=(("bf16", 2.5e9),), overheads=(("ddp", 0.01, 0.002, 0.0, 0.0, 0.0),
                                                                    ("zero3", 0.03, 0.0, 1e-9, 0.004, 2e-9)),
                 probes=(("ddp", 2, 1, 1, 2, 2, 0.05, 0.03), ("ddp", 2, 1, 1, 6, 2, 0.07, 0.034)), cpu_cores=2,
                 gemm_grad=tuple(("dgrad", d, m, n, k, t) for d, m, n, k, t in _gemm_points("bf16", RATE / 20))
                 + tuple(("wgrad", d, m, n, k, t) for d, m, n, k, t in _gemm_points("bf16", RATE / 4)))
    path = tmp_path / "cpu.yaml"
    save_profile(p, path)
    back = load_profile(path)
    assert back == p and back.overhead("ddp") == (0.01, 0.002, 0.0) and back.overhead("tp") is None
    # 1 ns per block parameter and micro-batch, 2 ns per block parameter once a step
    assert back.overhead("zero3", 2e6) == pytest.approx((0.03, 0.002, 0.008))
    assert set(yaml.safe_load(path.read_text())["overheads"]["ddp"]) == {"per_step_s", "per_block_s"}  # zeros left out
    assert back.elementwise_bw("bf16") == 2.5e9 and back.elementwise_bw("fp32") == back.elementwise_bw("fp16") == 5e9
    # backward GEMMs fitted apart from the forward's: here dgrad at a fifth of bf16's forward rate
    assert back.grad_gemm_s("dgrad", 256, 256, 256, "bf16") == pytest.approx(
        T0 + 2 * (256 + AM) * (256 + AN) * (256 + AK) / (RATE / 20), rel=0.02)
    assert back.grad_gemm_s("wgrad", 256, 256, 256, "fp32") is None  # not measured: the caller falls back
    old = yaml.safe_load(path.read_text())
    for key in ("memory_bw_dtype", "overheads", "probes", "cpu_cores", "gemm_grad"):
        del old[key]
    path.write_text(yaml.safe_dump(old))
    assert load_profile(path).overheads == () and load_profile(path).overhead("ddp") is None
    for bad, says in (({"ddpp": {"per_step_s": 0.1, "per_block_s": 0.0}}, "Did you mean .ddp."),
                      ({"ddp": {"per_step_s": -1, "per_block_s": 0.0}}, "per_step_s"),
                      ({"ddp": 0.1}, "per_block_s"),
                      ({"ddp": {"per_step_s": 0.1, "per_block_s": 0.0, "per_block_param_s": -1e-9}}, "per_block_param_s"),
                      ({"ddp": {"per_step_s": 0.1, "per_block_s": 0.0, "per_block_step_s": -1.0}}, "per_block_step_s"),
                      ({"ddp": {"per_step_s": 0.1, "per_block_s": 0.0, "per_param": 0.0}}, "per_block_step_param_s")):
        path.write_text(yaml.safe_dump({**old, "overheads": bad}))
        with pytest.raises(ConfigError, match=says):
            load_profile(path)


def test_calibrate_reads_per_step_per_block_and_per_parameter_costs_off_the_probes():
    """derive_overheads: measured = modelled + a + blocks x ((b + bp x block params) x micro-batches +
    c + cp x block params) on the near-empty probe model and on the spec's own, at 2 micro-batches and
    (the deepest) at 1, gives back (a, b, bp, c, cp) per family; a family measured faster than
    modelled costs nothing extra."""
    from workbench.calibrate import PROBE_MODEL, derive_overheads, probe_specs
    from workbench.memory.params import block_numel
    from workbench.planner import plan
    from workbench.spec import load_spec

    spec = load_spec({"model": {"preset": "gpt-mini"}, "train": {"global_batch": 8, "micro_batch": 4},
                      "resources": {"gpu": "cpu", "gpus_per_node": 2}}, layout=False)
    probes = probe_specs(spec)
    assert sorted({f for f, _ in probes}) == ["ddp", "pp", "single", "tp", "zero1", "zero2", "zero3"]
    widths = {raw["model"]["hidden"] for _, raw in probes}
    assert widths == {PROBE_MODEL["hidden"], 256}  # the near-empty model and gpt-mini's own width
    assert all(raw["precision"]["dtype"] == "fp32" for _, raw in probes)
    base = _profile()
    cost = {"ddp": (0.012, 0.0015, 0.0, 0.0, 0.0), "zero3": (0.02, 0.004, 2e-9, 0.003, 5e-9),
            "zero2": (0.001, 0.0, 0.0, 0.006, 1e-9), "tp": (0.0, 0.006, 1e-9, 0.0, 0.0)}
    measured, micro_counts = [], set()
    for family, raw in probes:
        s = load_spec(raw)
        modelled = plan(s, profile=base).given.step_time_s
        a, b, bp, c, cp = cost.get(family, (-0.001, 0.0, 0.0, 0.0, 0.0))  # the others: a little faster than modelled
        micros = s.train.global_batch // (s.layout.dp * s.train.micro_batch)
        micro_counts.add(micros)
        params = block_numel(s.model.shape(), s.layout.tp)
        measured.append((family, raw, modelled + a + s.model.layers / s.layout.pp * ((b + bp * params) * micros
                                                                                   + c + cp * params)))
    assert micro_counts == {1, 2}
    got = derive_overheads(base, measured)
    for family, costs in cost.items():
        assert dict((f, rest) for f, *rest in got.overheads)[family] == pytest.approx(list(costs), abs=1e-9)
    mini = block_numel(spec.model.shape(), 1)
    assert got.overhead("zero3", mini) == pytest.approx((0.02, 0.004 + 2e-9 * mini, 0.003 + 5e-9 * mini))
    assert got.overhead("zero1") == (0.0, 0.0, 0.0) and got.overhead("single") == (0.0, 0.0, 0.0)
    assert len(got.probes) == len(probes) and got.probes[0][0] == "single"
    # a model larger than a probe may train, or one given by its size, is probed near-empty only
    big = load_spec({**spec.to_dict(), "model": {"preset": "llama-7b"}}, layout=False)
    assert {raw["model"]["hidden"] for _, raw in probe_specs(big)} == {PROBE_MODEL["hidden"]}


def test_a_measured_shape_is_priced_as_measured_where_the_smooth_fit_cannot_follow_it():
    # bf16 on a CPU: the input-gradient GEMM of one shape runs 8x slower than the law of the others
    # (a different kernel); one smooth surface misses such a point, the measured shape must not
    odd = (512, 256, 1024)
    law = T0 + 2 * (512 + AM) * (256 + AN) * (1024 + AK) / RATE
    points = _gemm_points() + (("fp32", *odd, 8 * law),)
    p = _profile(gemm=points, gemm_grad=tuple(("dgrad", *pt) for pt in points))
    assert p.gemm_s(*odd, "fp32") == pytest.approx(8 * law)
    assert p.grad_gemm_s("dgrad", *odd, "fp32") == pytest.approx(8 * law)
    assert p.gemm_s(*odd, "fp16") == pytest.approx(8 * law)  # fp16 unmeasured: priced as fp32, point included
    # one shape away the fit answers, near the law (the odd point pulls it a little, not 8x)
    assert p.gemm_s(512, 256, 1000, "fp32") < 2 * law
    # repeated measurements of a shape: their median
    again = _profile(gemm=points + (("fp32", *odd, 2 * law), ("fp32", *odd, 3 * law)))
    assert again.gemm_s(*odd, "fp32") == pytest.approx(3 * law)


def test_elementwise_rows_round_trip_and_scale_with_the_elements_from_the_nearest_measured_shape(tmp_path):
    rows = (("gelu_tanh", "fwd", "fp32", 256, 256, 1e-4), ("gelu_tanh", "fwd", "fp32", 64, 256, 3e-5),
            ("gelu_tanh", "fwd", "fp32", 512, 1024, 9e-4), ("layer_norm", "bwd", "fp32", 256, 64, 4e-5))
    p = _profile(elementwise=rows)
    save_profile(p, tmp_path / "cpu.yaml")
    back = load_profile(tmp_path / "cpu.yaml")
    assert back == p
    assert back.elementwise_s("gelu_tanh", "fwd", "fp32", 64, 256) == pytest.approx(3e-5)  # the measured row itself
    # twice the rows of the nearest row of the same width: twice its time
    assert back.elementwise_s("gelu_tanh", "fwd", "fp32", 512, 256) == pytest.approx(2e-4)
    # a width never measured: the row nearest in elements (512 x 1024, twice as many), scaled
    assert back.elementwise_s("gelu_tanh", "fwd", "fp32", 512, 512) == pytest.approx(4.5e-4)
    assert back.elementwise_s("gelu_tanh", "bwd", "fp32", 256, 256) is None  # not measured: the caller falls back
    assert back.elementwise_s("rms_norm", "fwd", "fp32", 256, 64) is None
    with pytest.raises(ConfigError, match=r"elementwise\[0\] op"):
        profile_from_dict({**p.to_dict(), "elementwise": [["softmax", "fwd", "fp32", 4, 8, 1e-3]]})
    with pytest.raises(ConfigError, match=r"elementwise\[0\] rows"):
        profile_from_dict({**p.to_dict(), "elementwise": [["gelu_tanh", "fwd", "fp32", 0, 8, 1e-3]]})


def test_attention_rows_round_trip_and_scale_with_the_work_from_the_nearest_measured_shape(tmp_path):
    rows = (("fwd", "fp32", 4, 8, 128, 32, 1e-3), ("bwd", "fp32", 4, 8, 128, 32, 3e-3),
            ("fwd", "fp32", 2, 8, 32, 8, 2e-5), ("bwd", "bf16", 4, 8, 128, 32, 9e-3))
    p = _profile(attention=rows)
    save_profile(p, tmp_path / "cpu.yaml")
    back = load_profile(tmp_path / "cpu.yaml")
    assert back == p
    assert back.attention_s("bwd", "fp32", 32, 128, 32) == pytest.approx(3e-3)  # the measured row itself
    # twice the sequence-heads, twice the sequence: 2 x 4 the work of the nearest row
    assert back.attention_s("fwd", "fp32", 64, 256, 32) == pytest.approx(8e-3)
    assert back.attention_s("fwd", "fp32", 16, 32, 8) == pytest.approx(2e-5)  # the probes' shape: its own row
    assert back.attention_s("fwd", "bf16", 32, 128, 32) is None  # not measured in bf16: the caller falls back
    with pytest.raises(ConfigError, match=r"attention\[0\] pass"):
        profile_from_dict({**p.to_dict(), "attention": [["forward", "fp32", 4, 8, 128, 32, 1e-3]]})
