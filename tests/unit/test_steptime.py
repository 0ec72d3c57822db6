"""Step-time model: FLOPs formula, bubble, recomputation, communication placement."""
import pytest

from workbench.catalog import DEVICES
from workbench.memory import Layout
from workbench.memory.estimate import _stage_params
from workbench.models import PRESETS, resolve_shape
from workbench.spec import ModelSpec
from workbench.steptime import (
    GEMM_EFFICIENCY,
    LINK_EFFICIENCY,
    Engine,
    Hardware,
    collective_s,
    flops_per_token,
    gemm_efficiency,
    step_time,
)

H100 = DEVICES["h100-80gb"]


def shape(name):
    return resolve_shape(ModelSpec(preset=name))


def run(name, gpn=8, global_batch=64, dtype="bf16", **kw):
    sh = shape(name)
    lay = Layout(dtype=dtype, **kw)
    p, shard = _stage_params(sh, lay.tp, lay.pp, 0, lay.chunks, lay.dp)
    return step_time(sh, lay, H100, global_batch, gpn, p, shard)


def test_flops_per_token_is_6n_plus_attention():
    sh = shape("gpt2-124m")
    n_matmul = sh.layers * sh.block_params() + sh.vocab * sh.hidden  # blocks + head (tied or not)
    model, recompute = flops_per_token(sh)
    assert model == 6 * n_matmul + 12 * sh.layers * sh.hidden * sh.seq_len
    assert recompute == pytest.approx(2 * sh.block_params() + 4 * sh.hidden * sh.seq_len)


def test_full_recompute_costs_a_third_more_compute():
    base = run("gpt-1.3b", micro_batch=4, num_micro=16)
    full = run("gpt-1.3b", micro_batch=4, num_micro=16, activation_checkpointing="full")
    assert full.compute_s / base.compute_s == pytest.approx(4 / 3, rel=0.05)
    assert full.mfu < base.mfu <= max(GEMM_EFFICIENCY.values())


@pytest.mark.parametrize("sched, expected", [("1f1b", 3 / 11), ("gpipe", 3 / 11), ("interleaved-1f1b", 3 / 19),
                                             ("zero-bubble", 3 / 27)])
def test_pipeline_bubble(sched, expected):
    st = run("gpt-1.3b", global_batch=64, pp=4, micro_batch=8, num_micro=8, pp_schedule=sched, virtual_stages=2)
    assert st.bubble == pytest.approx(expected)


def test_data_parallel_across_nodes_exposes_more_communication():
    inside = run("gpt-1.3b", gpn=8, global_batch=64, dp=8, micro_batch=8, num_micro=1)
    across = run("gpt-1.3b", gpn=1, global_batch=64, dp=8, micro_batch=8, num_micro=1)
    assert across.exposed_comm_s > inside.exposed_comm_s
    assert across.step_time_s > inside.step_time_s


def test_collective_is_latency_plus_bytes_over_the_link():
    n, nbytes = 16, 2**30
    inter = H100.inter_node_bw * LINK_EFFICIENCY
    assert collective_s("all_gather", n, nbytes, "inter", H100) == pytest.approx(15 * 5e-6 + 15 / 16 * nbytes / inter)
    assert collective_s("all_reduce", n, nbytes, "inter", H100) == pytest.approx(30 * 5e-6 + 30 / 16 * nbytes / inter)
    assert collective_s("all_gather", n, nbytes, "intra", H100) < collective_s("all_gather", n, nbytes, "inter", H100)
    assert collective_s("all_reduce", 1, nbytes, "inter", H100) == 0


def test_zero3_gathers_hide_behind_compute_only_up_to_the_compute():
    """FSDP prefetch hides a block's gather behind one block's compute, no more: with little
    compute per rank (small micro-batch, across nodes) the gathers are exposed."""
    big = run("llama-7b", gpn=1, global_batch=64, dp=8, zero=3, micro_batch=8, num_micro=1)
    small = run("llama-7b", gpn=1, global_batch=8, dp=8, zero=3, micro_batch=1, num_micro=1)
    assert small.detail["fsdp_exposed_s"] / small.step_time_s > big.detail["fsdp_exposed_s"] / big.step_time_s
    assert small.mfu < big.mfu
    ddp = run("llama-7b", gpn=1, global_batch=8, dp=8, zero=0, micro_batch=1, num_micro=1)
    assert small.exposed_comm_s > ddp.exposed_comm_s  # 3 collectives per block vs one all-reduce


