"""Step-time model: FLOPs formula, bubble, recomputation, communication placement."""
import pytest

from workbench.catalog import DEVICES
from workbench.memory import Layout
from workbench.memory.estimate import _stage_params
from workbench.models import PRESETS, resolve_shape
from workbench.spec import ModelSpec
from workbench.steptime import PEAK_EFFICIENCY, flops_per_token, step_time

H100 = DEVICES["h100-80gb"]


def shape(name):
    return resolve_shape(ModelSpec(preset=name))


def run(name, gpn=8, global_batch=64, **kw):
    sh = shape(name)
    lay = Layout(dtype="bf16", **kw)
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
    assert full.mfu < base.mfu <= PEAK_EFFICIENCY


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


def test_zero3_moves_more_bytes_than_ddp():
    ddp = run("gpt-1.3b", dp=8, micro_batch=8, num_micro=1)
    z3 = run("gpt-1.3b", dp=8, zero=3, micro_batch=8, num_micro=1)
    assert z3.detail["dp_comm_s"] == pytest.approx(1.5 * ddp.detail["dp_comm_s"])


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


def test_megatron_gpt3_175b_throughput_anchor():
    """Narayanan et al. 2021 (arXiv:2104.04473), Table 1: GPT-3 175B on 1536 A100s (tp 8, pp 12,
    interleaved, full recomputation, batch 1536, seq 2048) reached 148 TFLOP/s per GPU, counted
    with their Eq. 3: 96 B s l h^2 (1 + s/6h + V/16lh) per iteration."""
    from workbench.memory import layout_from_spec
    from workbench.spec import load_spec

    spec = load_spec({"model": {"family": "gpt", "layers": 96, "hidden": 12288, "heads": 96, "vocab": 51200,
                                "seq_len": 2048, "tie_embeddings": False},
                      "train": {"global_batch": 1536, "micro_batch": 1},
                      "layout": {"dp": 16, "tp": 8, "pp": 12, "pp_schedule": "interleaved-1f1b",
                                 "activation_checkpointing": "full"},
                      "precision": {"dtype": "fp16"}, "resources": {"gpu": "a100-80gb", "gpus_per_node": 8, "nodes": 192}})
    lay, sh = layout_from_spec(spec), spec.model.shape()
    p, shard = _stage_params(sh, lay.tp, lay.pp, 0, lay.chunks, lay.dp)
    st = step_time(sh, lay, DEVICES["a100-80gb"], 1536, 8, p, shard)
    B, s, l, h, V = 1536, 2048, 96, 12288, 51200
    eq3 = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    assert eq3 / st.step_time_s / 1536 / 1e12 == pytest.approx(148, rel=0.15)


def test_tied_pipeline_sums_the_embedding_gradient_and_tp_dp_reduces_in_fp32():
    from dataclasses import replace

    tied, untied = shape("gpt2-124m"), replace(shape("gpt2-124m"), tie_embeddings=False)
    lay = Layout(dtype="bf16", pp=2, dp=4, micro_batch=4, num_micro=8)
    p, shard = _stage_params(tied, 1, 2, 0, 1, 4)
    extra = step_time(tied, lay, H100, 128, 8, p, shard).detail["p2p_s"] - \
        step_time(untied, lay, H100, 128, 8, p, shard).detail["p2p_s"]
    # One all-reduce of the (vocab, hidden) bf16 gradient between the two stages (ranks 4 apart,
    # one node of 8): a 2-rank ring moves the bytes once.
    assert extra == pytest.approx(tied.vocab * tied.hidden * 2 / H100.intra_node_bw, rel=1e-6)
    bf16 = run("gpt2-124m", dp=4, tp=2, micro_batch=4, num_micro=4)
    assert bf16.detail["dp_comm_s"] > 0
    fsdp = run("gpt2-124m", dp=4, tp=2, zero=2, micro_batch=4, num_micro=4)
    assert bf16.detail["dp_comm_s"] == pytest.approx(2 * fsdp.detail["dp_comm_s"])  # fp32 vs bf16 buckets
