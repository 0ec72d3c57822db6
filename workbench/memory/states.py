"""Model states per rank (params, grads, fp32 master, optimizer), one small function per strategy.

Bytes per parameter follow the ZeRO paper's mixed-precision accounting (Rajbhandari et al.
2020, arXiv:1910.02054): 2 (fp16/bf16 weights) + 2 (gradients) + 12 (fp32 master 4 + Adam's
two moments 8), K = 12 "optimizer states" split here into `master` and `optimizer`.
In fp32 there is no separate master copy: 4 + 4 + 8. N is the data-parallel degree.
"""
from __future__ import annotations

from dataclasses import dataclass

OPTIMIZER_BYTES = {"adam": 8, "adamw": 8, "sgd": 4}  # fp32 moments per parameter (SGD: momentum)


@dataclass(frozen=True)
class States:
    params: float
    grads: float
    master: float
    optimizer: float
    note: str


def _bytes(dtype: str, optimizer: str) -> tuple[int, int, int, int]:
    """(weights, grads, master, optimizer) bytes per parameter before any sharding."""
    opt = OPTIMIZER_BYTES[optimizer]
    if dtype == "fp32":
        return 4, 4, 0, opt
    return 2, 2, 4, opt


def ddp(p: float, shard: float, n: int, dtype: str, optimizer: str) -> States:
    w, g, m, o = _bytes(dtype, optimizer)
    return States(w * p, g * p, m * p, o * p, "DDP: every rank holds everything")


def zero1(p: float, shard: float, n: int, dtype: str, optimizer: str) -> States:
    w, g, m, o = _bytes(dtype, optimizer)
    return States(w * p, g * p, m * shard, o * shard, f"ZeRO-1: master and optimizer state / dp({n})")


def zero1_flat(p: float, shard: float, n: int, dtype: str, optimizer: str) -> States:
    """Our sharded optimizer (MasterOptimizer, parallel/master.py; zero.py builds it sharded): each
    rank owns a flat ceil(P/N) range and keeps its fp32 master (in fp32 too: it steps an fp32 copy
    and all-gathers the result)."""
    w, g, m, o = _bytes(dtype, optimizer)
    rng = -(-p // n)
    return States(w * p, g * p, 4 * rng, o * rng, f"ZeRO-1: flat 1/dp({n}) range of fp32 master and optimizer state")


def zero2(p: float, shard: float, n: int, dtype: str, optimizer: str) -> States:
    w, g, m, o = _bytes(dtype, optimizer)
    return States(w * p, g * shard, m * shard, o * shard, f"ZeRO-2: gradients, master and optimizer / dp({n})")


def zero3_paper(p: float, shard: float, n: int, dtype: str, optimizer: str) -> States:
    w, g, m, o = _bytes(dtype, optimizer)
    return States(w * shard, g * shard, m * shard, o * shard, f"ZeRO-3: everything / dp({n})")


def zero3_fsdp2(p: float, shard: float, n: int, dtype: str, optimizer: str) -> States:
    """FSDP2 fully_shard: the persistent sharded parameter is fp32; with a MixedPrecisionPolicy
    it IS the master copy (params 0) and its gradient shard is fp32 too."""
    w, g, m, o = _bytes(dtype, optimizer)
    if dtype == "fp32":
        return States(4 * shard, 4 * shard, 0, o * shard, f"FSDP2: sharded fp32 params, grads, optimizer / dp({n})")
    return States(0, 4 * shard, 4 * shard, o * shard,
                  f"FSDP2 + MixedPrecisionPolicy: the fp32 shard is the master copy; {dtype} weights are "
                  "gathered per block (buffers)")


def zero2_fsdp2(p: float, shard: float, n: int, dtype: str, optimizer: str) -> States:
    """FSDP2 with reshard_after_forward=False: states as zero3_fsdp2; the gathered weights stay
    from forward to backward and are counted in buffers."""
    s = zero3_fsdp2(p, shard, n, dtype, optimizer)
    return States(s.params, s.grads, s.master, s.optimizer, s.note.replace("FSDP2", "ZeRO-2 (FSDP2, no reshard)", 1))


CONVENTIONS = {
    # What the ZeRO paper counts (Figure 1 / Table 1): reproduces its 7.5B x 64 GPU example.
    "zero-paper": {0: ddp, 1: zero1, 2: zero2, 3: zero3_paper},
    # What workbench's runtime allocates (docs/strategies.md, "Bytes per parameter kept per rank").
    "workbench": {0: ddp, 1: zero1_flat, 2: zero2_fsdp2, 3: zero3_fsdp2},
}


def model_states(p: float, shard: float, n: int, zero: int, dtype: str, optimizer: str,
                 convention: str = "workbench") -> States:
    """Model states of one rank holding `p` parameters (`shard` of them after dp(n) sharding)."""
    if n == 1:
        shard = p
    return CONVENTIONS[convention][zero](p, shard, n, dtype, optimizer)


def nvme_staging_bytes(range_numel: float, optimizer: str, zero: int) -> int:
    """Host bytes of the nvme staging buffers (parallel/offload.py): zero 0/1 stage master and
    moments of one chunk; zero 2/3 two slots of the moments (double buffering) and one gradient chunk."""
    chunk = min(4 * 2**20, max(4096, -(-int(range_numel) // 8)))
    moments = OPTIMIZER_BYTES[optimizer] // 4
    return 4 * chunk * ((1 + moments) if zero < 2 else (2 * moments + 1))


def offload(states: States, where: str, zero: int, range_numel: float, optimizer: str) -> tuple[States, float, float]:
    """Move what offload moves off the device. Returns (device states, host bytes, disk bytes).

    cpu (FSDP2 CPUOffloadPolicy, zero 2/3): every model state of the rank lives in host memory
    and the optimizer steps there. nvme at zero 0/1: the fp32 master (also for fp32) and the
    optimizer state of the rank's range live in files, streamed through a staging buffer (counted
    in the device's buffers, where the step runs). nvme at zero 2/3 (ZeRO-Infinity): FSDP2's fp32
    shards (the parameters, or the master in mixed precision) and the moments in files; the
    gradient shards in host memory (CPUOffloadPolicy) with the staging buffers.
    """
    if where == "none":
        return states, 0.0, 0.0
    if where == "cpu":
        moved = states.params + states.grads + states.master + states.optimizer
        return States(0.0, 0.0, 0.0, 0.0, f"{states.note}; offload=cpu: all model states in host memory"), moved, 0.0
    if zero >= 2:
        disk = states.params + states.master + states.optimizer
        host = states.grads + nvme_staging_bytes(range_numel, optimizer, zero)
        return States(0.0, 0.0, 0.0, 0.0, f"{states.note}; offload=nvme (ZeRO-Infinity): fp32 shards and optimizer "
                      "state in files, gradient shards in host memory"), host, disk
    disk = (4 + OPTIMIZER_BYTES[optimizer]) * range_numel
    return States(states.params, states.grads, 0.0, 0.0,
                  f"{states.note}; offload=nvme: fp32 master and optimizer state in files"), 0.0, disk
