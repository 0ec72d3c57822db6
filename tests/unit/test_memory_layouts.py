"""The memory estimator per strategy: byte tables, stage/TP splits, schedules, checkpointing."""
import json

import pytest

from workbench import ConfigError, estimate_memory, load_spec
from workbench.memory import Layout, estimate_stage
from workbench.memory import activations as act
from workbench.memory.params import fsdp_shard_numel, rank_params, rank_tensors, stage_blocks

TINY = {"model": {"preset": "gpt-tiny"}, "train": {"global_batch": 16, "micro_batch": 2}}


def spec(**layout):
    lay = {"dp": 1, **layout}
    n = lay["dp"] * lay.get("tp", 1) * lay.get("pp", 1)
    extra = {k: layout.pop(k) for k in ("dtype", "optimizer") if k in layout}
    raw = {**TINY, "layout": {k: v for k, v in lay.items() if k not in extra}, "resources": {"gpus_per_node": n}}
    raw["precision"] = {"dtype": extra.get("dtype", "fp32")}
    raw["train"] = {**TINY["train"], "optimizer": extra.get("optimizer", "adamw")}
    return load_spec(raw)


def adam_steps(s):
    """torch's Adam keeps one 4-byte step counter per parameter tensor."""
    return 4 * len(rank_tensors(s.model.shape(), 1, 1, 0))


def rank0(s):
    return estimate_memory(s).to_dict()["per_rank"][0]


def test_fp32_ddp_bytes_per_parameter():
    s = spec(dp=2)
    n = s.model.shape().num_params()
    r = rank0(s)
    assert (r["params"], r["grads"], r["master"], r["optimizer"]) == (4 * n, 4 * n, 0, 8 * n + adam_steps(s))
    # DDP's buckets are the gradients (gradient_as_bucket_view): the only transient is the logits.
    sh = s.model.shape()
    assert r["buffers"] == 2 * sh.seq_len * sh.vocab * 4


@pytest.mark.parametrize("optimizer, per_param", [("adamw", 8), ("adam", 8), ("sgd", 4)])
def test_optimizer_state_bytes(optimizer, per_param):
    s = spec(optimizer=optimizer)
    steps = adam_steps(s) if optimizer != "sgd" else 0
    assert rank0(s)["optimizer"] == per_param * s.model.shape().num_params() + steps


def test_bf16_zero_stages_shrink_what_they_shard():
    n = spec().model.shape().num_params()
    r0, r1, r3 = (rank0(spec(dp=4, zero=z, dtype="bf16")) for z in (0, 1, 3))
    assert (r0["params"], r0["grads"], r0["master"], r0["optimizer"]) == (2 * n, 2 * n, 4 * n, 8 * n)
    assert r1["params"] == 2 * n and r1["master"] == pytest.approx(n, rel=0.02) and r1["optimizer"] == pytest.approx(2 * n, rel=0.02)
    assert r3["params"] == 0 and r3["master"] == pytest.approx(n, rel=0.02)


def test_pipeline_stages_partition_the_model():
    shape = spec().model.shape()
    assert sum(rank_params(shape, 1, 2, k) for k in range(2)) == shape.num_params()
    mini = load_spec({**TINY, "model": {"preset": "gpt-mini"}}).model.shape()
    split = stage_blocks(mini, 4)
    assert [b.start for b in split[1:]] == [b.stop for b in split[:-1]] and split[-1].stop == mini.layers
    assert min(len(b) for b in split) >= 1
    inter = sum(rank_params(shape, 1, 2, k, virtual_stages=2) for k in range(2))
    assert inter == shape.num_params()


def test_stage_split_is_the_runtimes():
    pp = pytest.importorskip("workbench.parallel.pp")
    if not hasattr(pp, "balance_blocks"):
        pytest.skip("runtime without pipeline split")
    import torch

    from workbench.models import GPT

    for preset, stages in (("gpt-mini", 4), ("gpt-tiny", 3), ("llama-7b", 6)):
        shape = load_spec({**TINY, "model": {"preset": preset}}).model.shape()
        with torch.device("meta"):
            model = GPT(shape)
        blocks = [sum(p.numel() for p in model.blocks[k].parameters()) for k in sorted(model.blocks, key=int)]
        first = sum(p.numel() for p in model.tok_emb.parameters()) + (
            sum(p.numel() for p in model.pos_emb.parameters()) if model.pos_emb is not None else 0)
        last = sum(p.numel() for p in model.norm.parameters()) + sum(p.numel() for p in model.head.parameters())
        assert list(pp.balance_blocks(blocks, first, last, stages)) == list(stage_blocks(shape, stages))


