"""The planner: valid layouts only, all fitting by the memory model, ranked, priced."""
import json
import os
from pathlib import Path

import pytest

from workbench import ConfigError, estimate_memory, load_spec
from workbench.planner import plan
from workbench.prices import SPOT_FRACTION, load_prices

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama-70b-plan.yaml"


@pytest.fixture(scope="module")
def result():
    return plan(load_spec(EXAMPLE))


def test_70b_on_64_h100_candidates_fit_and_are_ranked(result):
    c = result.candidates
    assert len(c) > 10 and all(x.fits for x in c)
    assert [x.tokens_per_s for x in c] == sorted((x.tokens_per_s for x in c), reverse=True)
    for x in c[:20]:
        lay = x.layout
        assert lay["dp"] * lay["tp"] * lay["pp"] == 64
        assert lay["tp"] <= 8 and 64 % lay["tp"] == 0 and lay["pp"] <= 80
        # the allocated peak + 10% reserve + 0.5 GiB context + NCCL buffers of 3 groups (at most)
        assert x.peak_bytes * 1.1 + 2**29 + 3 * 2**28 <= 81559 * 2**20
        assert 0 < x.mfu < 0.6


def test_planner_peak_equals_estimate_memory_of_that_layout(result):
    """The planner's numbers are the memory model's: rebuild each top layout as a spec."""
    base = load_spec(EXAMPLE).to_dict()
    for x in result.candidates[:5]:
        lay = {k: v for k, v in x.layout.items()}
        raw = {**base, "layout": {**base["layout"], **lay}, "train": {**base["train"], "micro_batch": x.micro_batch}}
        est = estimate_memory(load_spec(raw))
        assert est.peak_bytes == x.peak_bytes and est.fits


def test_prices_and_cost_per_token(result):
    best = result.candidates[0]
    table = load_prices()["h100-80gb"]
    assert set(best.prices) == {"aws", "gcp", "azure"}
    aws = best.prices["aws"]
    assert aws["usd_per_hour"] == pytest.approx(64 * table["aws"].on_demand, abs=0.01)
    assert aws["usd_per_hour_spot"] == pytest.approx(aws["usd_per_hour"] * SPOT_FRACTION["aws"], abs=0.02)
    per_b = aws["usd_per_hour_spot"] / (best.tokens_per_s * 3600) * 1e9
    assert aws["usd_per_billion_tokens_spot"] == pytest.approx(per_b, rel=1e-3)
    assert best.usd_per_hour_spot == min(p["usd_per_hour_spot"] for p in best.prices.values())


def test_price_override_from_yaml_env(tmp_path, monkeypatch):
    path = tmp_path / "prices.yaml"
    path.write_text("h100-80gb:\n  aws: {on_demand: 1.0, spot: 0.5}\n  lambda: {on_demand: 2.0}\n")
    monkeypatch.setenv("WORKBENCH_PRICES", str(path))
    prices = load_prices()["h100-80gb"]
    assert prices["aws"].on_demand == 1.0 and prices["aws"].spot == 0.5
    assert prices["lambda"].spot == pytest.approx(0.8)
    out = plan(load_spec(EXAMPLE), top=1).candidates[0]
    assert out.prices["aws"]["usd_per_hour"] == 64.0 and out.cloud == "aws"


