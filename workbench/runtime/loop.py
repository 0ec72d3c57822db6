"""The per-rank training loop. Launcher-agnostic: it reads rank and world size from
torch.distributed, so it runs the same under a Ray relay, torchrun, a cloud launcher or in-process.

No Ray import here. Metrics leave through `sink(event: dict)`; see docs/architecture.md, Contracts.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from workbench.data import IGNORE, build_token_source, targets, token_loss_sum
from workbench.models import build_model_meta
from workbench.parallel.apply import Parallelized, parallelize
from workbench.parallel.mesh import build_mesh, coords
from workbench.parallel.precision import DynamicLossScaler, autocast
from workbench.parallel.step import TrainStep
from workbench.parallelism import Parallelism
from workbench.runtime.checkpoint import build_checkpointer
from workbench.runtime.checkpoint_store import RESUME_OR_FRESH
from workbench.runtime.host import host_figures
from workbench.runtime.meter import MemoryMeter
from workbench.runtime.preemption import PreemptionNotice
from workbench.runtime.tracking import tracked
from workbench.schedule import lr_for
from workbench.spec import JobSpec, load_spec
from workbench.validate import check_runnable, validate_spec

Sink = Callable[[dict], None]
MEMORY_EVERY = 5  # steps between memory events (and the first and last step)
TIMELINE_STEP = 2  # pp > 1: the step whose F/B/W timings are emitted (step 1 also infers shapes)


@dataclass
class RankContext:
    rank: int
    world_size: int  # the process group's size (a layout's is Parallelism.world_size; build_mesh checks they agree)
    device: torch.device


def init_distributed() -> RankContext:
    """Join the process group the launcher prepared (env:// variables), or run alone."""
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return RankContext(rank, world, device)


def build_train_step(parallelized: Parallelized, spec: JobSpec, parallelism: Parallelism, device: torch.device,
                     mesh) -> TrainStep:
    """The optimizer side of the step for this layout and precision (see parallel/step.py): the
    spec's optimizer settings, `parallelism`'s dtype and pipeline degree."""
    t = spec.train
    scaler = DynamicLossScaler(spec.precision.initial_loss_scale, enabled=(parallelism.dtype == "fp16"))
    params = [p for m in parallelized.modules for p in m.parameters() if p.requires_grad]
    return TrainStep(params, optimizer=t.optimizer, lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
                     scaler=scaler, master=parallelized.master, comm_device=device,
                     pp_group=mesh.get_group("pp") if mesh is not None and parallelism.pp > 1 else None,
                     copies=parallelized.tied_copies)


def micro_batch_loss(model, tokens: torch.Tensor, y: torch.Tensor | None = None,
                     scale: float | None = None) -> torch.Tensor:
    """Cross-entropy of a micro-batch. tokens: (B, T + 1); y: its (B, T) targets, IGNORE where a
    token does not train (default: every next token). Returns the sum over the target tokens
    times `scale`, or with no scale their mean."""
    x, y = tokens[:, :-1], tokens[:, 1:] if y is None else y
    logits = model(x)  # (B, T, vocab)
    total = token_loss_sum(logits, y)
    return total * scale if scale is not None else total / max(int((y != IGNORE).sum()), 1)


def forward_backward(parallelized: Parallelized, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], meter: MemoryMeter,
                     step: TrainStep, dtype: str = "fp32", scale: float = 1.0) -> torch.Tensor:
    """Gradient accumulation: one backward per micro-batch, gradient sync only on the last. Each
    micro-batch's summed loss is multiplied by `scale` (dp / the global count of target tokens)
    before backward. Returns the summed loss of this rank's target tokens."""
    n = len(micro_batches)
    total = torch.zeros((), device=micro_batches[0][0].device)
    for i, (tokens, y) in enumerate(micro_batches):
        with parallelized.no_sync() if i < n - 1 else contextlib.nullcontext(), parallelized.loss_context():
            with meter.saving(), autocast(tokens.device.type, dtype):
                loss = micro_batch_loss(parallelized.model, tokens, y, scale=1.0)  # summed over its target tokens
            step.scale_loss(loss * scale).backward()
        meter.released()
        total += _full(loss.detach())
    return total


