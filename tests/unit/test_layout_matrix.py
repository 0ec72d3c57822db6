"""The layout matrix of issue 13 without torch: precision x dp x zero x tp x sequence parallel x pp x
schedule x activation checkpointing x offload x model (gpt tied, gpt untied, GQA llama) on worlds
of 1-8 ranks. Each combination passes the runtime's rules (validate.check_runnable) or is refused
with a ConfigError naming the rule it breaks, never another exception; and `plan` ranks no layout
those rules refuse."""
import itertools
from pathlib import Path

import pytest

from workbench.errors import ConfigError
from workbench.planner import plan
from workbench.spec import load_spec
from workbench.validate import check_runnable

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
MODELS = {
    "gpt-tied": {"preset": "gpt-tiny", "tie_embeddings": True},
    "gpt-untied": {"preset": "gpt-tiny"},
    "llama-gqa": {"family": "llama", "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 256,
                  "seq_len": 64},
}
PIPELINES = [(1, "1f1b")] + [(2, s) for s in ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")]
AXES = dict(dtype=("fp32", "bf16", "fp16"), dp=(1, 2), zero=(0, 1, 2, 3), tp=(1, 2), sp=(False, True),
            pipeline=PIPELINES, ckpt=("none", "selective", "full"), offload=("none", "cpu", "nvme"), model=list(MODELS))


def combinations():
    for values in itertools.product(*AXES.values()):
        yield dict(zip(AXES, values))


def raw_spec(c: dict) -> dict:
    pp, schedule = c["pipeline"]
    # 8 sequences of 2: 4 micro-batches at dp=1, 2 at dp=2, enough for every schedule at pp=2
    # (virtual_stages 2 x pp 2 = 4 stages over 4 layers).
    return {"name": "matrix", "model": MODELS[c["model"]], "precision": {"dtype": c["dtype"]},
            "train": {"steps": 2, "global_batch": 8, "micro_batch": 2},
            "layout": {"dp": c["dp"], "tp": c["tp"], "pp": pp, "zero": c["zero"], "sequence_parallel": c["sp"],
                       "pp_schedule": schedule, "activation_checkpointing": c["ckpt"], "offload": c["offload"]},
            "resources": {"gpus_per_node": c["dp"] * c["tp"] * pp}}


def broken_rules(c: dict) -> dict[str, str]:
    """The rules (docs/strategies.md, docs/parallelism.md) combination `c` breaks: name -> a phrase
    its refusal must contain. Empty: it must run."""
    pp, schedule = c["pipeline"]
    zero, off, world = c["zero"], c["offload"], c["dp"] * c["tp"] * pp
    rules = {
        "cpu offload needs FSDP2 (zero 2/3)": (off == "cpu" and zero < 2, "layout.offload=cpu with zero="),
        "nvme offload at zero 2/3 needs tp=1 and pp=1": (off == "nvme" and zero >= 2 and (c["tp"] > 1 or pp > 1),
                                                         "layout.offload=nvme with zero="),
        "FSDP2 needs a group": ((zero >= 2 or off == "cpu") and world == 1, "on a single rank"),
        "sequence parallel needs tp": (c["sp"] and c["tp"] == 1, "layout.sequence_parallel=true"),
        "ZeRO needs dp under tp/pp": (zero > 0 and c["dp"] == 1 and (c["tp"] > 1 or pp > 1), "with dp=1"),
        "zero 3 drifts under zero-bubble": (zero == 3 and pp > 1 and schedule == "zero-bubble",
                                            "pytorch/pytorch#164756"),
    }
    return {name: phrase for name, (broken, phrase) in rules.items() if broken}


def test_every_combination_runs_or_is_refused_by_the_rule_it_breaks():
    outcomes = {"runs": 0, "refused": 0}
    for c in combinations():
        expected = broken_rules(c)
        try:
            check_runnable(load_spec(raw_spec(c)))
        except ConfigError as e:
            message = str(e)
            assert expected, f"{c} is refused but breaks no known rule: {message}"
            assert any(phrase in message for phrase in expected.values()), (c, expected, message)
            assert "layout." in message and ". " in message, message  # the knob, then a fix
            outcomes["refused"] += 1
            continue
        # Any other exception propagates and fails the test: no combination may crash validation.
        assert not expected, f"{c} passes although it breaks {sorted(expected)}"
        outcomes["runs"] += 1
    assert outcomes == {"runs": 3996, "refused": 8964}  # 3 x 2 x 4 x 2 x 2 x 5 x 3 x 3 x 3 = 12960


def test_sequence_parallel_without_tp_is_refused_under_a_pipeline_too():
    c = dict(dtype="fp32", dp=1, zero=0, tp=1, sp=True, pipeline=(2, "1f1b"), ckpt="none", offload="none",
             model="gpt-tied")
    with pytest.raises(ConfigError, match=r"sequence_parallel=true .* but tp=1\. Set tp >= 2"):
        check_runnable(load_spec(raw_spec(c)))


def test_zero3_zero_bubble_refusal_names_the_torch_issue():
    c = dict(dtype="bf16", dp=2, zero=3, tp=1, sp=False, pipeline=(2, "zero-bubble"), ckpt="none", offload="none",
             model="llama-gqa")
    with pytest.raises(ConfigError, match=r"pytorch/pytorch#164756") as e:
        check_runnable(load_spec(raw_spec(c)))
    assert "Use zero=2" in str(e.value)  # and the fix


def assert_all_runnable(source) -> None:
    """Every candidate of `workbench plan` (not only the top ones it marks) passes the runtime's rules."""
    result = plan(source)
    spec = load_spec(source, layout=False)
    assert result.candidates
    for c in result.candidates:
        raw = spec.to_dict()
        raw["layout"] = {**raw["layout"], **c.layout}
        raw["train"] = {**raw["train"], "micro_batch": c.micro_batch}
        check_runnable(load_spec(raw))  # a ConfigError here names the refused layout that was ranked
        assert c.runnable is not False, c.layout


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_plan_ranks_only_runnable_layouts_for_the_examples(path):
    """llama-70b-plan: 1,406 candidates, 2.5 s."""
    if load_spec(path, layout=False).model.params is not None:  # a size alone is for `memory`, not `plan`
        with pytest.raises(ConfigError, match="plan needs the model's shape"):
            plan(path)
        return
    assert_all_runnable(path)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("model", list(MODELS))
def test_plan_ranks_only_runnable_layouts_for_the_matrix_models(model, dtype):
    assert_all_runnable({"name": "plan", "model": MODELS[model], "precision": {"dtype": dtype},
                         "train": {"global_batch": 16, "micro_batch": 1},
                         "resources": {"gpu": "h100-80gb", "gpus_per_node": 8}})
