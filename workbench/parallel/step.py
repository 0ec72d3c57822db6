"""The optimizer side of a training step: loss scaling, overflow skip, gradient clipping, update.

Two paths, same numbers as torch.optim:
- direct: a torch.optim optimizer over the model's parameters (fp32 with zero 0; every precision
  with zero 2/3, where FSDP2's sharded fp32 parameters are the master);
- master: master.py's MasterOptimizer steps an fp32 master of a flat range (mixed precision with
  zero 0, every zero=1, every offload=nvme) with torch's functional optimizers, chunk by chunk.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch.optim.adam import adam as adam_kernel
from torch.optim.sgd import sgd as sgd_kernel

from workbench.parallel.local import local
from workbench.parallel.master import MasterOptimizer
from workbench.parallel.precision import DynamicLossScaler

BETAS, EPS, SGD_MOMENTUM = (0.9, 0.999), 1e-8, 0.9


def foreach_groups(params) -> list[dict]:
    """`params` as optimizer param groups that torch's foreach kernels can take whole: plain
    tensors in one group, DTensors in one group per device mesh (a foreach op refuses a list that
    mixes the two, "got mixed torch.Tensor and DTensor", as tensor parallelism's plain norm weights
    beside its sharded matrices would be). Same hyper-parameters in every group.

    DTensor groups step with foreach=True on every device: torch picks it by itself only on GPUs,
    and its per-tensor loop dispatches each op of each tensor through DTensor (gpt-tiny's AdamW
    as one-rank shards: 26-38 ms a step against 3.3 ms foreach; gpt-mini 51-61 against 20-24).
    Plain groups keep torch's choice (`_foreach_for`): on CPU its per-tensor loop is the faster
    for large tensors (gpt-mini: 15 ms against 22-28 ms, foreach's whole-list temporaries).
    """
    from torch.distributed.tensor import DTensor

    groups: dict[object, list] = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return [{"params": g, "foreach": _foreach_for(g)} for g in groups.values()]


def _foreach_for(group_params: list) -> bool | None:
    """foreach for a group of foreach_groups: True for DTensors, None (torch's default) for plain tensors."""
    from torch.distributed.tensor import DTensor

    return True if isinstance(group_params[0], DTensor) else None


def build_optimizer(params, name: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """torch.optim optimizer `name` (adamw | adam | sgd) with workbench's hyper-parameters."""
    groups = foreach_groups(params)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=SGD_MOMENTUM, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=BETAS, eps=EPS, weight_decay=weight_decay)
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=EPS, weight_decay=weight_decay)


def functional_update(name: str, lr: float, weight_decay: float):
    """update(master, grad, moments, step) for one chunk, with torch.optim's own functional kernels."""
    if name == "sgd":
        def update(master, grad, moments, step):
            sgd_kernel([master], [grad], [moments[0]], foreach=False, weight_decay=weight_decay,
                                momentum=SGD_MOMENTUM, lr=lr, dampening=0.0, nesterov=False, maximize=False)
        return update, 1
    adam = functools.partial(adam_kernel, decoupled_weight_decay=(name == "adamw"))

    def update(master, grad, moments, step):
        state_step = torch.tensor(float(step - 1))  # the kernel increments it
        adam([master], [grad], [moments[0]], [moments[1]], [], [state_step], foreach=False, amsgrad=False,
             beta1=BETAS[0], beta2=BETAS[1], lr=lr, weight_decay=weight_decay, eps=EPS, maximize=False)
    return update, 2


def total_norm(grads: list[torch.Tensor | None], comm_device: torch.device, pp_group=None) -> float:
    """Global L2 norm of `grads`: plain tensors count as they are (DDP's are already identical on
    every dp rank); DTensor shards are summed over their mesh, replicas counted once; with
    pipeline parallelism each stage's part is then summed over the pp group.

    The per-rank sums hop to `comm_device` for the collective: with FSDP2's CPUOffloadPolicy the
    shards live in host memory but NCCL only reduces device tensors (pytorch/pytorch#148532).
    """
    from torch.distributed.tensor import DTensor

    plain = torch.zeros((), dtype=torch.float64, device=comm_device)
    by_mesh: dict[int, tuple] = {}
    for g in grads:
        if g is None:
            continue
        if not isinstance(g, DTensor):
            plain += g.detach().double().pow(2).sum().to(comm_device)
            continue
        if any(pl.is_partial() for pl in g.placements):
            raise NotImplementedError("gradient norm of a Partial DTensor gradient")
        replicas = math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_replicate())
        mesh, acc = by_mesh.get(id(g.device_mesh), (g.device_mesh, 0.0))
        by_mesh[id(g.device_mesh)] = (mesh, acc + g.to_local().detach().double().pow(2).sum().to(comm_device) / replicas)
    total = plain
    for mesh, acc in by_mesh.values():
        acc = torch.as_tensor(acc, dtype=torch.float64, device=comm_device).clone()
        for dim in range(mesh.ndim):
            if mesh.size(dim) > 1:
                dist.all_reduce(acc, group=mesh.get_group(dim))
        total = total + acc
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return float(total.sqrt())


