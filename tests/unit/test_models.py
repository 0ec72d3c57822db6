"""Models: exact parameter counts against published sizes, meta build, deterministic init."""
import pytest
import torch

import workbench
from workbench import ConfigError, load_spec
from workbench.models import PRESETS, build_model_meta

# Published sizes: GPT-2 (Hugging Face model cards / Radford et al. 2019), Llama 2 (Touvron et al. 2023).
PUBLISHED = {
    "gpt2-124m": 124_439_808,
    "gpt2-350m": 354_823_168,
    "gpt2-774m": 774_030_080,
    "gpt2-1.5b": 1_557_611_200,
    "llama-7b": 6_738_415_616,
    "llama-13b": 13_015_864_320,
    "llama-70b": 68_976_648_192,
}


@pytest.mark.parametrize("preset, expected", PUBLISHED.items())
def test_parameter_counts_match_published_sizes(preset, expected):
    spec = load_spec({"model": {"preset": preset}})
    assert spec.model.shape().num_params() == expected


@pytest.mark.parametrize("preset", ["gpt-tiny", "gpt-mini", "gpt2-124m", "llama-7b"])
def test_meta_model_has_the_analytic_count_without_allocating(preset):
    spec = load_spec({"model": {"preset": preset}})
    model = build_model_meta(spec)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == spec.model.shape().num_params()


def test_build_model_is_deterministic_and_seeded():
    a = workbench.build_model({"model": {"preset": "gpt-tiny"}})
    b = workbench.build_model({"model": {"preset": "gpt-tiny"}})
    c = workbench.build_model({"model": {"preset": "gpt-tiny"}, "train": {"seed": 1}})
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name


def test_gpt_forward_shapes_and_causality():
    model = workbench.build_model({"model": {"preset": "gpt-tiny"}})
    x = torch.randint(0, 256, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, 256)
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 256  # changing the future must not change the past
    torch.testing.assert_close(model(y)[:, :10], logits[:, :10])


def test_llama_family_builds_and_runs():
    spec = {"model": {"family": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 128,
                      "seq_len": 32}}
    model = workbench.build_model(spec)
    assert model(torch.randint(0, 128, (1, 32))).shape == (1, 32, 128)
    assert load_spec(spec).model.shape().num_params() == sum(p.numel() for p in model.parameters())


def test_tied_embeddings_share_one_tensor():
    model = workbench.build_model({"model": {"preset": "gpt-tiny", "tie_embeddings": True}})
    assert model.head.weight is model.tok_emb.weight


def test_factory_models():
    model = workbench.build_model({"model": {"factory": "tests.helpers.models:bigram", "kwargs": {"hidden": 8},
                                             "vocab": 256, "seq_len": 16}})
    assert model(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 256)
    with pytest.raises(ConfigError, match="cannot import it"):
        workbench.build_model({"model": {"factory": "no.such:thing", "vocab": 8, "seq_len": 8}})
    with pytest.raises(ConfigError, match="not a torch.nn.Module"):
        workbench.build_model({"model": {"factory": "tests.helpers.models:not_a_module", "vocab": 8, "seq_len": 8}})
    with pytest.raises(ConfigError, match="also give vocab and seq_len"):
        load_spec({"model": {"factory": "tests.helpers.models:bigram"}})


def test_size_only_models_plan_but_do_not_run():
    with pytest.raises(ConfigError, match="size alone, for planning"):
        workbench.build_model({"model": {"params": 7.5e9}})


def test_every_preset_resolves():
    for name in PRESETS:
        assert load_spec({"model": {"preset": name}}).model.shape().num_params() > 0
