"""Precision: compute dtypes, autocast, FSDP2's MixedPrecisionPolicy and dynamic loss scaling.

fp32 trains in fp32. bf16/fp16 compute under torch.autocast and keep fp32 master weights: with
zero 0/1 the parameters are stored in the low dtype and master.py holds the fp32 master; with
zero 2/3 FSDP2's sharded fp32 parameter is the master and MixedPrecisionPolicy casts it when
gathering. fp16 also scales the loss (DynamicLossScaler) so small gradients do not flush to zero.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def low_dtype(name: str) -> torch.dtype | None:
    """The compute dtype of a mixed-precision setting, None for fp32."""
    return None if name == "fp32" else DTYPES[name]


def autocast(device_type: str, name: str):
    """The forward's autocast context (a null context for fp32)."""
    dtype = low_dtype(name)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


def mixed_precision_policy(name: str):
    """FSDP2 policy: gather parameters in the low dtype, reduce-scatter gradients in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = low_dtype(name)
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


@torch.no_grad()
def apply_precision(model: nn.Module, name: str) -> nn.Module:
    """Store `model`'s floating-point parameters in the low dtype (zero 0/1; call after the fp32
    master was taken from them). fp32 leaves the model as it is."""
    from torch.distributed.tensor import DTensor

    dtype = low_dtype(name)
    if dtype is None:
        return model
    for p in model.parameters():
        if not p.is_floating_point():
            continue
        if isinstance(p, DTensor):
            # `.data =` would relabel the DTensor but keep an fp32 local shard; swap in a
            # low-precision DTensor instead, keeping the Parameter object (the master and the
            # optimizer refer to it), as nn.Module.to does for tensor subclasses.
            low = DTensor.from_local(p.to_local().to(dtype), p.device_mesh, p.placements, run_check=False,
                                     shape=p.shape, stride=p.stride())
            torch.utils.swap_tensors(p, nn.Parameter(low, requires_grad=p.requires_grad))
        else:
            p.data = p.data.to(dtype)
    return model


class DynamicLossScaler:
    """GradScaler-like dynamic loss scale that works on any gradients (plain, DTensor, low dtype).

    torch.amp.GradScaler refuses fp16 gradients (it expects fp32 parameters under autocast);
    here the parameters themselves may be fp16 and the fp32 master takes the unscaled values.

    Args:
        init_scale: starting scale. enabled: False for fp32/bf16 (scale stays 1, nothing skips).
        growth_factor, backoff_factor, growth_interval: as torch.amp.GradScaler.
    """

    def __init__(self, init_scale: float = 2.0**16, enabled: bool = True, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._clean_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def found_inf(self, grads: list[torch.Tensor | None], device: torch.device) -> bool:
        """True if any gradient on any rank holds inf/NaN (all ranks get the same answer)."""
        if not self.enabled:
            return False
        from workbench.parallel.local import local

        flag = torch.zeros((), device=device)
        for g in grads:
            if g is not None and not torch.isfinite(local(g)).all():
                flag.fill_(1.0)
                break
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def update(self, found_inf: bool) -> None:
        """Halve the scale after an overflow; grow it after growth_interval clean steps."""
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self._clean_steps = 0
            return
        self._clean_steps += 1
        if self._clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self._clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._clean_steps = float(state["scale"]), int(state["clean_steps"])
