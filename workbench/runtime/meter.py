"""Measured memory per rank, with the same meanings as the predicted breakdown.

params/grads/master/optimizer are exact byte counts of the tensors this rank keeps (local
shards of DTensors). Activations are the bytes saved for backward, counted through
saved-tensor hooks (unique storages, parameters excluded) and kept as the peak over the
micro-batches in flight, on the run's first step (the same on every step). On CUDA, `peak` is
torch.cuda.max_memory_allocated; on CPU, where no allocator statistics exist, it is the tracked
total (model states + peak activations).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from workbench.parallel.local import local


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor's local shard; None and meta
    tensors count 0). One storage lookup per tensor: a memory event walks every parameter, gradient
    and optimizer state (~400 tensors for gpt-mini), ~1.3 us each (#35: was ~4)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        t = local(t)
        if t.is_meta:
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def storage_of(t: torch.Tensor) -> tuple[int, int]:
    """(key, bytes) of the storage behind `t`: a DTensor's local shard; a tensor subclass
    without a real storage (e.g. an async collective's result) counts its own elements."""
    shard = local(t)
    shard = getattr(shard, "elem", shard)  # AsyncCollectiveTensor wraps the real tensor
    try:
        storage = shard.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return id(shard), shard.numel() * shard.element_size()


def _is_param(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


class MemoryMeter:
    """Tracks saved activations and reports a rank's memory breakdown."""

    def __init__(self, device: torch.device):
        self.device = device
        self.in_flight = 0  # bytes saved for backward and not yet released
        # The saved-tensor hooks cost two Python calls per saved tensor (~4-7% of a forward and
        # backward on CPU): the loop turns them on for the run's first step only. The bytes saved
        # per step do not change (fixed shapes and layout), so that measurement stands for every
        # memory event of the run.
        self.active = True
        self.peak_activations = 0
        self._param_ptrs: set[int] = set()
        self._storages: dict[int, int] = {}

    def watch_params(self, modules: list[nn.Module]) -> None:
        self._param_ptrs = {local(p).untyped_storage().data_ptr() for m in modules for p in m.parameters()}

    @contextlib.contextmanager
    def saving(self):
        """Count tensors saved for backward inside this context (one micro-batch's forward)."""
        if not self.active:
            yield
            return
        storages = self._storages

        with torch.autograd.graph.saved_tensors_hooks(lambda t: self.count_saved(t, storages), lambda t: t):
            yield

    def count_saved(self, t: torch.Tensor, storages: dict[int, int], param_ptrs: set[int] | None = None):
        """A saved-tensor pack hook: count `t`'s storage once into `storages` and the in-flight total.

        FSDP2's gathered (unsharded) parameters are Parameters too, in storages made per forward:
        they are transient buffers, not activations. Tensor parallel saves DTensors: count their
        local storage.
        """
        if t.device.type != "meta" and not _is_param(t):
            ptr, nbytes = storage_of(t)
            if ptr not in (self._param_ptrs if param_ptrs is None else param_ptrs) and ptr not in storages:
                storages[ptr] = nbytes
                self.in_flight += nbytes
                self.peak_activations = max(self.peak_activations, self.in_flight)
        return t

    def released(self) -> None:
        """Backward of every micro-batch in flight finished: their saved tensors are free."""
        self.in_flight = 0
        self._storages.clear()

    def reset_peak(self) -> None:
        """A new step begins: forget the device's peak; the activation peak too if this step measures it."""
        if self.active:
            self.peak_activations = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def measure(self, modules: list[nn.Module], optimizer, master: list[torch.Tensor] | None = None,
                offloaded: dict | None = None, params_are_master: bool = False) -> dict:
        """The rank's breakdown in bytes.

        Args:
            optimizer: a torch.optim optimizer, or the list of its state tensors.
            master: fp32 master tensors held apart from the parameters.
            offloaded: extra keys (e.g. bytes on disk) merged into the result.
            params_are_master: the parameters are the fp32 master (FSDP2 mixed precision): count
                them as master, params 0.
        """
        params = [p for m in modules for p in m.parameters()]
        grads = [p.grad for p in params]
        if isinstance(optimizer, list):
            states = optimizer
        else:
            states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        out = {
            "params": 0 if params_are_master else tensor_bytes(params),
            "grads": tensor_bytes(grads),
            "master": tensor_bytes((master or []) + (params if params_are_master else [])),
            "optimizer": tensor_bytes(states),
            "activations": self.peak_activations,
        }
        if offloaded:  # resident figures of file-backed states replace their tensors' full sizes
            out.update(offloaded)
        if self.device.type == "cuda":
            out["peak"] = int(torch.cuda.max_memory_allocated(self.device))
        else:
            out["peak"] = sum(out[k] for k in ("params", "grads", "master", "optimizer", "activations"))
        return out

