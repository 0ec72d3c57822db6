"""Activation checkpointing wraps the chosen blocks, keeps the numbers, and saves activations."""
import pytest
import torch.nn as nn

from workbench.errors import ConfigError
from workbench.parallel.checkpointing import apply_activation_checkpointing
from workbench.runtime.loop import train


def _blocks(model):
    return [type(b).__name__ for b in model.blocks.values()]


def test_full_and_selective_wrap_the_right_blocks():
    def model():
        m = nn.Module()
        m.blocks = nn.ModuleDict({str(i): nn.Linear(2, 2) for i in range(5)})
        return m

    assert _blocks(apply_activation_checkpointing(model(), "full")) == ["CheckpointWrapper"] * 5
    assert _blocks(apply_activation_checkpointing(model(), "selective", every=2)) == \
        ["CheckpointWrapper", "Linear", "CheckpointWrapper", "Linear", "CheckpointWrapper"]
    assert _blocks(apply_activation_checkpointing(model(), "none")) == ["Linear"] * 5
    with pytest.raises(ConfigError, match="needs a model whose forward loops over a `blocks`"):
        apply_activation_checkpointing(nn.Linear(2, 2), "full")


def test_checkpointing_keeps_losses_and_cuts_activations():
    base = {"model": {"preset": "gpt-tiny", "layers": 3, "seq_len": 32}, "train": {"steps": 2, "global_batch": 4, "micro_batch": 2}}
    out = {}
    for mode in ("none", "selective", "full"):
        events = []
        train({**base, "layout": {"activation_checkpointing": mode}}, events.append)
        out[mode] = ([e["loss"] for e in events if e["event"] == "step"],
                     [e["measured"]["activations"] for e in events if e["event"] == "memory"][-1])
    assert out["full"][0] == out["selective"][0] == out["none"][0]  # recompute is exact
    assert out["full"][1] < out["selective"][1] < out["none"][1]
