"""Activation checkpointing: recompute blocks in backward instead of keeping their activations."""
from __future__ import annotations

import torch.nn as nn


def apply_activation_checkpointing(model: nn.Module, mode: str, *, every: int = 2) -> nn.Module:
    """Wrap blocks of `model.blocks` (a ModuleDict) in torch's non-reentrant checkpoint_wrapper.

    Args:
        model: a model whose forward loops over `model.blocks` (works on meta, before FSDP, and on
            tensor-parallel blocks).
        mode: "none", "full" (every block) or "selective" (blocks 0, k, 2k, ... with k=`every`).
        every: k for selective.
    Returns:
        The same model, its chosen blocks replaced in place by their wrappers.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode == "none":
        return model
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleDict):
        from workbench.errors import ConfigError

        raise ConfigError(
            f"layout.activation_checkpointing={mode} needs a model whose forward loops over a `blocks` "
            f"nn.ModuleDict; {type(model).__name__} has none. Set activation_checkpointing: none, or give "
            "the model a `blocks` ModuleDict.")
    # Position within this model's blocks (a pipeline stage holds a subset): k-th of what it runs.
    for position, name in enumerate(list(blocks.keys())):
        if mode == "full" or position % every == 0:
            blocks[name] = checkpoint_wrapper(blocks[name])
    return model