def test_fsdp_backward_post_prefetch_exposes_the_backward_gathers_only():
    """FSDP1's BACKWARD_POST (Composer's default, llm-foundry's MPT tables) issues the next block's
    all-gather after the current block's gradients: each backward gather is exposed, the
    reduce-scatter still overlaps. Zero 2 (no backward gather) is unchanged."""
    sh = shape("llama-7b")
    hw = Hardware(H100, 8)

    def st(zero, prefetch, reduce_bytes=4):
        lay = Layout(dtype="bf16", dp=8, zero=zero, micro_batch=2, num_micro=1)
        p, shard = _stage_params(sh, lay.tp, lay.pp, 0, lay.chunks, lay.dp)
        eng = Engine("fsdp1", backward_prefetch=prefetch, grad_reduce_bytes=reduce_bytes)
        return step_time(sh, lay, H100, 16, 8, p, shard, hw=hw, engine=eng)

    pre, post = st(3, "pre"), st(3, "post")
    gather = hw.collective_s("all_gather", 8, sh.block_params() * 2, 1)
    assert post.detail["fsdp_exposed_s"] - pre.detail["fsdp_exposed_s"] == pytest.approx(sh.layers * gather, rel=0.05)
    assert st(2, "post").step_time_s == pytest.approx(st(2, "pre").step_time_s)
    assert st(3, "post", reduce_bytes=2).step_time_s <= post.step_time_s  # a bf16 reduce-scatter moves half


def test_zero2_gathers_once_a_step_when_the_engine_keeps_the_gathered_weights():
    """Our zero=2 keeps FSDP2's gathered weights across the step's micro-batches (parallel/apply.py
    `_keep_gathered`): with 4 micro-batches, 3 of the 4 forward all-gathers are gone; an engine that
    reshards after every backward (FSDP1's SHARD_GRAD_OP) pays them all."""
    sh = shape("llama-7b")
    hw = Hardware(H100, 8)

    def st(zero, engine, num_micro=4):
        lay = Layout(dtype="bf16", dp=8, zero=zero, micro_batch=2, num_micro=num_micro)
        p, shard = _stage_params(sh, lay.tp, lay.pp, 0, lay.chunks, lay.dp)
        return step_time(sh, lay, H100, 8 * 2 * num_micro, 8, p, shard, hw=hw, engine=engine)

    kept, every = st(2, Engine(prefetch=False, keep_gathered=True)), st(2, Engine(prefetch=False))
    gather = hw.collective_s("all_gather", 8, sh.block_params() * 2, 1)
    assert every.detail["fsdp_exposed_s"] - kept.detail["fsdp_exposed_s"] == pytest.approx(3 * (sh.layers + 1) * gather,
                                                                                           rel=0.05)
    assert every.step_time_s - kept.step_time_s == pytest.approx(3 * (sh.layers + 1) * gather, rel=0.05)
    assert st(3, Engine(keep_gathered=True)).step_time_s == st(3, Engine()).step_time_s  # zero 3 frees them
    assert st(2, Engine(keep_gathered=True), 1).step_time_s == st(2, Engine(), 1).step_time_s  # nothing to keep


def test_gemm_efficiency_falls_as_tp_narrows_the_gemms():
    assert gemm_efficiency(H100, 8192 / 8, 4096) < gemm_efficiency(H100, 8192, 4096)
    assert gemm_efficiency(H100, 8192, 512) < gemm_efficiency(H100, 8192, 4096)


def test_virtual_stages_shrink_the_interleaved_bubble():
    kw = dict(global_batch=64, pp=4, micro_batch=8, num_micro=8, pp_schedule="interleaved-1f1b")
    assert run("gpt-1.3b", virtual_stages=4, **kw).bubble < run("gpt-1.3b", virtual_stages=2, **kw).bubble


