"""Released weights in one process: small random transformers models (GPT-2, Llama with GQA and
Llama 3.1 rope scaling, Qwen2 with q/k/v bias), saved offline, load into our model with the same
logits and loss; export(import(x)) is x bit for bit; a fine-tuning run resumes exactly; init from
our own checkpoints; the model fields and presets; hostile folders are ConfigErrors."""
import json
import shutil

import pytest
import torch

from tests.helpers.events import losses
from tests.helpers.hf_models import SEQ, hf_loss, hf_spec, make_hf_model
from tests.helpers.reference import reference_run
from workbench.errors import ConfigError
from workbench.export import hf_state_dict
from workbench.models import GPT, rope_frequencies
from workbench.parallel.materialize import build_model
from workbench.runtime.loop import train
from workbench.shapes import resolve_shape
from workbench.spec import ModelSpec, load_spec

ARCHS = ["gpt2", "llama", "qwen2"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """arch -> (transformers model, its folder, the same weights saved sharded with an index)."""
    out = {}
    for arch in ARCHS:
        single, sharded = tmp_path_factory.mktemp(arch), tmp_path_factory.mktemp(arch + "-sharded")
        model = make_hf_model(arch, single)
        make_hf_model(arch, sharded, sharded=True)
        assert (sharded / "model.safetensors.index.json").exists() and not (single / "model.safetensors.index.json").exists()
        out[arch] = (model, single, sharded)
    return out


def batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (3, SEQ), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_step0_logits_and_loss_equal_transformers(folders, arch, layout):
    hf, single, sharded = folders[arch]
    spec = hf_spec(single if layout == "single" else sharded)
    ours = build_model(spec).eval()
    x = batch(ours.shape.vocab)
    with torch.no_grad():
        a, b = ours(x), hf(x).logits
    # fp32; weights of std 0.2 give logits of ~10: a few ulps of reordering in attention and the MLP
    assert (a - b).abs().max().item() <= 2e-6 * b.abs().max().item() + 1e-6
    events = []
    train({**spec, "train": {**spec["train"], "steps": 1}}, events.append)
    (step,) = [e for e in events if e["event"] == "step"]
    assert step["loss"] == pytest.approx(hf_loss(hf, spec), rel=1e-6)


def test_shape_comes_from_config_json_alone(folders, tmp_path):
    _, single, _ = folders["llama"]
    weightless = tmp_path / "config-only"
    weightless.mkdir()
    shutil.copy(single / "config.json", weightless / "config.json")
    shape = load_spec(hf_spec(weightless)).model.shape()  # planning: no weights needed
    assert (shape.family, shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.ffn_hidden, shape.vocab,
            shape.rope_theta, shape.tie_embeddings, shape.qkv_bias) == ("llama", 4, 64, 4, 2, 96, 128, 500000.0,
                                                                         False, False)
    assert shape.rope_scaling.factor == 8.0 and shape.rope_scaling.original_max_position_embeddings == 16
    hf, _, _ = folders["llama"]
    assert torch.equal(rope_frequencies(shape), hf.model.rotary_emb.inv_freq)  # bit for bit, scaling included
    qwen = load_spec(hf_spec(folders["qwen2"][1])).model.shape()
    assert (qwen.qkv_bias, qwen.out_bias, qwen.mlp_bias, qwen.tie_embeddings, qwen.norm_eps) == (True, False, False,
                                                                                                 True, 1e-6)
    with pytest.raises(ConfigError, match="model.safetensors"):
        build_model(hf_spec(weightless))  # running it needs the weights: named


@pytest.mark.parametrize("arch", ARCHS)
def test_export_of_import_is_bit_for_bit(folders, arch):
    hf, single, _ = folders[arch]
    state, config = hf_state_dict(build_model(hf_spec(single)))
    ref = hf.state_dict()
    assert set(state) <= set(ref) and set(ref) - set(state) <= {"lm_head.weight"}  # a tied head is the embedding
    for name, value in state.items():
        assert torch.equal(value, ref[name]), name
    assert config.architectures == hf.config.architectures


def test_vocab_padding_changes_no_logit_and_exports_away(folders):
    hf, single, _ = folders["llama"]
    padded = build_model(hf_spec(single, pad_vocab_to=96)).eval()
    assert padded.shape.padded_vocab == 192 and padded.tok_emb.weight.shape[0] == 192
    assert torch.count_nonzero(padded.tok_emb.weight[128:]) == 0
    x = batch(128)
    with torch.no_grad():
        logits, ref = padded(x), hf(x).logits
    assert (logits[..., :128] - ref).abs().max() <= 2e-6 * ref.abs().max() + 1e-6
    assert torch.all(logits[..., 128:] == torch.finfo(torch.float32).min)  # exp() of these is 0 in the softmax
    y = torch.roll(x, -1, 1)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    assert loss.item() == pytest.approx(torch.nn.functional.cross_entropy(ref.flatten(0, 1), y.flatten()).item(),
                                        rel=1e-6)
    state, config = hf_state_dict(padded)
    assert config.vocab_size == 128 and torch.equal(state["lm_head.weight"], hf.state_dict()["lm_head.weight"])


def test_bf16_run_starts_from_the_checkpoints_fp32_values(folders):
    hf, single, _ = folders["qwen2"]
    spec = hf_spec(single)
    events = []
    train({**spec, "precision": {"dtype": "bf16"}, "train": {**spec["train"], "steps": 1}}, events.append)
    (step,) = [e for e in events if e["event"] == "step"]
    assert step["loss"] == pytest.approx(hf_loss(hf, spec), rel=2e-2)  # bf16 compute of the same function


@pytest.mark.slow
def test_fine_tuning_resumes_on_the_exact_curve(folders, tmp_path):
    _, single, _ = folders["llama"]
    spec = {**hf_spec(single), "train": {"steps": 4, "global_batch": 8, "micro_batch": 4, "lr": 1e-3}}
    reference = reference_run(spec).losses()
    calls = iter(range(1, 100))
    first, resumed = [], []
    ckpt = {**spec, "checkpoint": {"uri": str(tmp_path / "ck"), "every_steps": 10}}
    assert train(ckpt, first.append, should_stop=lambda: next(calls) >= 2)["status"] == "preempted"
    train(ckpt, resumed.append, resume=True)
    assert losses(first) + losses(resumed) == reference  # bit for bit


@pytest.mark.slow
def test_init_checkpoint_from_our_checkpoint_and_state_dict_files(folders, tmp_path):
    from safetensors.torch import save_file

    _, single, _ = folders["llama"]
    uri = tmp_path / "pretrain"
    spec = {**hf_spec(single), "checkpoint": {"uri": str(uri), "every_steps": 2}}
    train(spec, lambda e: None)
    from workbench.export import load_checkpoint_model

    trained, _ = load_checkpoint_model(str(uri))
    want = trained.state_dict()
    # our checkpoint or plain state_dict files of our model: the spec gives the shape (a shape from a
    # checkpoint would make resolving a spec read a spec: planning stays a function of the spec)
    fields = load_spec(hf_spec(single)).model.shape()
    explicit = dict(family="llama", layers=fields.layers, hidden=fields.hidden, heads=fields.heads,
                    kv_heads=fields.kv_heads, ffn_hidden=fields.ffn_hidden, vocab=fields.vocab, seq_len=SEQ,
                    rope_theta=fields.rope_theta, norm_eps=fields.norm_eps, max_positions=fields.max_positions,
                    rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 16})
    save_file({k: v.contiguous() for k, v in want.items()}, str(tmp_path / "w.safetensors"))
    torch.save(want, tmp_path / "w.pt")
    for path in (str(uri), str(tmp_path / "w.safetensors"), str(tmp_path / "w.pt")):
        model = build_model({"model": {"init": "checkpoint", "path": path, **explicit}})
        got = model.state_dict()
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k


