"""The local part of a tensor that may be a DTensor (a TP or FSDP shard) or a plain tensor."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `t` as a plain tensor (`t` itself when it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t
