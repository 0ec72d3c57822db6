"""Learning-rate schedules: warmup, each decay's end points and shape, and the spec's rules."""
import math

import pytest

from workbench import ConfigError, load_spec
from workbench.schedule import lr_at, lr_curve


def curve(schedule, steps=100, warmup=10, lr=1.0, min_lr=0.1):
    return [lr_at(k, lr=lr, steps=steps, schedule=schedule, warmup_steps=warmup, min_lr=min_lr) for k in range(1, steps + 1)]


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear", "wsd"])
def test_warmup_rises_linearly_to_the_peak(schedule):
    c = curve(schedule)
    assert c[:10] == pytest.approx([k / 10 for k in range(1, 11)])


def test_decays_end_at_min_lr_and_have_their_shape():
    cos, lin, wsd, const = curve("cosine"), curve("linear"), curve("wsd"), curve("constant")
    assert const[10:] == [1.0] * 90
    for c in (cos, lin, wsd):
        assert c[-1] == pytest.approx(0.1)
        assert all(a >= b for a, b in zip(c[10:], c[11:]))  # never rises after warmup
    # Halfway through the decay: cosine and linear both sit at the midpoint.
    mid = 10 + 45
    assert cos[mid - 1] == pytest.approx(0.55) and lin[mid - 1] == pytest.approx(0.55)
    assert cos[20] > lin[20]  # cosine stays high longer early on
    # wsd: stable until the last 20 steps, then linear.
    assert wsd[10:80] == [1.0] * 70 and wsd[89] == pytest.approx(0.55)
    assert math.isclose(lr_at(80, lr=1, steps=100, schedule="wsd", min_lr=0), 1.0)


def test_lr_curve_of_a_spec():
    spec = load_spec({"train": {"steps": 8, "lr": 0.01, "schedule": "linear", "warmup_steps": 2, "min_lr": 0.001}})
    c = lr_curve(spec.train)
    assert len(c) == 8 and c[0] == pytest.approx(0.005) and c[1] == pytest.approx(0.01) and c[-1] == pytest.approx(0.001)


@pytest.mark.parametrize("train, words", [
    ({"steps": 10, "warmup_steps": 10}, "warmup_steps(10) must be below train.steps(10)"),
    ({"lr": 1e-3, "min_lr": 1e-2}, "min_lr(0.01) is above train.lr(0.001)"),
    ({"schedule": "step"}, "train.schedule"),
])
def test_bad_schedules_are_config_errors(train, words):
    with pytest.raises(ConfigError, match=r".*" + words.replace("(", r"\(").replace(")", r"\)")):
        load_spec({"train": train})