def test_offload_adds_host_time():
    dev = run("gpt-1.3b", dp=8, zero=3, micro_batch=8, num_micro=1)
    cpu = run("gpt-1.3b", dp=8, zero=3, offload="cpu", micro_batch=8, num_micro=1)
    nvme = run("gpt-1.3b", dp=8, zero=3, offload="nvme", micro_batch=8, num_micro=1)
    assert dev.optimizer_s < cpu.optimizer_s < nvme.optimizer_s


def test_tensor_parallel_communication_is_on_the_critical_path():
    tp1 = run("llama-7b", global_batch=8, micro_batch=1, num_micro=8)
    tp8 = run("llama-7b", global_batch=8, tp=8, micro_batch=1, num_micro=8)
    assert tp8.detail["tp_comm_s"] > 0 == tp1.detail["tp_comm_s"]
    assert tp8.step_time_s < tp1.step_time_s  # 8 GPUs share the compute


def test_presets_have_finite_predictions():
    for name in PRESETS:
        st = run(name, global_batch=8, micro_batch=1, num_micro=8)
        assert st.step_time_s > 0 and st.tokens_per_s > 0


def test_tied_pipeline_sums_the_embedding_gradient_and_tp_dp_reduces_in_fp32():
    from dataclasses import replace

    tied, untied = shape("gpt2-124m"), replace(shape("gpt2-124m"), tie_embeddings=False)
    lay = Layout(dtype="bf16", pp=2, dp=4, micro_batch=4, num_micro=8)
    p, shard = _stage_params(tied, 1, 2, 0, 1, 4)
    extra = step_time(tied, lay, H100, 128, 8, p, shard).detail["p2p_s"] - \
        step_time(untied, lay, H100, 128, 8, p, shard).detail["p2p_s"]
    # One all-reduce of the (vocab, hidden) bf16 gradient between the two stages (ranks 4 apart,
    # one node of 8): a 2-rank ring.
    assert extra == pytest.approx(collective_s("all_reduce", 2, tied.vocab * tied.hidden * 2, "intra", H100))
    # zero 0/1 with tp or pp average gradients in fp32 buckets (parallel/grad_sync.py); DDP alone in the low dtype
    comm = {(tp, dtype): run("gpt2-124m", dp=4, tp=tp, dtype=dtype, micro_batch=4, num_micro=4).detail["dp_comm_s"]
            for tp in (1, 2) for dtype in ("bf16", "fp32")}
    assert comm[2, "bf16"] == comm[2, "fp32"] > 0
    assert comm[1, "bf16"] < comm[1, "fp32"]


def _h100_profile(rate: float):
    """A profile of a made-up H100 cluster: GEMMs at `rate`, 2 TB/s, 8-rank NVLink collectives."""
    from workbench.hwprofile import HardwareProfile

    gemm = tuple(("bf16", m, n, k, 5e-6 + 2 * m * n * k / rate)
                 for m, n, k in [(256, 256, 256), (1024, 1024, 1024), (4096, 4096, 4096), (8192, 1024, 8192),
                                 (512, 8192, 1024), (2048, 512, 128)])
    colls = tuple((kind, "intra", 8, nbytes, 14 * 2e-6 + 1.75 * nbytes / 200e9)
                  for kind in ("all_reduce", "all_gather", "reduce_scatter", "p2p") for nbytes in (1 << 16, 1 << 24, 1 << 30))
    return HardwareProfile(device="h100-80gb", created="2026-12-02T10:00:00+00:00", host="node0", backend="ray",
                           nodes=1, ranks_per_node=8, threads_per_rank=1, gemm=gemm, memory_bw=2e12,
                           op_overhead_s=6e-6, collectives=colls)