def test_bad_price_override_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="on_demand"):
        load_prices({"h100-80gb": {"aws": {"spot": 1.0}}})
    with pytest.raises(ConfigError, match="prices file .*missing.yaml' does not exist"):
        load_prices(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize("content, needle", [
    (bytes(range(128, 256)), "not UTF-8 text"),
    (b"[" * 100_000, "nested more than 32 levels"),
    (b"a: {aws: {on_demand: 1.0}}\n" * 2 + b"x" * (1 << 20), "too large"),
    (b"h100-80gb: {aws: {on_demand: 1.0}}\nh100-80gb: {aws: {on_demand: 2.0}}\n", "given twice"),
    (None, "is not a regular file"),  # a pipe: a plain open() would wait for a writer forever
])
def test_a_price_table_is_read_with_the_specs_bounds(tmp_path, monkeypatch, content, needle):
    path = tmp_path / "prices.yaml"
    if content is None:
        os.mkfifo(path)
    else:
        path.write_bytes(content)
    monkeypatch.setenv("WORKBENCH_PRICES", str(path))
    with pytest.raises(ConfigError, match=needle):
        load_prices()
    monkeypatch.setenv("WORKBENCH_PRICES", "")  # empty is unset, as WORKBENCH_PROFILE
    assert load_prices()["h100-80gb"]


def test_contract_json_via_cli(capsys):
    from workbench.cli import main

    assert main(["plan", str(EXAMPLE), "--json", "--top", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["candidates"]) == 3
    keys = {"layout", "micro_batch", "fits", "peak_bytes", "step_time_s", "tokens_per_s", "mfu", "usd_per_hour",
            "usd_per_hour_spot"}
    for c in out["candidates"]:
        assert keys <= set(c)
        assert {"dp", "tp", "pp", "zero", "offload", "activation_checkpointing", "pp_schedule"} <= set(c["layout"])


def test_nothing_fits_says_so():
    spec = load_spec({"model": {"preset": "llama-70b"}, "train": {"global_batch": 8, "micro_batch": 1},
                      "layout": {"dp": 2}, "precision": {"dtype": "bf16"},
                      "resources": {"gpu": "t4", "gpus_per_node": 2}})
    r = plan(spec)
    assert r.candidates and not any(c.fits for c in r.candidates)
    assert any("nothing fits" in n for n in r.notes)
    assert "DOES NOT FIT" in r.table()


def test_small_model_prefers_plain_data_parallel():
    spec = load_spec({"model": {"preset": "gpt2-124m"}, "train": {"global_batch": 64, "micro_batch": 8},
                      "layout": {"dp": 8}, "precision": {"dtype": "bf16"},
                      "resources": {"gpu": "h100-80gb", "gpus_per_node": 8}})
    best = plan(spec, top=1).candidates[0]
    assert best.layout["tp"] == 1 and best.layout["pp"] == 1 and best.layout["activation_checkpointing"] == "none"


def test_size_only_model_cannot_be_planned():
    spec = load_spec({"model": {"params": 7e9}, "layout": {"dp": 2}})
    with pytest.raises(ConfigError, match="shape"):
        plan(spec)


def test_candidates_say_whether_the_runtime_runs_them(result):
    from workbench.validate import check_runnable

    for c in result.candidates[:5]:
        assert c.runnable is not None
        raw = load_spec(EXAMPLE).to_dict()
        raw["layout"] = {**raw["layout"], **c.layout}
        raw["train"] = {**raw["train"], "micro_batch": c.micro_batch}
        try:
            check_runnable(load_spec(raw))
            expected = True
        except ConfigError:
            expected = False
        assert c.runnable is expected and (c.not_runnable is None) is expected


def test_cpu_offload_only_with_fsdp(result):
    assert all(c.layout["zero"] >= 2 for c in result.candidates if c.layout["offload"] == "cpu")


def test_given_layout_is_scored_like_a_candidate(result, capsys):
    """`given` is the spec's own layout through the same memory and step-time models."""
    spec = load_spec(EXAMPLE)
    g = result.given
    assert g is not None and result.given_error is None
    assert {k: g.layout[k] for k in ("dp", "tp", "pp", "zero")} == \
        {k: getattr(spec.layout, k) for k in ("dp", "tp", "pp", "zero")}
    assert g.micro_batch == spec.train.micro_batch
    assert g.peak_bytes == estimate_memory(spec).peak_bytes
    assert g.step_time_s > 0 and g.tokens_per_s == pytest.approx(
        spec.train.global_batch * spec.model.shape().seq_len / g.step_time_s)
    from workbench.cli import main

    assert main(["plan", str(EXAMPLE), "--json", "--top", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["given"]["peak_bytes"] == g.peak_bytes and set(out["given"]) >= {
        "fits", "peak_bytes", "step_time_s", "tokens_per_s", "mfu", "usd_per_hour", "usd_per_hour_spot", "prices"}
    assert main(["plan", str(EXAMPLE), "--top", "2"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[2].startswith("you") and table[4].lstrip().startswith("1 ")


def test_plan_searches_when_the_spec_layout_breaks_a_rule(capsys):
    """A layout that does not match the resources: plan still ranks, and `given` says why it is absent."""
    from workbench.cli import main

    assert main(["plan", str(EXAMPLE), "--json", "--top", "1", "--set", "layout.dp=3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["given"] is None and "24 ranks, but resources give 64 GPUs" in out["given_error"]
    assert out["candidates"][0]["fits"]
    assert main(["validate", str(EXAMPLE), "--set", "layout.dp=3"]) == 2  # validate keeps the layout's rules


def test_notebook_memory_panel_shows_the_given_numbers(result):
    pytest.importorskip("ipywidgets")
    from workbench.ui.memory_panel import given_html

    d = result.to_dict(top=3)
    text = given_html(d)
    assert f"{d['given']['tokens_per_s']:,.0f} tokens/s" in text
    assert f"{d['given']['peak_bytes'] / 2**30:.1f} GiB" in text
    assert "24 ranks" in given_html({"given": None, "given_error": "dp(3) x tp(8) x pp(1) = 24 ranks"})


def test_virtual_stages_are_searched(result):
    """Interleaved 1F1B is offered with 2, 4 and 8 virtual stages (each stage keeps a block), and
    GPipe only where 1F1B cannot run."""
    seen = {c.layout.get("virtual_stages") for c in result.candidates if c.layout["pp_schedule"] == "interleaved-1f1b"
            and c.layout["pp"] > 1}
    assert {2, 4, 8} <= seen
    for c in result.candidates:
        lay = c.layout
        assert lay["pp"] * lay.get("virtual_stages", 1) <= 80
        if lay["pp"] > 1 and lay["pp_schedule"] == "gpipe":
            assert 256 // (lay["dp"] * c.micro_batch) < lay["pp"]


def test_top_ten_are_all_runnable(result):
    # bf16 with tp, tied embeddings with pp and pipeline masters in checkpoints run now; what
    # the runtime still refuses (zero=3 with zero-bubble) is not a candidate at all.
    assert all(c.runnable for c in result.candidates[:10])
    assert not any(c.layout["zero"] == 3 and c.layout["pp_schedule"] == "zero-bubble" and c.layout["pp"] > 1
                   for c in result.candidates)
    assert "not runnable" not in result.table()


def test_plan_needs_no_layout(tmp_path, capsys):
    # "Which layout?": a spec with model, batch, precision and resources but no layout (the
    # default dp=1 does not match 64 GPUs) is planned; validate and run still refuse it.
    from workbench.cli import main

    raw = load_spec(EXAMPLE).to_dict()
    raw.pop("layout")
    path = tmp_path / "no-layout.yaml"
    path.write_text(json.dumps(raw))
    assert main(["plan", str(path), "--json", "--top", "10"]) == 0
    out = json.loads(capsys.readouterr().out)
    top = out["candidates"]
    assert len(top) == 10 and all(c["runnable"] for c in top)
    assert all(c["layout"]["dp"] * c["layout"]["tp"] * c["layout"]["pp"] == 64 for c in top)
    assert main(["validate", str(path)]) == 2
    assert "resources give 64 GPUs" in capsys.readouterr().err


@pytest.mark.parametrize("override", [42, {"x": 1}, {"h100-80gb": {"aws": {"on_demand": "abc"}}},
                                      {"h100-80gb": {"aws": {"on_demand": float("nan")}}},
                                      {"h100-80gb": {"aws": {"on_demand": 3.0, "gpus": 0}}}], ids=str)
def test_price_overrides_of_the_wrong_shape_are_config_errors(override):
    from workbench.prices import load_prices

    with pytest.raises(ConfigError, match="prices"):
        load_prices(override)


@pytest.mark.parametrize("preset, nodes", [("llama3-8b", 1), ("llama3-70b", 8)])
def test_full_fine_tuning_of_released_llama3_shapes_plans_like_pretraining(preset, nodes, tmp_path):
    """Fine-tuning from released weights is pretraining's arithmetic (#29): the planner ranks the
    same layouts, from a preset or from the model folder's config.json alone (no weights read)."""
    import dataclasses

    from workbench.shapes import resolve_shape
    from workbench.spec import ModelSpec

    base = {"train": {"global_batch": 64, "micro_batch": 1}, "precision": {"dtype": "bf16"},
            "resources": {"gpu": "h100-80gb", "gpus_per_node": 8, "nodes": nodes}}
    r = plan({**base, "model": {"preset": preset, "seq_len": 8192}})
    fitting = [c for c in r.candidates if c.fits]
    assert len(fitting) > 10 and 0.25 < fitting[0].mfu < 0.6
    sh = resolve_shape(ModelSpec(preset=preset))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": sh.hidden,
        "intermediate_size": sh.ffn_hidden, "num_hidden_layers": sh.layers, "num_attention_heads": sh.heads,
        "num_key_value_heads": sh.kv_heads, "vocab_size": sh.vocab, "max_position_embeddings": 8192,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
        "torch_dtype": "bfloat16"}))
    folder = plan({**base, "model": {"init": "hf", "path": str(tmp_path), "seq_len": 8192}})
    assert dataclasses.asdict(resolve_shape(ModelSpec(init="hf", path=str(tmp_path)))) == \
        dataclasses.asdict(dataclasses.replace(sh, seq_len=8192))
    assert [c.step_time_s for c in folder.candidates[:5]] == [c.step_time_s for c in r.candidates[:5]]


def test_every_candidate_passes_validate_where_the_schedule_rules_bite():
    """gpt-mini on 8 H100 at global batch 18: interleaved 1F1B at 9 micro-batches over 2 stages (rounds of
    4 do not divide 9) is refused by validate, so the planner must not rank it (#28). Every candidate,
    rebuilt as a spec, passes `workbench validate` (load_spec + check_runnable)."""
    from workbench.validate import check_runnable

    raw = {"model": {"preset": "gpt-mini"}, "train": {"global_batch": 18},
           "precision": {"dtype": "bf16"}, "resources": {"gpu": "h100-80gb", "gpus_per_node": 8}}
    result = plan(raw)
    assert len(result.candidates) > 20
    assert any(c.layout["pp_schedule"] == "interleaved-1f1b" for c in result.candidates)
    for c in result.candidates:
        spec = {**raw, "layout": c.layout, "train": {"global_batch": 18, "micro_batch": c.micro_batch}}
        check_runnable(load_spec(spec))  # raises ConfigError for a layout validate refuses
