"""The pipeline step (pp > 1): run this rank's stages through the torch.distributed.pipelining
schedule, return the step's loss on every rank, and measure what the pipeline does.

Measured per step: when each micro-batch's forward (F), backward (B, input gradients when the
schedule splits it) and weight-gradient (W) pass ran on this rank (a "timeline" event), and the
activations saved for backward that are in flight at once (the memory meter's `activations`).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from workbench.data import token_loss_sum
from workbench.parallel.local import local
from workbench.parallel.pp import build_schedule
from workbench.parallel.precision import autocast
from workbench.runtime.meter import MemoryMeter


def _local_value(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class PipelineEngine:
    """Runs one optimizer step's micro-batches through the pipeline schedule.

    Args:
        parallelized: the Parallelized model (its `modules` are this rank's stages, materialized).
        mesh: the ("pp", "dp", "tp") mesh.
        schedule: layout.pp_schedule.
        num_microbatches: micro-batches per dp rank per step.
        device: this rank's device.
        dtype: precision.dtype: the forward runs under its autocast.
        scale_loss: the loss scaler's `scale_loss` (fp16), applied to each micro-batch's loss
            before the schedule's backward.
    """

    def __init__(self, parallelized, mesh, *, schedule: str, num_microbatches: int, device: torch.device,
                 dtype: str = "fp32", scale_loss: Callable[[torch.Tensor], torch.Tensor] = lambda t: t):
        self.loss_context = parallelized.loss_context
        self.pp_group = mesh.get_group("pp")
        pp = mesh["pp"].size()
        # The last stage's global index is num_stages - 1; with looped placement it lives on
        # pipeline rank (num_stages - 1) % pp.
        self.last_pp_rank = (parallelized.num_stages - 1) % pp
        self.has_last = any(i == parallelized.num_stages - 1 for i in parallelized.stage_indices)
        self.device, self.dtype, self._scale_loss = device, dtype, scale_loss
        self._losses: list[torch.Tensor] = []
        self._scale = 1.0
        self.num_microbatches = num_microbatches
        self.schedule, self.stages = build_schedule(
            parallelized.modules, parallelized.stage_indices, parallelized.num_stages, mesh["pp"], schedule=schedule,
            num_microbatches=num_microbatches, loss_fn=self._loss, device=device)
        self._param_ptrs = {_param_ptr(p) for m in parallelized.modules for p in m.parameters()}
        self._meter: MemoryMeter | None = None
        self._saved: dict[tuple[int, int], dict[int, int]] = {}  # (stage, mb) -> {storage: bytes}
        self._current: tuple[int, int] | None = None
        self._items: list[dict] | None = None
        self._t0 = 0.0
        # The F/B/W wrappers that measure (timeline, activations in flight), per stage: installed
        # only for a step that measures, so every other step runs the schedule's own methods.
        self._measuring = False
        self._wrappers = [self._instrument(stage) for stage in self.stages]

    def step(self, tokens: torch.Tensor, y: torch.Tensor, meter: MemoryMeter, *, scale: float = 1.0,
             record: bool = False) -> tuple[torch.Tensor, list[dict] | None]:
        """Forward and backward of one step's micro-batches; gradients land in the stages.

        Args:
            tokens: this dp rank's (B, T + 1) tokens, num_microbatches micro-batches of rows.
            y: their (B, T) targets, IGNORE where a token does not train.
            meter: receives the activations in flight.
            scale: each micro-batch's summed loss is multiplied by it before backward (dp / the
                global batch's count of target tokens).
            record: also return the F/B/W timeline of this step.
        Returns:
            (loss summed over this rank's target tokens on the ranks that hold the last stage, zero
            on the others (the loop's one all-reduce sums it, `loop._agree`), timeline items or None).
        """
        self._meter, self._items, self._t0 = meter, ([] if record else None), time.perf_counter()
        self._losses, self._scale = [], scale
        self._measure(record or meter.active)
        with self.loss_context(), autocast(self.device.type, self.dtype):
            # Every rank passes inputs and targets: the schedule feeds them to whichever of this
            # rank's stages is first / last (a rank may hold both in looped placement).
            self.schedule.step(tokens[:, :-1], target=y, return_outputs=False)
        loss = self._summed(broadcast=False)
        meter.in_flight = 0
        self._saved.clear()
        items, self._items = self._items, None
        return loss, items

    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss summed over the target tokens `y` of `tokens` through the schedule's forward
        only (no gradients), the same on every pipeline rank."""
        self._losses, self._items, self._scale = [], None, 1.0
        self._measure(False)
        with self.loss_context(), autocast(self.device.type, self.dtype):
            self.schedule.eval(tokens[:, :-1], target=y)
        return self._summed(broadcast=True)

    def _summed(self, broadcast: bool) -> torch.Tensor:
        # The last stage's loss of each micro-batch, in order: the schedule's shape inference (the
        # first step) calls the loss once before them, on made-up inputs; that call is left out.
        # `broadcast`: from the last stage's rank to the pipeline's others.
        if self.has_last:
            loss = torch.stack([_local_value(t) for t in self._losses[-self.num_microbatches:]]).sum()
        else:
            loss = torch.zeros((), device=self.device)
        if broadcast:
            dist.broadcast(loss, group=self.pp_group, group_src=self.last_pp_rank)
        return loss

    # -- measurement -----------------------------------------------------------------------

    def _loss(self, logits, targets):
        if self._measuring:
            # Called right after the last stage's forward of a micro-batch: its saved tensors
            # belong to that micro-batch.
            with self._saving(self._current):
                loss = token_loss_sum(logits, targets)  # the same loss as the pp=1 loop's
        else:
            loss = token_loss_sum(logits, targets)
        self._losses.append(loss.detach())
        # Scaled before backward, as in gradient accumulation: low-precision gradients
        # accumulate the global mean, not a sum over tokens.
        return self._scale_loss(loss * self._scale)

    def _measure(self, on: bool) -> None:
        """Install the measuring F/B/W wrappers on every stage (`on`), or take them off: the
        stage's own methods then run, with no Python layer per micro-batch."""
        if on == self._measuring:
            return
        self._measuring = on
        for stage, wrappers in zip(self.stages, self._wrappers):
            for name, fn in wrappers.items():
                if on:
                    setattr(stage, name, fn)
                else:
                    delattr(stage, name)  # the instance attribute: the class's method shows again

    def _instrument(self, stage) -> dict[str, Callable]:
        """The measuring wrappers of `stage`'s forward, backward and weight-gradient passes, by name."""
        fwd, bwd, wgt = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk
        s = stage.stage_index

        def forward_one_chunk(mb, *args, **kwargs):
            self._current = (s, mb)
            with self._timed(mb, "F", s), self._saving((s, mb)):
                return fwd(mb, *args, **kwargs)

        def backward_one_chunk(mb, *args, **kwargs):
            full = kwargs.get("full_backward", True)
            with self._timed(mb, "B", s):
                out = bwd(mb, *args, **kwargs)
            if full:
                self._release((s, mb))
            return out

        def backward_weight_one_chunk(mb, *args, **kwargs):
            with self._timed(mb, "W", s):
                out = wgt(mb, *args, **kwargs)
            self._release((s, mb))
            return out

        return {"forward_one_chunk": forward_one_chunk, "backward_one_chunk": backward_one_chunk,
                "backward_weight_one_chunk": backward_weight_one_chunk}

    @contextlib.contextmanager
    def _timed(self, mb: int, kind: str, stage: int):
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._items is not None:
                self._items.append({"microbatch": mb, "kind": kind, "stage": stage,
                                    "start_s": start - self._t0, "end_s": time.perf_counter() - self._t0})

    @contextlib.contextmanager
    def _saving(self, key):
        """Count the storages saved for backward under `key` (a stage's micro-batch)."""
        meter = self._meter
        if meter is None or not meter.active or key is None:
            yield
            return
        saved = self._saved.setdefault(key, {})

        with torch.autograd.graph.saved_tensors_hooks(lambda t: meter.count_saved(t, saved, self._param_ptrs),
                                                      lambda t: t):
            yield

    def _release(self, key) -> None:
        saved = self._saved.pop(key, None)
        if saved and self._meter is not None:
            self._meter.in_flight -= sum(saved.values())


def _param_ptr(t: torch.Tensor) -> int:
    return local(t).untyped_storage().data_ptr()