def test_plan_uses_a_calibrated_profile_and_says_so(tmp_path, monkeypatch):
    from workbench.hwprofile import default_profile_path, save_profile
    from workbench.planner import plan

    spec = {"model": {"preset": "gpt2-124m"}, "train": {"global_batch": 64, "micro_batch": 8}, "layout": {"dp": 8},
            "precision": {"dtype": "bf16"}, "resources": {"gpu": "h100-80gb", "gpus_per_node": 8, "nodes": 1}}
    catalog = plan(spec)
    assert catalog.source == "catalog defaults (h100-80gb)" and "step times: catalog defaults" in catalog.table()
    slow, fast = tmp_path / "slow.yaml", tmp_path / "fast.yaml"
    save_profile(_h100_profile(200e12), slow)
    save_profile(_h100_profile(600e12), fast)
    a, b = plan(spec, profile=str(slow)), plan(spec, profile=fast)
    assert a.source.startswith("calibrated on this cluster, 2026-12-02") and a.source in a.table()
    assert a.to_dict()["source"] == a.source
    # the same layout predicts faster on the faster profile, and the profile is used, not the catalog
    assert b.given.step_time_s < a.given.step_time_s != catalog.given.step_time_s
    save_profile(_h100_profile(600e12), default_profile_path("h100-80gb"))  # what `workbench calibrate` writes
    assert plan(spec).given.step_time_s == b.given.step_time_s
    assert plan({**spec, "resources": {"gpu": "a100-80gb"}}).source == "catalog defaults (a100-80gb)"


def test_no_mfu_on_cpu():
    from workbench.planner import plan

    r = plan({"model": {"preset": "gpt-tiny"}, "train": {"global_batch": 8, "micro_batch": 2},
              "layout": {"dp": 2}, "resources": {"gpu": "cpu", "gpus_per_node": 2}})
    assert r.given.mfu is None and all(c.mfu is None for c in r.candidates)
    assert "MFU: not given on CPU" in r.table() and "run `workbench calibrate`" in r.source


def _cpu_profile(**kw):
    """A made-up 2-rank CPU profile: 50 GFLOP/s fp32 GEMMs (bf16 a quarter), 8 GB/s, 1 GB/s collectives."""
    from workbench.hwprofile import HardwareProfile

    gemm = tuple((d, m, n, k, 5e-6 + 2 * m * n * k / (50e9 if d == "fp32" else 12.5e9))
                 for d in ("fp32", "bf16") for m, n, k in [(64, 64, 64), (256, 256, 256), (512, 1024, 256),
                                                           (1024, 256, 1024), (128, 32, 512), (32, 512, 128)])
    colls = tuple((kind, "intra", 2, nbytes, 50e-6 + nbytes / 1e9)
                  for kind in ("all_reduce", "all_gather", "reduce_scatter", "p2p") for nbytes in (4096, 1 << 20, 1 << 26))
    base = dict(device="cpu", created="2026-12-02T10:00:00+00:00", host="box", backend="local", nodes=1,
                ranks_per_node=2, threads_per_rank=1, gemm=gemm, memory_bw=8e9, op_overhead_s=10e-6, collectives=colls)
    return HardwareProfile(**{**base, **kw})


MINI = {"model": {"preset": "gpt-mini"}, "train": {"global_batch": 16, "micro_batch": 4},
        "resources": {"gpu": "cpu", "gpus_per_node": 2}}


@pytest.mark.parametrize("layout, family, blocks", [
    ({"dp": 2}, "ddp", 6), ({"dp": 2, "zero": 3}, "zero3", 6), ({"dp": 1, "tp": 2}, "tp", 6),
    ({"dp": 1, "pp": 2, "pp_schedule": "1f1b"}, "pp", 3), ({"dp": 1}, "single", 6)])
def test_measured_runtime_overhead_is_charged_per_step_per_block_and_per_micro_batch_of_its_family(layout, family, blocks):
    from workbench.memory.params import block_numel
    from workbench.planner import plan
    from workbench.spec import load_spec

    spec = {**MINI, "layout": layout}
    if layout["dp"] == 1 and "tp" not in layout and "pp" not in layout:
        spec["resources"] = {"gpu": "cpu", "gpus_per_node": 1}
    without = plan(spec, profile=_cpu_profile()).given
    others = tuple((f, 1.0, 1.0, 1.0) for f in ("pp", "tp", "zero3", "zero2", "zero1", "ddp", "single") if f != family)
    with_ = plan(spec, profile=_cpu_profile(overheads=((family, 0.02, 0.003, 1e-9, 0.005, 2e-9),) + others)).given
    micros = 16 // (4 * layout["dp"])
    block = block_numel(load_spec(spec).model.shape(), layout.get("tp", 1))  # a block's parameters on the rank
    assert with_.step_time_s - without.step_time_s == pytest.approx(
        0.02 + blocks * (micros * (0.003 + 1e-9 * block) + 0.005 + 2e-9 * block), rel=1e-9)
    # the other families' figures are not charged to this layout
    assert plan(spec, profile=_cpu_profile(overheads=others)).given.step_time_s == without.step_time_s