def loss_token_count(y: torch.Tensor, masked: bool, dp: int, dp_group) -> int:
    """Target tokens of the whole global batch: this rank's, summed over dp (one all-reduce when
    a loss mask makes the ranks' counts differ; every rank has the same count otherwise)."""
    n = (y != IGNORE).sum()
    if not masked:
        return int(n) * dp
    if dp_group is not None:
        dist.all_reduce(n, group=dp_group)
    return int(n)


@torch.no_grad()
def evaluate(run: _Run) -> float:
    """Mean held-out loss per target token over train.eval_batches global batches (the same
    batches every time; completion tokens only for fine-tuning data), summed over the dp ranks
    before dividing: the layout-free number the single-process run computes."""
    t, lay, parallelized, device = run.spec.train, run.parallelism, run.parallelized, run.ctx.device
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # (loss summed over target tokens, their count)
    for j in range(t.eval_batches):
        tokens, mask = run.source.val_examples(j, t.global_batch, run.where["dp"], lay.dp)
        tokens = tokens.to(device)
        y = targets(tokens, None if mask is None else mask.to(device))
        sums[1] += (y != IGNORE).sum()
        if run.pipeline is not None:
            sums[0] += run.pipeline.evaluate(tokens, y)
            continue
        for tok, target in zip(tokens.split(lay.micro_batch), y.split(lay.micro_batch)):
            with parallelized.loss_context(), autocast(tok.device.type, lay.dtype):
                sums[0] += _full(micro_batch_loss(parallelized.model, tok, target, scale=1.0).detach())
    if run.dp_group is not None:
        dist.all_reduce(sums, group=run.dp_group)
    return (sums[0] / sums[1].clamp(min=1)).item()


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor (a loss computed under loss_parallel is a replicated DTensor)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def train(spec: JobSpec | dict, sink: Sink, *, should_stop: Callable[[], bool] = lambda: False,
          resume: bool = False, gather_state: bool = False, attempt: int = 0,
          on_started: Callable[[dict], None] | None = None) -> dict:
    """Train `spec` on this rank. Returns the final {"status", "step", "loss"}.

    Args:
        spec: the job: a dict (what travels to a rank) is loaded here, a JobSpec (loaded by the
            caller) validated again; the rank runs on this one spec and its one Parallelism.
        sink: receives each metrics event (all ranks emit memory events; rank 0 the others).
        should_stop: polled after each step's update on every rank, before the step is reported;
            if any rank says True, all ranks stop after the same step and the run ends with status
            "preempted".
        resume: continue from the newest complete checkpoint under checkpoint.uri; ConfigError when
            every checkpoint there is corrupt, unless RESUME_OR_FRESH (then start at step 1).
        gather_state: also return the full fp32 trained weights by canonical name under "state"
            (on rank 0; collective, for parity tests).
        attempt: how many times the launcher restarted the workers (recorded in the restart event).
        on_started: called once on every rank after its first step with its start-up as durations
            on this process's clock (`STARTUP_PHASES`); the local backend's ranks report them.
    """
    began = time.perf_counter()
    spec = _loaded(spec)
    joins = not dist.is_initialized()  # the launcher's env:// group is ours to destroy
    # SIGTERM -> stop after this step (main thread only); trackers get rank 0's events.
    try:
        with PreemptionNotice() as notice, tracked(spec, sink) as sink:
            result = _train(spec, sink, lambda: should_stop() or notice.requested, resume, gather_state, attempt,
                            _Started(on_started, began))
    finally:
        if joins and dist.is_initialized():
            # Before the interpreter exits, also after an error: a gloo group still alive then can
            # abort the process (SIGABRT, "terminate called without an active exception",
            # pytorch/pytorch#190489), replacing the error's exit code.
            dist.destroy_process_group()
    if notice.requested and notice.seconds_left() < 0:
        sink({"event": "warning", "message": notice.overrun_message()})
    return result


def _loaded(spec: JobSpec | dict) -> JobSpec:
    """The rank's one spec: load a dict (or path), validate a JobSpec again in place (a notebook may
    have changed it since it was loaded) instead of loading it a second time."""
    if not isinstance(spec, JobSpec):
        return load_spec(spec)
    validate_spec(spec)
    return spec


