"""Model states per rank (params, grads, fp32 master, optimizer), one small function per strategy.

Bytes per parameter follow the ZeRO paper's mixed-precision accounting (Rajbhandari et al.
2020, arXiv:1910.02054): 2 (fp16/bf16 weights) + 2 (gradients) + 12 (fp32 master 4 + Adam's
two moments 8), K = 12 "optimizer states" split here into `master` and `optimizer`.
In fp32 there is no separate master copy: 4 + 4 + 8. N is the data-parallel degree.
"""
from __future__ import annotations

from dataclasses import dataclass

from workbench.parallelism import Parallelism

OPTIMIZER_BYTES = {"adam": 8, "adamw": 8, "sgd": 4}  # fp32 moments per parameter (SGD: momentum)


@dataclass(frozen=True)
class States:
    params: float
    grads: float
    master: float
    optimizer: float
    note: str


def _bytes(par: Parallelism, optimizer: str) -> tuple[int, int, int, int]:
    """(weights, grads, master, optimizer) bytes per parameter before any sharding."""
    opt = OPTIMIZER_BYTES[optimizer]
    if not par.mixed:
        return 4, 4, 0, opt
    return 2, 2, 4, opt


def ddp(p: float, shard: float, par: Parallelism, optimizer: str) -> States:
    w, g, m, o = _bytes(par, optimizer)
    return States(w * p, g * p, m * p, o * p, "DDP: every rank holds everything")


def zero1(p: float, shard: float, par: Parallelism, optimizer: str) -> States:
    w, g, m, o = _bytes(par, optimizer)
    return States(w * p, g * p, m * shard, o * shard, f"ZeRO-1: master and optimizer state / dp({par.dp})")


def zero1_flat(p: float, shard: float, par: Parallelism, optimizer: str) -> States:
    """Our sharded optimizer (MasterOptimizer, parallel/master.py; zero.py builds it sharded): each rank owns a flat ceil(P/N)
    range and keeps its fp32 master (in fp32 too: it steps an fp32 copy and all-gathers the result)."""
    w, g, m, o = _bytes(par, optimizer)
    n = par.dp
    rng = -(-p // n)
    return States(w * p, g * p, 4 * rng, o * rng, f"ZeRO-1: flat 1/dp({n}) range of fp32 master and optimizer state")


def zero2(p: float, shard: float, par: Parallelism, optimizer: str) -> States:
    w, g, m, o = _bytes(par, optimizer)
    return States(w * p, g * shard, m * shard, o * shard, f"ZeRO-2: gradients, master and optimizer / dp({par.dp})")


def zero3_paper(p: float, shard: float, par: Parallelism, optimizer: str) -> States:
    w, g, m, o = _bytes(par, optimizer)
    return States(w * shard, g * shard, m * shard, o * shard, f"ZeRO-3: everything / dp({par.dp})")


def zero3_fsdp2(p: float, shard: float, par: Parallelism, optimizer: str) -> States:
    """FSDP2 fully_shard: the persistent sharded parameter is fp32; with a MixedPrecisionPolicy
    it IS the master copy (params 0) and its gradient shard is fp32 too."""
    w, g, m, o = _bytes(par, optimizer)
    n = par.dp
    if not par.mixed:
        return States(4 * shard, 4 * shard, 0, o * shard, f"FSDP2: sharded fp32 params, grads, optimizer / dp({n})")
    return States(0, 4 * shard, 4 * shard, o * shard,
                  f"FSDP2 + MixedPrecisionPolicy: the fp32 shard is the master copy; {par.dtype} weights are "
                  "gathered per FSDP2 unit (buffers)")


def zero2_fsdp2(p: float, shard: float, par: Parallelism, optimizer: str) -> States:
    """FSDP2 with reshard_after_forward=False: states as zero3_fsdp2; the gathered weights stay
    from forward to backward and are counted in buffers."""
    s = zero3_fsdp2(p, shard, par, optimizer)
    return States(s.params, s.grads, s.master, s.optimizer, s.note.replace("FSDP2", "ZeRO-2 (FSDP2, no reshard)", 1))


CONVENTIONS = {
    # What the ZeRO paper counts (Figure 1 / Table 1): reproduces its 7.5B x 64 GPU example.
    "zero-paper": {"ddp": ddp, "zero1": zero1, "zero2": zero2, "zero3": zero3_paper},
    # What workbench's runtime allocates (docs/strategies.md, "Bytes per parameter kept per rank").
    "workbench": {"ddp": ddp, "zero1": zero1_flat, "zero2": zero2_fsdp2, "zero3": zero3_fsdp2},
}


def sharded_states(par: Parallelism) -> str:
    """Which model states dp shards, from the layout's facts (a key of each convention): "ddp"
    none, "zero1" the optimizer state, "zero2" also the gradients (FSDP2 keeping the gathered
    weights to backward), "zero3" also the parameters."""
    if par.fsdp:
        return "zero3" if par.reshard_after_forward else "zero2"
    return "zero1" if par.shards_optimizer_state else "ddp"


def model_states(p: float, shard: float, par: Parallelism, optimizer: str, convention: str = "workbench") -> States:
    """Model states of one rank holding `p` parameters (`shard` of them after dp sharding)."""
    if par.dp == 1:
        shard = p
    return CONVENTIONS[convention][sharded_states(par)](p, shard, par, optimizer)


def nvme_staging_bytes(range_numel: float, optimizer: str, par: Parallelism) -> int:
    """Host bytes of the nvme staging buffers (parallel/offload.py): without FSDP2 (zero 0/1) the
    master and moments of one chunk; with FSDP2 (zero 2/3) two slots of the moments (double
    buffering) and one gradient chunk."""
    chunk = min(4 * 2**20, max(4096, -(-int(range_numel) // 8)))
    moments = OPTIMIZER_BYTES[optimizer] // 4
    return 4 * chunk * ((2 * moments + 1) if par.fsdp else (1 + moments))


def offload(states: States, par: Parallelism, range_numel: float, optimizer: str) -> tuple[States, float, float]:
    """Move what `par.offload` moves off the device. Returns (device states, host bytes, disk bytes).

    cpu (FSDP2 CPUOffloadPolicy, zero 2/3): every model state of the rank lives in host memory
    and the optimizer steps there. nvme at zero 0/1: the fp32 master (also for fp32) and the
    optimizer state of the rank's range live in files, streamed through a staging buffer (counted
    in the device's buffers, where the step runs). nvme at zero 2/3 (ZeRO-Infinity): FSDP2's fp32
    shards (the parameters, or the master in mixed precision) and the moments in files; the
    gradient shards in host memory (CPUOffloadPolicy) with the staging buffers.
    """
    if par.offload == "none":
        return states, 0.0, 0.0
    if par.offload == "cpu":
        moved = states.params + states.grads + states.master + states.optimizer
        return States(0.0, 0.0, 0.0, 0.0, f"{states.note}; offload=cpu: all model states in host memory"), moved, 0.0
    if par.fsdp:
        disk = states.params + states.master + states.optimizer
        host = states.grads + nvme_staging_bytes(range_numel, optimizer, par)
        return States(0.0, 0.0, 0.0, 0.0, f"{states.note}; offload=nvme (ZeRO-Infinity): fp32 shards and optimizer "
                      "state in files, gradient shards in host memory"), host, disk
    disk = (4 + OPTIMIZER_BYTES[optimizer]) * range_numel
    return States(states.params, states.grads, 0.0, 0.0,
                  f"{states.note}; offload=nvme: fp32 master and optimizer state in files"), 0.0, disk