def test_bf16_elementwise_work_at_its_measured_rate():
    from workbench.planner import plan

    spec = {**MINI, "layout": {"dp": 2}, "precision": {"dtype": "bf16"}}
    same = plan(spec, profile=_cpu_profile()).given
    half = plan(spec, profile=_cpu_profile(memory_bw_dtype=(("bf16", 4e9),))).given
    assert half.step_time_s > same.step_time_s  # the block's memory-bound bytes at half the rate
    fp32 = {**spec, "precision": {"dtype": "fp32"}}
    assert plan(fp32, profile=_cpu_profile(memory_bw_dtype=(("bf16", 4e9),))).given.step_time_s == \
        plan(fp32, profile=_cpu_profile()).given.step_time_s


def test_backward_gemms_at_their_measured_layout_where_the_profile_has_them():
    from workbench.planner import plan

    spec = {**MINI, "layout": {"dp": 2}, "precision": {"dtype": "bf16"}}
    base = _cpu_profile()
    like_forward = tuple((kind, d, m, n, k, t) for kind in ("dgrad", "wgrad") for d, m, n, k, t in base.gemm)
    slow_dgrad = tuple((kind, d, m, n, k, t * (5 if kind == "dgrad" and d == "bf16" else 1))
                       for kind, d, m, n, k, t in like_forward)
    same = plan(spec, profile=_cpu_profile(gemm_grad=like_forward)).given.step_time_s
    assert same == pytest.approx(plan(spec, profile=base).given.step_time_s, rel=0.05)
    assert plan(spec, profile=_cpu_profile(gemm_grad=slow_dgrad)).given.step_time_s > 1.5 * same
    fp32 = {**spec, "precision": {"dtype": "fp32"}}
    assert plan(fp32, profile=_cpu_profile(gemm_grad=slow_dgrad)).given.step_time_s == \
        plan(fp32, profile=_cpu_profile(gemm_grad=like_forward)).given.step_time_s


# -- the predictor refuses exactly what validate + run refuse (#28) ----------------------------------
# gpt-tiny (4 layers, 4 heads), llama-tiny (kv_heads 2, ffn 192), gpt2-xl (25 heads: only tp 1 divides it),
# llama3-405b (126 layers: pp 16 x 8 virtual stages is 128 stages)
WALK_PRESETS = ("gpt-tiny", "llama-tiny", "gpt2-xl", "llama3-405b")


def _random_layout(rng):
    """A random (preset, layout, micro_batch, global_batch) within every field's own bounds: the rules
    between the fields are what the walk is about."""
    dp, tp, pp = rng.choice((1, 2, 3, 4)), rng.choice((1, 1, 2, 2, 3, 4, 8)), rng.choice((1, 2, 3, 4, 16))
    layout = {"dp": dp, "tp": tp, "pp": pp, "zero": rng.choice((0, 1, 2, 3)),
              "offload": rng.choice(("none", "none", "cpu", "nvme")),
              "activation_checkpointing": rng.choice(("none", "selective", "full")),
              "pp_schedule": rng.choice(("1f1b", "gpipe", "interleaved-1f1b", "zero-bubble")),
              "virtual_stages": rng.choice((1, 2, 3, 4, 8)), "sequence_parallel": rng.random() < 0.4}
    mb = rng.choice((1, 2, 3, 4))
    gb = dp * mb * rng.choice((1, 2, 3, 4, 6, 8, 9, 16, 32)) if rng.random() < 0.8 else rng.choice((1, 6, 9, 64))
    return rng.choice(WALK_PRESETS), layout, mb, gb