def test_tied_pipeline_last_stage_holds_the_embedding_copy():
    # The runtime's stages (split on meta) against the model: the last stage's head is a copy.
    from workbench.models import build_model_meta
    from workbench.parallel.pp import split_stage
    from workbench.parallel.tied import is_tied

    tied = load_spec({**TINY, "model": {"preset": "gpt2-124m", "tie_embeddings": True}})
    shape = tied.model.shape()
    model = build_model_meta(tied)
    assert is_tied(model)
    assert sum(rank_params(shape, 1, 2, k) for k in range(2)) == shape.num_params() + shape.vocab * shape.hidden
    assert rank_params(shape, 1, 1, 0) == shape.num_params()  # one stage: one weight
    for k, blocks in enumerate(stage_blocks(shape, 2)):
        stage = split_stage(model, blocks, first=k == 0, last=k == 1)
        assert sum(p.numel() for p in stage.parameters()) == rank_params(shape, 1, 2, k)


def test_tensor_parallel_splits_matrices_and_keeps_norms_whole():
    shape = spec().model.shape()
    local = rank_params(shape, 2, 1, 0)
    replicated = sum(t.shape[0] for t in rank_tensors(shape, 2, 1, 0) if len(t.shape) == 1
                     and ("norm" in t.name or t.name.endswith(("wo.bias", "w2.bias"))))
    # Sharded part halves, replicated part stays: 2 x local = total + replicated (+ positions).
    pos = shape.seq_len * shape.hidden
    assert 2 * local == shape.num_params() + replicated + pos


def test_fsdp_shard_pads_dim0():
    shape = spec().model.shape()
    tensors = rank_tensors(shape, 1, 1, 0)
    assert fsdp_shard_numel(tensors, 1) == shape.num_params()
    shard = fsdp_shard_numel(tensors, 3)
    assert 3 * shard >= shape.num_params() and 3 * shard < shape.num_params() + 3 * sum(
        t.shape[1] if len(t.shape) > 1 else 1 for t in tensors)


def test_offload_moves_optimizer_state_off_the_device():
    r = estimate_memory(spec(dp=2, zero=3, offload="cpu", dtype="bf16")).to_dict()
    rank = r["per_rank"][0]
    assert rank["master"] == rank["optimizer"] == rank["grads"] == 0
    assert rank["offloaded_bytes"] > 0 and r["offloaded_to"] == "host memory"
    nvme = estimate_memory(spec(dp=2, zero=1, offload="nvme", dtype="bf16")).to_dict()
    assert nvme["per_rank"][0]["offloaded_bytes"] > 0 and "files" in nvme["offloaded_to"]


def test_1f1b_first_stage_holds_the_most_microbatches():
    shape = spec().model.shape()
    lay = Layout(pp=4, micro_batch=1, num_micro=8)
    first, last = estimate_stage(shape, lay, 0), estimate_stage(shape, lay, 3)
    gpipe = estimate_stage(shape, Layout(pp=4, micro_batch=1, num_micro=8, pp_schedule="gpipe"), 0)
    assert gpipe.activations > first.activations > 0
    # Stage 0: 4 micro-batches of one block + embedding; stage 3: one of one block + head.
    one = estimate_stage(shape, Layout(pp=4, micro_batch=1, num_micro=1, pp_schedule="gpipe"), 0).activations
    ids = act.token_batch_bytes  # the step's token batch, held once
    assert first.activations - ids(8, shape.seq_len) == 4 * (one - ids(1, shape.seq_len))
    assert last.activations < first.activations


def test_checkpointing_and_sequence_parallel_shrink_activations():
    shape = load_spec({**TINY, "model": {"preset": "gpt-mini"}}).model.shape()
    acts = [estimate_stage(shape, Layout(activation_checkpointing=m, micro_batch=4), 0).activations
            for m in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2]
    tp = estimate_stage(shape, Layout(tp=2, micro_batch=4), 0).activations
    sp = estimate_stage(shape, Layout(tp=2, sequence_parallel=True, micro_batch=4), 0).activations
    assert acts[0] > tp > sp


def test_contract_json_and_views():
    est = estimate_memory(spec(dp=2, pp=2))
    d = json.loads(json.dumps(est.to_dict()))
    assert set(d) >= {"world_size", "device_memory", "fits", "per_rank", "convention"}
    for r in d["per_rank"]:
        parts = sum(r[k] for k in ("params", "grads", "master", "optimizer", "activations", "buffers"))
        assert r["total"] == parts
    assert d["fits"] is True
    assert "fits" in est.table() and "pp1" in est.table()
    assert "<table>" in est._repr_html_()


