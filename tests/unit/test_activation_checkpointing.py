"""Activation checkpointing wraps the chosen blocks, keeps the numbers, and saves activations."""
import pytest
import torch.nn as nn

from tests.helpers.events import losses, measured
from workbench.errors import ConfigError
from workbench.parallel.activation_checkpointing import apply_activation_checkpointing
from workbench.runtime.loop import train


def _blocks(model):
    return [type(b).__name__ for b in model.blocks.values()]


def test_full_wraps_every_kth_block_and_selective_none():
    def model():
        m = nn.Module()
        m.blocks = nn.ModuleDict({str(i): nn.Linear(2, 2) for i in range(5)})
        return m

    assert _blocks(apply_activation_checkpointing(model(), "full")) == ["CheckpointWrapper"] * 5
    assert _blocks(apply_activation_checkpointing(model(), "full", every=2)) == \
        ["CheckpointWrapper", "Linear", "CheckpointWrapper", "Linear", "CheckpointWrapper"]
    assert _blocks(apply_activation_checkpointing(model(), "none")) == ["Linear"] * 5
    with pytest.raises(ConfigError, match="needs a model whose forward loops over a `blocks`"):
        apply_activation_checkpointing(nn.Linear(2, 2), "full")
    with pytest.raises(ConfigError, match="has no `attn` module"):
        apply_activation_checkpointing(model(), "selective")


def test_checkpointing_keeps_losses_and_cuts_activations():
    base = {"model": {"preset": "gpt-tiny", "layers": 3, "seq_len": 32}, "train": {"steps": 2, "global_batch": 4, "micro_batch": 2}}
    out = {}
    modes = {"none": {}, "selective": {}, "full-every-2": {"checkpoint_every": 2}, "full": {}}
    for name, extra in modes.items():
        events = []
        mode = name.split("-")[0]
        train({**base, "layout": {"activation_checkpointing": mode, **extra}}, events.append)
        out[name] = (losses(events), measured(events)["activations"])
    curves = {name: o[0] for name, o in out.items()}
    assert len({tuple(v) for v in curves.values()}) == 1, curves  # recompute is exact
    assert out["full"][1] < out["full-every-2"][1] < out["selective"][1] < out["none"][1]


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_selective_recomputes_the_attention_core_only(family):
    """Autograd keeps everything but the fused attention's own saved tensor (its log-sum-exp),
    as the memory model says, and the gradients are the same bit for bit."""
    import torch

    from workbench.memory import activations as act
    from workbench.models import GPT, resolve_shape
    from workbench.parallel.materialize import materialize
    from workbench.spec import ModelSpec

    shape = resolve_shape(ModelSpec(family=family, layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, seq_len=32,
                                    tie_embeddings=False))
    grads, saved = {}, {}
    for mode in ("none", "selective"):
        with torch.device("meta"):
            model = GPT(shape)
        materialize(model, torch.device("cpu"), seed=0)
        apply_activation_checkpointing(model, mode)
        skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in skip:  # noqa: B023 (used within the iteration)
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()  # noqa: B023
            return t

        x = torch.randn(3, shape.seq_len, shape.hidden, generator=torch.Generator().manual_seed(0), requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = model.blocks["0"](x, model.rope_tables(x.device))
        y.square().sum().backward()
        grads[mode], saved[mode] = x.grad, sum(seen.values())
    assert torch.equal(grads["none"], grads["selective"])
    assert saved["none"] - saved["selective"] == act.attention_core_bytes_per_token(shape) * 3 * shape.seq_len


def test_selective_with_checkpoint_every_is_a_migration_error():
    from workbench.spec import load_spec

    with pytest.raises(ConfigError, match="use activation_checkpointing: full, checkpoint_every: 2"):
        load_spec({"layout": {"activation_checkpointing": "selective", "checkpoint_every": 2}})
    load_spec({"layout": {"activation_checkpointing": "full", "checkpoint_every": 2}})