def _validate_verdict(preset, layout, mb, gb) -> str | None:
    """None when `workbench validate` (load_spec + check_runnable) accepts the layout, else its message."""
    from workbench.errors import ConfigError
    from workbench.spec import load_spec
    from workbench.validate import check_runnable

    world = layout["dp"] * layout["tp"] * layout["pp"]
    gpn = 8 if world % 8 == 0 else world
    raw = {"model": {"preset": preset}, "layout": layout, "train": {"micro_batch": mb, "global_batch": gb},
           "precision": {"dtype": "bf16"}, "resources": {"gpu": "h100-80gb", "gpus_per_node": gpn, "nodes": world // gpn}}
    try:
        check_runnable(load_spec(raw))
    except ConfigError as e:
        return str(e)
    return None


def _predictor_verdict(preset, layout, mb, gb) -> str | None:
    """None when step_time prices the layout, else its ConfigError's message."""
    from workbench.errors import ConfigError
    from workbench.parallelism import num_micro_batches

    sh = shape(preset)
    lay = Layout(**layout, micro_batch=mb, num_micro=num_micro_batches(gb, layout["dp"], mb), dtype="bf16",
                 device="cuda")
    try:
        p, shard = _stage_params(sh, lay.tp, lay.pp, 0, lay.chunks, lay.dp)
        st = step_time(sh, lay, H100, gb, 8, p, shard)
    except ConfigError as e:
        return str(e)
    assert st.step_time_s > 0 and st.tokens_per_s > 0
    return None


def test_predictor_refuses_exactly_the_layouts_validate_refuses_with_the_same_error():
    """A random walk over layouts (degrees, ZeRO, offload, checkpointing, schedules, virtual stages,
    sequence parallel, batch splits) of four shapes: step_time accepts a layout exactly when `workbench
    validate` does, and refuses it with validate's own ConfigError (rule, numbers, fix)."""
    import random

    rng = random.Random(28)
    verdicts = []
    for _ in range(800):
        case = _random_layout(rng)
        expected = _validate_verdict(*case)
        assert _predictor_verdict(*case) == expected, case
        verdicts.append(expected)
    # the walk reaches acceptance and every layout rule of validate and run
    assert sum(v is None for v in verdicts) >= 100
    for rule in ("must divide model.", "pipeline stages (pp=", "must be divisible by dp", "needs at least pp(",
                 "in rounds of pp(", "offload=cpu with zero", "offload=nvme with zero", "with dp=1",
                 "sequence_parallel=true shards", "with pp_schedule=zero-bubble"):
        assert any(v and rule in v for v in verdicts), rule


def test_llama3_405b_on_16_stages_of_8_virtual_stages_is_refused_not_priced():
    """126 layers over pp 16 x 8 virtual stages = 128 stages: the runtime refuses it (a stage without a
    block), so step_time does too, with the numbers; with the engine's own split (Llama 3's: the first
    chunk holds only the embedding, the last only the head) it prices what that engine ran."""
    from workbench.errors import ConfigError
    from workbench.steptime import engine_split, split_params

    sh = shape("llama3-405b")
    lay = Layout(dp=128, tp=8, pp=16, zero=1, pp_schedule="interleaved-1f1b", virtual_stages=8,
                 sequence_parallel=True, micro_batch=1, num_micro=16, dtype="bf16", device="cuda")
    p, shard = _stage_params(sh, 8, 16, 0, 8, 128)
    with pytest.raises(ConfigError, match=r"128 pipeline stages \(pp=16 x virtual_stages=8\) but the model has 126"):
        step_time(sh, lay, H100, 2048, 8, p, shard)
    split = engine_split(126, 16, 8, account_for_embedding=True, account_for_loss=True)
    assert split == (0,) + (1,) * 126 + (0,)
    p, shard = split_params(sh, 8, 16, 8, 128, split)
    even = step_time(sh, lay, H100, 2048, 8, p, shard, split=split)
    v4 = Layout(**{**lay.__dict__, "virtual_stages": 4})
    p4, shard4 = _stage_params(sh, 8, 16, 0, 4, 128)
    assert even.bubble < step_time(sh, v4, H100, 2048, 8, p4, shard4).bubble
    with pytest.raises(ConfigError, match="summing to the model's 126 layers"):
        step_time(sh, lay, H100, 2048, 8, p, shard, split=(1,) * 128)


@pytest.mark.parametrize("kw, match", [
    ({"pp": 16, "chunks": 4}, r"num_layers should be divisible|divide evenly"),
    ({"pp": 16, "chunks": 3, "account_for_embedding": True, "account_for_loss": True}, "vp_size"),
    ({"pp": 4, "chunks": 1, "first": 31, "last": 30}, "left over stages"),
])
def test_engine_split_refuses_what_megatron_core_asserts(kw, match):
    """Megatron-Core's get_num_layers_to_build asserts an even split of what the first/last stage flags
    leave, and layers per rank divisible by the virtual stages."""
    from workbench.errors import ConfigError
    from workbench.steptime import engine_split

    with pytest.raises(ConfigError, match=match):
        engine_split(126, **kw)
    assert engine_split(126, 4, 1, first=30, last=30) == (30, 33, 33, 30)


def test_the_fused_attention_core_at_its_measured_time_where_the_profile_has_it():
    """On this CPU in bf16, scaled_dot_product_attention's backward ran 3x fp32's while bf16 GEMMs ran 2-3x
    faster than fp32's (bench j, 4 December): a GEMM's rate does not price the fused kernel."""
    from workbench.planner import plan

    spec = {**MINI, "layout": {"dp": 2}, "precision": {"dtype": "bf16"}}
    base = plan(spec, profile=_cpu_profile()).given.step_time_s
    # gpt-mini: 8 heads of 32 over 128 tokens, 4 sequences per micro-batch; 2 micro-batches of 6 blocks a rank
    rows = (("fwd", "bf16", 4, 8, 128, 32, 2e-3), ("bwd", "bf16", 4, 8, 128, 32, 10e-3))
    measured = plan(spec, profile=_cpu_profile(attention=rows)).given.step_time_s
    quick, slow = (plan(spec, profile=_cpu_profile(attention=rows[:1] + (("bwd", "bf16", 4, 8, 128, 32, t),)))
                   .given.step_time_s for t in (0.0005, 0.0105))
    assert slow - quick == pytest.approx(2 * 6 * 0.010, rel=1e-6)  # each block's backward, each micro-batch
    assert measured > base
    fp32 = {**spec, "precision": {"dtype": "fp32"}}
    assert plan(fp32, profile=_cpu_profile(attention=rows)).given.step_time_s == \
        plan(fp32, profile=_cpu_profile()).given.step_time_s  # no fp32 rows: priced as GEMMs, as before


def test_the_norms_and_activation_at_their_measured_time_where_the_profile_has_it():
    """On this CPU the tanh GELU ran 4x its bytes at the measured bandwidth (256 x 256 fp32, 5 December):
    calibrate times a block's norm and activation at the model's shapes, and the model prices them so."""
    from workbench.planner import plan

    spec = {**MINI, "layout": {"dp": 2}}  # gpt-mini: 512 tokens a micro-batch, 256 wide, MLP 1024; 6 blocks, 2 micro-batches
    base = plan(spec, profile=_cpu_profile()).given.step_time_s

    def timed(gelu_bwd: float) -> float:
        rows = (("gelu_tanh", "fwd", "fp32", 512, 1024, 1e-3), ("gelu_tanh", "bwd", "fp32", 512, 1024, gelu_bwd),
                ("layer_norm", "fwd", "fp32", 512, 256, 1e-4), ("layer_norm", "bwd", "fp32", 512, 256, 2e-4))
        return plan(spec, profile=_cpu_profile(elementwise=rows)).given.step_time_s

    assert timed(2e-3) > base  # 8 GB/s prices the GELU's forward at 0.5 ms: measured, 1 ms
    assert timed(3e-3) - timed(2e-3) == pytest.approx(6 * 2 * 1e-3, rel=1e-6)  # each block's, each micro-batch
    bf16 = {**spec, "precision": {"dtype": "bf16"}}
    assert plan(bf16, profile=_cpu_profile(elementwise=(("gelu_tanh", "fwd", "fp32", 512, 1024, 1e-3),))) \
        .given.step_time_s == plan(bf16, profile=_cpu_profile()).given.step_time_s  # no bf16 rows: its bytes, as before


def test_plan_says_when_the_profile_did_not_time_the_models_own_matmuls():
    """A profile calibrated on another model extrapolates its fits (docs/planning.md, "Each model on
    its own profile"): plan says so, and names a shape, and the norm and activation, it did not time."""
    from workbench.calibrate import model_forward_shapes
    from workbench.planner import plan
    from workbench.spec import load_spec

    spec = {**MINI, "layout": {"dp": 2}}
    other = plan(spec, profile=_cpu_profile())
    assert any("did not time 2 of this model's forward matmul shapes (e.g. 512 x 256 x 256" in n and "workbench calibrate" in n
               for n in other.notes), other.notes
    assert any("nor its layer_norm and gelu_tanh in fp32" in n for n in other.notes), other.notes
    own = tuple((d, m, n, k, 2 * m * n * k / 50e9) for d in ("fp32", "bf16") for m, n, k in model_forward_shapes(load_spec(spec)))
    timed = plan(spec, profile=_cpu_profile(gemm=_cpu_profile().gemm + own))
    assert not any("matmul shapes" in n for n in timed.notes), timed.notes
    assert any("did not time its layer_norm and gelu_tanh in fp32" in n for n in timed.notes), timed.notes
    ops = tuple((op, k, "fp32", 512, w, 1e-4) for op, w in (("layer_norm", 256), ("gelu_tanh", 1024)) for k in ("fwd", "bwd"))
    both = plan(spec, profile=_cpu_profile(gemm=_cpu_profile().gemm + own, elementwise=ops))
    assert not any("did not time" in n for n in both.notes), both.notes


def test_calibrate_times_the_norm_and_activation_shapes_the_model_prices():
    """llama-tiny at tp 2 with sequence parallelism, 2 sequences of 64 a micro-batch: the RMSNorm over
    all 128 rows at tp 1 and over this rank's 64 with sp; SwiGLU over 192 and 96 columns; and the
    strategy probes' near-empty gpt (2 sequences of 32 tokens, 64 wide, MLP 256)."""
    from workbench.calibrate import model_elementwise_shapes
    from workbench.spec import load_spec

    spec = load_spec({"model": {"preset": "llama-tiny"}, "train": {"global_batch": 2, "micro_batch": 2},
                      "layout": {"tp": 2, "sequence_parallel": True},
                      "resources": {"gpu": "cpu", "gpus_per_node": 2}})
    assert model_elementwise_shapes(spec) == [["gelu_tanh", 64, 256], ["layer_norm", 64, 64], ["rms_norm", 64, 64],
                                              ["rms_norm", 128, 64], ["swiglu", 128, 96], ["swiglu", 128, 192]]


def test_sequence_parallel_on_a_cpu_is_priced_with_the_runtimes_backward_rows():
    """On gloo with one stage, no recompute and no FSDP, our sequence parallel issues plain TP's 4
    collectives per block (the backward's all-reduces carry 3x the bytes) and one all-gather per
    micro-batch (parallel/sequence_parallel.py BackwardRows); with a recompute, 6 per block as before."""
    from workbench.catalog import get_device
    from workbench.steptime import Hardware

    def tp_comm(**layout):
        sh, lay = shape("gpt-mini"), Layout(dtype="fp32", tp=2, micro_batch=4, num_micro=1, **layout)
        p, shard = _stage_params(sh, 2, 1, 0, 1, 1)
        hw = Hardware(get_device("cpu"), 2, _cpu_profile())
        return step_time(sh, lay, hw.dev, 4, 2, p, shard, hw=hw).detail["tp_comm_s"]

    hw = Hardware(get_device("cpu"), 2, _cpu_profile())
    act = 4 * 128 * 256 * 4  # gpt-mini: 4 sequences of 128 tokens, 256 wide, fp32; 6 blocks
    expected = 6 * (2 * hw.collective_s("all_reduce", 2, act, 1) + 2 * hw.collective_s("all_reduce", 2, 3 * act, 1)) \
        + hw.collective_s("all_gather", 2, 3 * act, 1)
    assert tp_comm(sequence_parallel=True) == pytest.approx(expected, rel=1e-9)
    assert tp_comm(sequence_parallel=True, activation_checkpointing="full") > tp_comm(sequence_parallel=True)