STARTUP_PHASES = {  # what `on_started` gets, in the order a rank spends them
    "spec_s": "the spec loaded and validated on the rank",
    "process_group_s": "process group (TCPStore rendezvous) and device mesh",
    "model_s": "model built and parallelized, optimizer step",
    "data_s": "data opened",
    "checkpoint_s": "checkpointer (and the restore of a resumed run)",
    "first_step_s": "step 1's compute",
}


class _Started:
    """The rank's start-up phases, timed on this process's clock until step 1 ends (`train`'s `on_started`)."""

    def __init__(self, report: Callable[[dict], None] | None, began: float):
        self._report, self.phases, self._last = report, {}, began

    def mark(self, phase: str) -> None:
        """`phase` ended now: it took the time since the previous mark."""
        now = time.perf_counter()
        self.phases[phase], self._last = now - self._last, now

    def step_done(self) -> None:
        if self._report is not None and "first_step_s" not in self.phases:
            self.mark("first_step_s")
            self._report(dict(self.phases))


@dataclass
class _Run:
    """What one rank builds before its first step (`_setup`) and uses in every step."""

    spec: JobSpec
    parallelism: Parallelism  # the spec's layout, precision and batch split: every layout fact the loop reads
    ctx: RankContext
    mesh: DeviceMesh | None
    where: dict[str, int]  # this rank's mesh coordinates
    parallelized: Parallelized
    step_fn: TrainStep
    source: Any  # data.TokenSource
    meter: MemoryMeter
    dp_group: Any  # the dp process group where dp > 1, else None
    pipeline: Any  # runtime.pipeline.PipelineEngine where pp > 1, else None


def _setup(spec: JobSpec, sink: Sink, started: _Started) -> _Run:
    """Join the process group, build the mesh and the parallelized model, the optimizer step, the
    data and (pp > 1) the pipeline engine."""
    check_runnable(spec)
    started.mark("spec_s")
    ctx = init_distributed()
    parallelism, t = Parallelism.from_spec(spec), spec.train
    mesh = build_mesh(ctx.device.type, dp=parallelism.dp, tp=parallelism.tp, pp=parallelism.pp)
    started.mark("process_group_s")
    torch.manual_seed(t.seed)
    parallelized = parallelize(build_model_meta(spec), mesh, parallelism, device=ctx.device, seed=t.seed)
    step_fn = build_train_step(parallelized, spec, parallelism, ctx.device, mesh)
    if ctx.rank == 0:
        for note in parallelized.notes:
            sink({"event": "note", "message": note})
    meter = MemoryMeter(ctx.device)
    meter.watch_params(parallelized.modules)
    dp_group = mesh.get_group("dp") if mesh is not None and parallelism.dp > 1 else None
    pipeline = None
    if parallelism.pp > 1:
        from workbench.runtime.pipeline import PipelineEngine

        pipeline = PipelineEngine(parallelized, mesh, schedule=parallelism.pp_schedule, device=ctx.device,
                                  num_microbatches=parallelism.num_micro, dtype=parallelism.dtype,
                                  scale_loss=step_fn.scale_loss)
    started.mark("model_s")
    source = build_token_source(spec)
    started.mark("data_s")
    return _Run(spec, parallelism, ctx, mesh, coords(mesh), parallelized, step_fn, source, meter, dp_group, pipeline)


def _train(spec: JobSpec, sink: Sink, should_stop: Callable[[], bool], resume: bool, gather_state: bool,
           attempt: int, started: _Started) -> dict:
    run = _setup(spec, sink, started)
    rank = run.ctx.rank
    ckpt = build_checkpointer(spec, run.parallelized.modules, run.step_fn.optimizer, sink,
                              extra_state=run.step_fn.stateful())
    try:
        step, loss_value, status = _loop(run, spec, ckpt, sink, should_stop, resume, attempt, started)
        ckpt.close()
    except BaseException:
        with contextlib.suppress(BaseException):  # the original error is the one to report
            ckpt.close()  # a failed or refused run leaves no lease behind (a full disk, a refused resume)
        raise
    result = {"status": status, "step": step, "loss": loss_value}
    if gather_state:
        state = _gather_state(run)
        if rank == 0:
            result["state"] = state
    if rank == 0:
        sink({"event": "end", "status": status, "step": step})
    return result


