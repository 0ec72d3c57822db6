"""The spec: defaults, validation messages, overrides, round trips, and no escaping exceptions."""
import json

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench import ConfigError, JobSpec, load_spec
from workbench.spec import apply_overrides


def test_minimal_spec_gets_defaults_and_matching_resources():
    spec = load_spec({"model": {"preset": "gpt-tiny"}, "layout": {"dp": 4}})
    assert spec.resources.num_gpus == 4
    assert spec.world_size == 4
    assert spec.train.optimizer == "adamw"


def test_quickstart_example_is_valid():
    spec = load_spec("examples/quickstart.yaml")
    assert (spec.layout.dp, spec.resources.gpus_per_node) == (2, 2)


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_round_trip_is_lossless(fmt, tmp_path):
    spec = load_spec({"name": "rt", "model": {"preset": "gpt-tiny", "layers": 6}, "layout": {"dp": 2},
                      "train": {"lr": 1e-3}, "backend": {"name": "sagemaker", "sagemaker": {"bucket": "b"}}})
    text = spec.to_yaml() if fmt == "yaml" else spec.to_json()
    again = load_spec(yaml.safe_load(text) if fmt == "yaml" else json.loads(text))
    assert again == spec
    path = tmp_path / "spec.yaml"
    spec.save(path)
    assert load_spec(path) == spec


def test_overrides_are_typed_and_validated():
    spec = load_spec({"layout": {"dp": 2}}, ["train.lr=0.01", "name=x", "layout.dp=4", "resources.gpus_per_node=4"])
    assert spec.train.lr == 0.01 and spec.layout.dp == 4 and spec.name == "x"
    assert spec.replace(**{"train.steps": 3}).train.steps == 3
    with pytest.raises(ConfigError, match="expected key.path=value"):
        apply_overrides({}, ["layout.dp"])


def test_typo_in_a_section_name_is_rejected_by_name():
    with pytest.raises(ConfigError) as e:
        load_spec({"layuot": {"dp": 2}})
    assert "layuot: unknown key. Did you mean 'layout'?" in str(e.value)


def test_typo_inside_a_section_is_rejected_by_name():
    with pytest.raises(ConfigError, match=r"layout.zeor: unknown key. Did you mean 'zero'\?"):
        load_spec({"layout": {"zeor": 1}})


def test_world_size_must_match_resources():
    with pytest.raises(ConfigError) as e:
        load_spec({"layout": {"dp": 2, "tp": 2, "pp": 3}, "resources": {"gpus_per_node": 8}})
    msg = str(e.value)
    assert "dp(2) x tp(2) x pp(3) = 12 ranks, but resources give 8 GPUs" in msg
    assert "dp=2, tp=2, pp=2" in msg or "dp=8, tp=1, pp=1" in msg


def test_tp_must_divide_heads():
    with pytest.raises(ConfigError, match=r"layout.tp\(8\) must divide model.heads\(4\)"):
        load_spec({"layout": {"tp": 8}})


def test_pp_at_most_layers():
    with pytest.raises(ConfigError, match="4 layers; each stage needs at least one block"):
        load_spec({"layout": {"pp": 8}})


def test_global_batch_divisible():
    with pytest.raises(ConfigError, match=r"global_batch\(10\) must be divisible by dp\(2\) x micro_batch\(4\) = 8"):
        load_spec({"layout": {"dp": 2}, "train": {"global_batch": 10}})


@pytest.mark.parametrize("raw, fragment", [
    ({"train": {"steps": 0}}, "train.steps: Input should be greater than 0 (got 0)"),
    ({"layout": {"dp": -1}}, "layout.dp: Input should be greater than 0"),
    ({"model": {"preset": "gpt-tnyi"}}, "unknown preset 'gpt-tnyi'. Did you mean 'gpt-tiny'?"),
    ({"resources": {"gpu": "h100"}}, "unknown GPU type 'h100'"),
    ({"backend": {"name": "lambda"}}, "backend.name: Input should be 'local', 'ray', 'sagemaker', 'vertex' or 'azureml'"),
    ({"layout": {"zero": 4}}, "layout.zero: Input should be 0, 1, 2 or 3"),
    ({"model": {"preset": "gpt-tiny", "layers": 2}}, None),  # overrides a preset field: valid
    ({"model": {"family": "gpt", "layers": 2}}, "model: missing hidden, heads, vocab, seq_len"),
    ({"model": {"preset": "gpt-tiny", "hidden": 66}}, "hidden(66) must be divisible by heads(4)"),
    ({"model": {"params": 7e9}, "train": {"steps": 1}}, None),  # planning-only: valid
    ({"backend": {"name": "sagemaker", "spot": True}}, "spot=true without checkpoints"),
    ({"backend": {"name": "vertex", "spot": True, "max_wait_s": 10}, "checkpoint": {"every_steps": 5}},
     "max_wait_s(10) must be >= max_runtime_s(86400)"),
])
def test_invalid_specs_explain_themselves(raw, fragment):
    if fragment is None:
        load_spec(raw)
        return
    with pytest.raises(ConfigError) as e:
        load_spec(raw)
    assert fragment in str(e.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_spec(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("layout: {dp: [")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_spec(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_spec(bad)


def test_repr_and_html():
    spec = load_spec({"name": "demo", "layout": {"dp": 2}})
    assert repr(spec).startswith("JobSpec('demo': model=gpt-tiny, dp=2 tp=1 pp=1 zero=0")
    html = spec._repr_html_()
    assert "<table>" in html and "gpt-tiny" in html


def test_every_field_is_documented():
    def walk(model):
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, JobSpec.__mro__[1]):
                yield from walk(ann)
            elif model is not JobSpec:
                yield f"{model.__name__}.{name}", field.description

    missing = [name for name, doc in walk(JobSpec) if not doc]
    assert not missing, missing


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 70), st.floats(allow_nan=True),
                     st.text(max_size=8), st.sampled_from(["gpt-tiny", "llama-7b", "cpu", "h200", "1f1b", "bf16"]))
_keys = st.sampled_from(["name", "model", "data", "train", "layout", "precision", "resources", "checkpoint",
                         "backend", "preset", "dp", "tp", "pp", "zero", "layers", "hidden", "heads", "vocab",
                         "seq_len", "steps", "global_batch", "micro_batch", "gpu", "gpus_per_node", "nodes",
                         "dtype", "spot", "params", "factory", "pp_schedule", "bogus"])
_trees = st.recursive(_scalars, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                        st.dictionaries(_keys, kids, max_size=5)), max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_keys, _trees, max_size=6))
def test_only_config_errors_escape_validation(raw):
    try:
        load_spec(raw)
    except ConfigError:
        pass