def test_presets_of_released_families_have_their_published_sizes():
    published = {"llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824, "llama3.1-8b": 8_030_261_248,
                 "mistral-7b": 7_241_732_096, "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304,
                 "qwen2.5-7b": 7_615_616_512, "gpt2": 124_439_808}
    for name, count in published.items():
        assert resolve_shape(ModelSpec(preset=name)).num_params() == count, name
    assert resolve_shape(ModelSpec(preset="llama3-8b")).rope_theta == 500000.0
    assert resolve_shape(ModelSpec(preset="llama-7b")).rope_theta == 10000.0  # existing specs unchanged
    assert resolve_shape(ModelSpec(preset="llama3.2-1b")).tie_embeddings


@pytest.mark.parametrize("extra", [{}, {"qkv_bias": True}, {"qkv_bias": True, "out_bias": True, "mlp_bias": True},
                                   {"pad_vocab_to": 96, "tie_embeddings": True}])
def test_new_fields_are_counted_exactly(extra):
    from workbench.memory.params import rank_params

    shape = resolve_shape(ModelSpec(preset="llama-tiny", **extra))
    with torch.device("meta"):
        model = GPT(shape)
    real = sum(p.numel() for p in model.parameters())
    assert shape.num_params() == real == rank_params(shape, 1, 1, 0)
    assert sum(rank_params(shape, 2, 1, 0) for _ in range(2)) >= real  # tp shards (norms replicated)


@pytest.mark.parametrize("fields, match", [
    ({"preset": "mistral-7b", "seq_len": 8192}, "sliding_window"),
    ({"preset": "gpt-tiny", "rope_theta": 500000.0}, "rope_theta"),
    ({"preset": "gpt-tiny", "qkv_bias": False}, "qkv_bias"),
    ({"preset": "gpt-tiny", "seq_len": 128, "max_positions": 64}, "max_positions"),
    ({"init": "hf"}, "model.path"),
    ({"preset": "gpt-tiny", "path": "/tmp/x"}, "model.init"),
])
def test_fields_a_family_cannot_honour_are_refused(fields, match):
    with pytest.raises(ConfigError, match=match):
        load_spec({"model": fields}).model.shape()


