"""Activation checkpointing: recompute in backward instead of keeping activations.

Modes named as the field names them: `full` recomputes whole blocks (every k-th with
`layout.checkpoint_every`), `selective` recomputes the attention core only (Korthikanti et al.
2022, arXiv:2205.05198: QK^T, softmax and the weighted sum over V, the cheapest FLOPs per byte).
"""
from __future__ import annotations

import functools

import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def apply_activation_checkpointing(model: nn.Module, mode: str, *, every: int = 1) -> nn.Module:
    """Recompute parts of `model.blocks` (a ModuleDict) in backward, in place.

    Args:
        model: a model whose forward loops over `model.blocks` (works on meta, before FSDP, and on
            tensor-parallel blocks).
        mode: "none", "full" (blocks 0, k, 2k, ... of this stage in torch's non-reentrant
            checkpoint_wrapper, k=`every`) or "selective" (every block's attention core).
        every: k for full.
    Returns:
        The same model.
    Raises:
        ConfigError: a model without `blocks`, or (selective) blocks without an `attn` module.
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
    if mode == "selective":
        for block in blocks.values():
            _recompute_attention_core(block)
        return model
    # Position within this model's blocks (a pipeline stage holds a subset): k-th of what it runs.
    for position, name in enumerate(list(blocks.keys())):
        if position % every == 0:
            blocks[name] = checkpoint_wrapper(blocks[name])
    return model


class _CheckpointAttentionCore(TorchFunctionMode):
    """Inside a block's attention, run `F.scaled_dot_product_attention` under a non-reentrant
    checkpoint: its inputs (q, k, v) are kept, its own saved tensors are recomputed in backward."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(func, *args, use_reentrant=False, **kwargs)
        return func(*args, **kwargs)


def _recompute_attention_core(block: nn.Module) -> None:
    attn = getattr(block, "attn", None)
    if attn is None:
        from workbench.errors import ConfigError

        raise ConfigError(
            f"layout.activation_checkpointing=selective recomputes each block's attention core, but "
            f"{type(block).__name__} has no `attn` module. Use activation_checkpointing: full (whole blocks).")
    forward = attn.forward

    # The instance's forward, not a wrapper module: parameter names stay as they are.
    @functools.wraps(forward)
    def forward_recomputing_core(*args, **kwargs):
        with _CheckpointAttentionCore():
            return forward(*args, **kwargs)

    attn.forward = forward_recomputing_core
