"""Pipeline split and the rules for tensor/pipeline layouts (single process, no process group)."""
import pytest

from workbench.errors import ConfigError
from workbench.models import build_model_meta
from workbench.parallel.pp import balance_blocks, split_stage
from workbench.parallelism import looped_stages
from workbench.spec import load_spec
from workbench.validate import check_runnable, validate_spec


def spec(layout, train=None, model=None, precision=None):
    world = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1)
    out = {"model": model or {"preset": "gpt-tiny"}, "layout": layout,
           "train": {"steps": 2, "global_batch": 8, "micro_batch": 2, **(train or {})},
           "resources": {"gpu": "cpu", "gpus_per_node": world}}
    if precision:
        out["precision"] = precision
    return load_spec(out)


def test_balance_minimizes_largest_stage():
    # Heavy ends: the embedding stage takes fewer blocks than the middle ones.
    bounds = balance_blocks([10] * 6, first_extra=20, last_extra=0, num_stages=3)
    assert [b.start for b in bounds] == [0, 1, bounds[1].stop] and bounds[-1].stop == 6
    assert len(bounds[0]) == 1  # the embedding stage holds one block, the others split the rest
    costs = [10 * len(b) + (20 if i == 0 else 0) for i, b in enumerate(bounds)]
    assert max(costs) == 30
    assert balance_blocks([1] * 4, 0, 0, 4) == [range(i, i + 1) for i in range(4)]
    bounds = balance_blocks([5, 1, 1, 1, 1, 5], 3, 3, 2)
    assert [list(b) for b in bounds] == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError):
        balance_blocks([1, 1], 0, 0, 3)


def test_looped_stage_placement():
    assert looped_stages(0, 2, 2) == [0, 2]
    assert looped_stages(1, 4, 2) == [1, 5]
    assert looped_stages(3, 4, 1) == [3]


def test_split_keeps_names_and_ends():
    model = build_model_meta(spec({}))
    first = split_stage(model, range(0, 2), first=True, last=False)
    last = split_stage(model, range(2, 4), first=False, last=True)
    names = {n for n, _ in model.named_parameters()}
    first_names = {n for n, _ in first.named_parameters()}
    last_names = {n for n, _ in last.named_parameters()}
    assert first_names | last_names == names and not first_names & last_names
    assert first.head is None and first.norm is None and last.tok_emb is None and last.pos_emb is None
    assert list(last.blocks.keys()) == ["2", "3"]
    assert len(model.blocks) == 4  # the full model is untouched


@pytest.mark.parametrize("layout, train, precision, words", [
    ({"dp": 2, "sequence_parallel": True}, None, None, "tp=1"),
    ({"tp": 2, "zero": 2}, None, None, "dp=1"),
    ({"dp": 2, "pp": 2, "zero": 3, "pp_schedule": "zero-bubble"}, {"global_batch": 8}, None, "zero=2"),
])
def test_unsupported_combinations_are_refused(layout, train, precision, words):
    with pytest.raises(ConfigError, match=words):
        s = spec(layout, train, precision=precision)
        validate_spec(s)
        check_runnable(s)


def test_interleaved_needs_whole_rounds():
    # 5 micro-batches on pp=2 run in rounds of max(1, 5 // 2) = 2: one left over.
    with pytest.raises(ConfigError, match="divisible by max"):
        validate_spec(spec({"pp": 2, "pp_schedule": "interleaved-1f1b"}, {"global_batch": 10}))
    validate_spec(spec({"pp": 2, "pp_schedule": "interleaved-1f1b"}, {"global_batch": 12}))


@pytest.mark.parametrize("path", ["examples/tp2.yaml", "examples/pp2-1f1b.yaml", "examples/3d-8rank.yaml"])
def test_model_parallel_examples_are_runnable(path):
    s = load_spec(path)
    check_runnable(s)
    assert s.layout.tp * s.layout.pp > 1


def test_tied_last_stage_copies_the_embedding():
    import torch

    from workbench.parallel.materialize import materialize, param_name

    model = build_model_meta(spec({}, model={"preset": "gpt-tiny", "tie_embeddings": True}))
    last = split_stage(model, range(2, 4), first=False, last=True)
    assert param_name(last, "head.weight") == "tok_emb.weight"
    materialize(last, torch.device("cpu"), seed=0)
    full = materialize(build_model_meta(spec({}, model={"preset": "gpt-tiny", "tie_embeddings": True})),
                       torch.device("cpu"), seed=0)
    torch.testing.assert_close(last.head.weight, full.tok_emb.weight, rtol=0, atol=0)
    untied = split_stage(build_model_meta(spec({})), range(2, 4), first=False, last=True)
    assert param_name(untied, "head.weight") == "head.weight"


def test_a_tied_checkpoint_names_one_weight_at_every_pp():
    """The names a rank's checkpoint state is saved under (parallel/tied.saved_names): the last
    stage's copy and a whole tied model's head both as tok_emb.weight; an untied model as is."""
    from workbench.parallel.tied import saved_names
    from workbench.runtime.checkpoint_state import module_keys, saved_keys

    tied = build_model_meta(spec({}, model={"preset": "gpt-tiny", "tie_embeddings": True}))
    first = split_stage(tied, range(0, 2), first=True, last=False)
    last = split_stage(tied, range(2, 4), first=False, last=True)
    assert saved_names([tied]) == saved_names([last]) == {"head.weight": "tok_emb.weight"}
    assert saved_names([first]) == saved_names([build_model_meta(spec({}))]) == {}

    # pp = 1: the tied head's model key folds into the embedding's; the optimizer (flattened) has one.
    state = {"model": {"tok_emb.weight": "W", "head.weight": "W", "norm.weight": "n"},
             "optim": {"state.tok_emb.weight.exp_avg": "m", "param_groups.tok_emb.weight.lr": 0.1}, "scaler": {}}
    saved, back = saved_keys(state, saved_names([tied]))
    assert saved["model"] == {"tok_emb.weight": "W", "norm.weight": "n"} and saved["optim"] == state["optim"]
    assert module_keys(saved["model"], back["model"]) == state["model"] and saved["scaler"] == {}
    # pp > 1, the last stage: its copy's model and optimizer state are saved as the embedding's.
    state = {"model": {"head.weight": "C", "norm.weight": "n"},
             "optim": {"state.head.weight.step": 3, "state.head.weight.exp_avg": "m",
                       "param_groups.head.weight.lr": 0.1, "state.norm.weight.step": 3}}
    saved, back = saved_keys(state, saved_names([last]))
    assert saved["model"] == {"tok_emb.weight": "C", "norm.weight": "n"}
    assert saved["optim"] == {"state.tok_emb.weight.step": 3, "state.tok_emb.weight.exp_avg": "m",
                              "param_groups.tok_emb.weight.lr": 0.1, "state.norm.weight.step": 3}
    assert module_keys(saved["optim"], back["optim"]) == state["optim"]