# -- hostile folders ---------------------------------------------------------------------------


def _folder(tmp_path, folders, arch="llama", **config_changes):
    src = folders[arch][1]
    d = tmp_path / "m"
    shutil.copytree(src, d)
    config = json.loads((d / "config.json").read_text())
    for k, v in config_changes.items():
        if v is None:
            config.pop(k, None)
        else:
            config[k] = v
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("changes, match", [
    ({"architectures": ["GemmaForCausalLM"]}, "architectures"),
    ({"architectures": None, "model_type": "falcon"}, "model_type"),
    ({"hidden_size": 2**40}, "hidden_size"),
    ({"num_hidden_layers": -3}, "num_hidden_layers"),
    ({"num_attention_heads": "32"}, "num_attention_heads"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}, "rope_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"head_dim": 32}, "head_dim"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"auto_map": {"AutoModelForCausalLM": "x.Y"}}, "auto_map"),
    # review finding 8: each of these was a TypeError or OverflowError traceback
    ({"architectures": None, "model_type": ["llama"]}, r"model_type=\['llama'\]"),
    ({"rms_norm_eps": 10**400}, "rms_norm_eps=1000.* must be a finite positive number"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 10**400, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
     r"rope_parameters.factor=1000.* must be a finite positive number up to 1e\+06"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": float("inf")}},
     "original_max_position_embeddings=inf must be a whole number of positions from 1 to"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                       "original_max_position_embeddings": 32}, "rope_parameters": None},
     "low_freq_factor=4 must be below high_freq_factor=1"),
])
def test_configs_we_cannot_honour_name_the_field(tmp_path, folders, changes, match):
    d = _folder(tmp_path, folders, **changes)
    with pytest.raises(ConfigError, match=match):
        load_spec(hf_spec(d)).model.shape()


def test_mistral_window_below_seq_len_and_qwen_window_are_refused(tmp_path, folders):
    d = _folder(tmp_path, folders, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=8)
    with pytest.raises(ConfigError, match="sliding_window"):
        load_spec(hf_spec(d)).model.shape()
    assert load_spec(hf_spec(d, seq_len=8)).model.shape().sliding_window == 8  # within the window: exact


def test_missing_or_foreign_weights_are_config_errors(tmp_path, folders):
    from safetensors.torch import load_file, save_file

    d = _folder(tmp_path, folders)
    weights = load_file(str(d / "model.safetensors"))
    del weights["model.layers.3.mlp.down_proj.weight"]
    save_file(weights, str(d / "model.safetensors"))
    with pytest.raises(ConfigError, match="missing weights model.layers.3.mlp.down_proj.weight"):
        build_model(hf_spec(d))
    weights["model.layers.3.mlp.down_proj.weight"] = torch.zeros(64, 95)
    save_file(weights, str(d / "model.safetensors"))
    with pytest.raises(ConfigError, match="shape"):
        build_model(hf_spec(d))
    weights["model.layers.3.mlp.down_proj.weight"] = torch.zeros(64, 96)
    weights["model.layers.3.mlp.extra.weight"] = torch.zeros(2)
    save_file(weights, str(d / "model.safetensors"))
    with pytest.raises(ConfigError, match="no place"):
        build_model(hf_spec(d))


def test_an_index_may_only_name_files_beside_it_and_pickles_are_never_read(tmp_path, folders):
    d = tmp_path / "s"
    shutil.copytree(folders["gpt2"][2], d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../../etc/passwd.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="beside the index"):
        build_model(hf_spec(d))
    b = tmp_path / "bin"
    b.mkdir()
    shutil.copy(d / "config.json", b / "config.json")
    (b / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ConfigError, match="pickles"):
        build_model(hf_spec(b))


def test_init_checkpoint_without_a_shape_says_to_give_it(tmp_path):
    with pytest.raises(ConfigError, match="init=checkpoint .* needs the model's shape"):
        load_spec({"model": {"init": "checkpoint", "path": str(tmp_path)}}).model.shape()


def test_a_config_json_that_is_a_pipe_is_refused_without_opening_it(tmp_path, folders):
    import os

    from tests.helpers.blocking import refusal_within

    d = _folder(tmp_path, folders)
    os.remove(d / "config.json")
    os.mkfifo(d / "config.json")  # open() would wait for a writer forever
    assert "not a regular file" in (refusal_within(lambda: load_spec(hf_spec(d)).model.shape()) or "")


def test_an_index_that_maps_a_tensor_to_the_wrong_shard_names_both(tmp_path, folders):
    d = tmp_path / "s"
    shutil.copytree(folders["llama"][2], d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][name] = files[1]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=f"maps '{name}' to {files[1]}, which does not hold it"):
        build_model(hf_spec(d))