class TrainStep:
    """Scale the loss, then step: skip on overflow, unscale, clip, update, update the scale.

    Args:
        params: the parameters this rank trains (plain or DTensor).
        optimizer, lr, weight_decay: train.optimizer and its hyper-parameters.
        grad_clip: clip the global gradient norm to this (0: off).
        scaler: the loss scaler (disabled for fp32/bf16).
        master: a MasterOptimizer (master path) or None (direct path).
        comm_device: device of the collectives (default: the first parameter's).
        pp_group: the pipeline-parallel group (pp > 1): stages hold different parameters.
        copies: parameters that copy another stage's (a tied embedding's copy on the last
            stage): updated like the others, left out of the gradient norm (counted once).
    """

    def __init__(self, params, *, optimizer: str, lr: float, weight_decay: float, grad_clip: float,
                 scaler: DynamicLossScaler, master: MasterOptimizer | None = None,
                 comm_device: torch.device | None = None, pp_group=None, copies=()):
        self.params = list(params)
        self._copies = {id(p) for p in copies}
        self.pp_group = pp_group
        self.grad_clip, self.scaler, self.master = grad_clip, scaler, master
        self._optimizer_name, self._weight_decay, self.lr = optimizer, weight_decay, lr
        # Collectives (overflow flag, norm) run here: the compute device, even when the states are offloaded.
        self.device = comm_device or local(self.params[0]).device
        if master is None:
            self.optimizer = build_optimizer(self.params, optimizer, lr, weight_decay)
        else:
            self._update, num_moments = functional_update(optimizer, lr, weight_decay)
            master.bind(num_moments)
            self.optimizer = None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale_loss(loss)

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next step (a schedule's value). Set on every step: a restored
        optimizer's param groups carry the rate (and foreach choice) of the run they were saved by."""
        self.lr = lr
        if self.master is None:
            for group in self.optimizer.param_groups:
                group["lr"], group["foreach"] = lr, _foreach_for(group["params"])
        else:
            self._update, _ = functional_update(self._optimizer_name, lr, self._weight_decay)

    def step(self) -> dict:
        """One optimizer step on every rank. Returns extra step-event keys (fp16: loss_scale, skipped)."""
        grads = [p.grad for p in self.params]
        used_scale = self.scaler.scale
        skipped = self.scaler.found_inf(grads, self.device)
        if not skipped:
            coef = 1.0 / used_scale
            if self.grad_clip > 0:
                counted = [p.grad for p in self.params if id(p) not in self._copies]
                norm = total_norm(counted, self.device, self.pp_group) * coef
                coef *= min(1.0, self.grad_clip / (norm + 1e-6))
            if self.master is not None:
                self.master.step(self._update, coef)
            else:
                if coef != 1.0:
                    # Local pieces: DTensor (TP-sharded) and plain gradients in one foreach call.
                    torch._foreach_mul_([local(g) for g in grads if g is not None], coef)
                self.optimizer.step()
        self.scaler.update(skipped)
        return {"loss_scale": used_scale, "skipped": skipped} if self.scaler.enabled else {}

    def zero_grad(self) -> None:
        # Keep the tensors (DDP's gradients are views into its buckets); zero them in place, in
        # one call (local shards: DTensor gradients of FSDP2 / TP zero through their local tensor).
        grads = [local(p.grad) for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)

    # -- memory and state -------------------------------------------------------------------
    def stateful(self) -> dict:
        """Objects with state_dict()/load_state_dict() that a checkpoint must hold besides the
        model and `self.optimizer` (None on the master path): the loss scaler, the fp32 master."""
        out = {"scaler": self.scaler} if self.scaler.enabled else {}
        if self.master is not None:
            out["master"] = self.master
        return out

    def measured_states(self) -> dict:
        """The master/optimizer tensors and extra offload keys for MemoryMeter.measure."""
        if self.master is None:
            states = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            return {"master": [], "optimizer": states, "offloaded": {}}
        if hasattr(self.master, "measured"):  # zero 2/3 nvme: everything in files, measured resident
            return {"master": [], "optimizer": [], "offloaded": self.master.measured()}
        held = self.master.store.tensors()
        extra = self.master.store.offloaded() if hasattr(self.master.store, "offloaded") else {}
        return {"master": held["master"], "optimizer": held["optimizer"], "offloaded": extra}

    def full_state(self, named_params: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The full fp32 trained weights by name, on every rank (collective on every rank).

        With a master, the master is the trained weight (the parameters are its rounding).
        """
        if self.master is not None and not getattr(self.master, "params_are_master", False):
            flat = self.master.full_master()
            values = self.master.unflatten(flat)
            by_id = {id(p): v for p, v in zip(self.master.flat.params, values)}
            return {n: by_id[id(p)].detach().float().cpu().clone() for n, p in named_params if id(p) in by_id}
        from torch.distributed.tensor import DTensor

        out = {}
        for n, p in named_params:
            full = p.full_tensor() if isinstance(p, DTensor) else p
            out[n] = full.detach().float().cpu().clone()
        return out