def test_does_not_fit_is_reported():
    s = load_spec({"model": {"preset": "llama-70b"}, "train": {"global_batch": 8, "micro_batch": 1},
                   "layout": {"dp": 8}, "precision": {"dtype": "bf16"},
                   "resources": {"gpu": "h100-80gb", "gpus_per_node": 8}})
    est = estimate_memory(s)
    assert est.fits is False and "DOES NOT FIT" in est.table()
    huge = estimate_memory(load_spec({"model": {"family": "gpt", "layers": 2, "hidden": 1 << 20, "heads": 1 << 20,
                                                "vocab": 1 << 24, "seq_len": 1 << 24}, "layout": {"dp": 2},
                                      "resources": {"gpus_per_node": 2}}))
    row = huge.table().splitlines()[2].split()  # every column apart, in TiB / PiB rather than a million GiB
    assert row[:2] == ["pp0", "2"] and row[2::2][:7] == ["224.00", "224.00", "0.0", "448.00", "13.00", "4.00", "17.88"]
    assert row[3::2][:7] == ["TiB", "TiB", "KiB", "TiB", "PiB", "PiB", "PiB"]


def test_a_trusted_factory_model_gets_model_states_from_its_meta_parameters():
    s = load_spec({"model": {"factory": "torch.nn:Linear", "kwargs": {"in_features": 100, "out_features": 10},
                             "vocab": 256, "seq_len": 64, "trust_factory": True},
                   "layout": {"dp": 2}, "resources": {"gpus_per_node": 2}})
    r = rank0(s)
    assert r["params"] == 4 * 1010 and r["optimizer"] == 8 * 1010 and r["activations"] == 0
    with pytest.raises(ConfigError, match="cannot import"):
        estimate_memory(load_spec({"model": {"factory": "no_such_mod:f", "vocab": 256, "seq_len": 64,
                                             "trust_factory": True}}))


def test_cli_memory_json(capsys, tmp_path):
    from workbench.cli import main

    path = tmp_path / "s.yaml"
    spec(dp=2).save(path)
    assert main(["memory", str(path), "--json", "--set", "layout.zero=2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 2 and len(out["per_rank"]) == 2


def _balance_reference(block_params, first, last, num_stages):
    """The runtime's O(S n^2) programme, verbatim in spirit: the fast split must equal it."""
    n = len(block_params)
    prefix = [0]
    for p in block_params:
        prefix.append(prefix[-1] + p)

    def cost(s, i, j):
        return prefix[j] - prefix[i] + (first if s == 0 else 0) + (last if s == num_stages - 1 else 0)

    best = [[float("inf")] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, num_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                c = max(best[s - 1][i], cost(s, i, j))
                if c < best[s][j]:
                    best[s][j], cut[s][j] = c, i
    bounds, j = [], n
    for s in range(num_stages - 1, 0, -1):
        bounds.append(range(cut[s][j], j))
        j = cut[s][j]
    bounds.append(range(0, j))
    return tuple(bounds[::-1])


@pytest.mark.parametrize("n, first, last", [(10, 0, 0), (12, 5, 30), (24, 40, 3), (80, 100, 140), (7, 1000, 1)])
def test_fast_balanced_split_equals_the_quadratic_one(n, first, last):
    from workbench.memory.params import balance_blocks

    for stages in range(1, n + 1):
        blocks = tuple([10] * n)
        assert balance_blocks(blocks, first, last, stages) == _balance_reference(blocks, first, last, stages)


@pytest.mark.parametrize("preset", ["gpt-tiny", "gpt-mini", "llama-tiny"])
@pytest.mark.parametrize("unit_mb", [None, 0.1, 0.4, 1.0, 3.1, 25.0])
def test_fsdp_units_are_the_runtimes(preset, unit_mb):
    """The runtime groups a model's real blocks into FSDP2 units (parallel/zero.py); the memory and
    step-time models count them from the shape: the same units, and the same whole-model unit."""
    from workbench.memory.params import block_numel, largest_unit_numel, unit_blocks, whole_unit
    from workbench.models import build_model_meta
    from workbench.parallel.zero import fsdp_units

    s = load_spec({"model": {"preset": preset}})
    model = build_model_meta(s)
    blocks = list(model.blocks.values())
    units = fsdp_units(blocks, unit_mb)
    assert [b for u in units for b in u] == blocks
    shape = s.model.shape()
    k = unit_blocks(block_numel(shape, 1), unit_mb)
    assert [len(u) for u in units[:-1]] == [k] * (len(units) - 1) and 1 <= len(units[-1]) <= k
    sizes = [sum(p.numel() for b in u for p in b.parameters()) for u in units]
    if unit_mb is None:
        assert len(units) == len(blocks)
    else:
        assert max(sizes) <= max(unit_mb * 2**20 / 4, block_numel(shape, 1))
    embedding = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("tok_emb", "pos_emb")))
    assert largest_unit_numel(shape, 1, unit_mb, len(blocks)) == max(max(sizes), embedding)
    total = sum(p.numel() for p in model.parameters())
    assert whole_unit(shape.num_params(), unit_mb) == (unit_mb is not None and 4 * total <= unit_mb * 2**20)