def _loop(run: _Run, spec: JobSpec, ckpt, sink: Sink, should_stop: Callable[[], bool], resume, attempt: int,
          started: _Started) -> tuple:
    """Restore (with `resume`), then train to the last step or a stop. Returns (step, loss, status)."""
    t, rank = spec.train, run.ctx.rank
    if resume:
        first = ckpt.restore(or_fresh=resume == RESUME_OR_FRESH) + 1
    else:
        ckpt.check_fresh()  # another run's checkpoints under the URI: refused, not written over
        first = 1
    started.mark("checkpoint_s")
    if resume and rank == 0:
        restart = {"event": "restart", "attempt": attempt, "from_step": first - 1}
        if ckpt.rejected_steps:  # skipped as incomplete or corrupt (a warning event each says why)
            restart["rejected"] = ckpt.rejected_steps
        sink(restart)
    step, loss_value, status = first - 1, float("nan"), "completed"
    for step in range(first, t.steps + 1):
        loss_value, agreed = _step(run, step, first, sink,
                                   flags=lambda s=step: ckpt.flags(s, should_stop(), last_step=t.steps))
        started.step_done()
        if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
            val = evaluate(run)
            if rank == 0:
                sink({"event": "eval", "step": step, "loss": val, "perplexity": math.exp(min(val, 700.0))})
        save, stop = ckpt.decide(step, agreed, last_step=t.steps)
        if save:
            ckpt.save(step, block=stop or step == t.steps)
        if stop:
            status = "preempted"
            break
    return step, loss_value, status


def _step(run: _Run, step: int, first: int, sink: Sink,
          flags: Callable[[], list[bool]] = list) -> tuple[float, list[bool]]:
    """One optimizer step: forward/backward of the rank's micro-batches (or the pipeline's), the
    gradient sync no wrapper does, the update; memory and step events.

    `flags`: called once the gradients are final, this rank's stop and save flags
    (`Checkpointer.flags`; it may wait for the driver's acknowledgement, which the step's time
    leaves out). They travel with the loss in the step's one all-reduce (`_agree`), started before
    the update and awaited after it. Returns (the global mean loss, each flag True if it is on any
    rank), the same on every rank."""
    parallelized, step_fn, meter, rank = run.parallelized, run.step_fn, run.meter, run.ctx.rank
    t, lay = run.spec.train, run.parallelism
    dp = lay.dp
    start, cpu_start = time.perf_counter(), time.process_time()
    step_fn.set_lr(lr_for(t, step))  # a pure function of the step: exact on resume
    tokens, mask = run.source.rank_examples(step, t.global_batch, run.where["dp"], dp)
    tokens = tokens.to(run.ctx.device)
    y = targets(tokens, None if mask is None else mask.to(run.ctx.device))
    # The loss is the mean over the global batch's target tokens: each rank's summed loss is
    # divided by the global count (dp / count before backward, as DDP/FSDP average over dp), so
    # micro-batches and ranks holding more completion tokens weigh more, whatever the layout.
    count = max(loss_token_count(y, mask is not None, dp, run.dp_group), 1)
    meter.active = step == first  # activations: measured once, see MemoryMeter.active
    meter.reset_peak()
    if run.pipeline is None:
        micro = list(zip(tokens.split(lay.micro_batch), y.split(lay.micro_batch)))
        loss = forward_backward(parallelized, micro, meter, step_fn, lay.dtype, scale=dp / count)
    else:
        loss, timeline = run.pipeline.step(tokens, y, meter, scale=dp / count,
                                           record=step == min(TIMELINE_STEP, t.steps))
        if timeline is not None:
            sink({"event": "timeline", "step": step, "rank": rank, "items": timeline})
    parallelized.finish_grads()
    waited = time.perf_counter()
    mine = flags()
    waited = time.perf_counter() - waited
    agreement = _agree(run, loss / count, mine)  # loss / count: this rank's part of the global mean
    step_extra = step_fn.step()  # while the agreement travels
    loss_value, agreed = agreement()
    elapsed = time.perf_counter() - start - waited
    if step == 1 or step == t.steps or step % MEMORY_EVERY == 0:
        held = step_fn.measured_states()
        # Every rank's own step time (wall, and this process's CPU): where a rank is slower.
        sink({"event": "memory", "step": step, "rank": rank, "coords": run.where,
              "step_time_s": elapsed, "cpu_s": time.process_time() - cpu_start,
              "measured": meter.measure(parallelized.modules, held["optimizer"], master=held["master"],
                                        offloaded=held["offloaded"], params_are_master=parallelized.params_are_master),
              **host_figures(run.ctx.device)})  # host memory; GPU utilisation and memory (NVML)
    step_fn.zero_grad()
    if rank == 0:
        sink({"event": "step", "step": step, "loss": loss_value,
              "tokens_per_s": t.global_batch * run.source.seq_len / elapsed, "step_time_s": elapsed,
              "time": time.time(), "lr": step_fn.lr, **step_extra})
    return loss_value, agreed


def _agree(run: _Run, part: torch.Tensor, flags: list[bool]) -> Callable[[], tuple[float, list[bool]]]:
    """Start the step's one collective; returns the wait for its result (the global mean loss, each
    flag True if any rank's is). A sum over the run's ranks (the world: build_mesh checks that the
    layout fills it) of the ranks' parts of the global mean loss, and of each flag. One rank per dp
    coordinate adds its part: the one that holds the last pipeline stage, at tp coordinate 0 (the tp
    ranks' losses are the same). The loss and the stop poll used to be two collectives (three with
    pp: the loss's broadcast from the last stage), each a round trip on the critical path; now one,
    and it travels while the update runs (the update's own collectives, on the dp, tp or pp groups,
    are issued after it on every rank). A one-rank run (also calibrate's one-rank probes inside a
    larger world, which have no mesh) has nothing to agree on."""
    if run.mesh is None or run.parallelism.world_size == 1:
        alone = float(part), [bool(f) for f in flags]
        return lambda: alone
    values = torch.tensor([0.0, *map(float, flags)], device=part.device)
    if run.where["tp"] == 0 and (run.pipeline is None or run.pipeline.has_last):
        values[0] = part
    work = dist.all_reduce(values, async_op=True)

    def result() -> tuple[float, list[bool]]:
        work.wait()
        loss, *rest = values.tolist()
        return loss, [v > 0 for v in rest]

    return result


def _gather_state(run: _Run) -> dict:
    """The full fp32 trained weights by canonical name, on rank 0 (collective; for parity tests)."""
    from workbench.parallel.materialize import param_name

    named = [(param_name(m, n), p) for m in run.parallelized.modules for n, p in m.named_parameters()]
    state = _gather_tp_shards(run.step_fn.full_state(named), named)
    if run.parallelism.pp > 1:  # each pipeline rank holds its stages: collect them all on rank 0
        parts = [None] * run.parallelism.world_size if run.ctx.rank == 0 else None
        dist.gather_object(state, parts, dst=0)
        state = {k: v for part in parts or [] for k, v in part.items()}
    return state


def _gather_tp_shards(state: dict, named: list) -> dict:
    """Values that came back as this rank's tensor-parallel shard (a master over local tensors)
    are all-gathered to the full tensor. Collective over the tp mesh."""
    from torch.distributed.tensor import DTensor

    for name, p in named:
        if isinstance(p, DTensor) and name in state and state[name].shape != p.shape:
            local = state[name].to(p.device).view(p.to_local().shape)
            state[name] = DTensor.from_local(local, p.device_mesh, p.placements).full_tensor().cpu()
    return state


def train_with_state(spec: JobSpec | dict, sink: Sink) -> dict:
    """`train` that also sinks {"event": "state", "state": {name: full fp32 tensor}} from rank 0
    (for parity tests through SpawnPool, whose jobs return only events)."""
    result = train(spec, sink, gather_state=True)
    if "state" in result:
        sink({"event": "state", "state": result.pop("state")})
    return result
