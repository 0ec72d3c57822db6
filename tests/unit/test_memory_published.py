"""The memory model against GPU peaks others measured (workbench/measured_memory.yaml) and the
device-memory convention: `total` is the allocated peak; `device_used` adds the allocator's
reserve, the CUDA context and NCCL's buffers."""
from pathlib import Path

import pytest
import yaml

from workbench.memory import Layout
from workbench.memory.estimate import ALLOCATOR_RESERVE, CUDA_CONTEXT_BYTES, device_used, estimate_stage
from workbench.shapes import resolve_shape
from workbench.spec import ModelSpec

ROWS = yaml.safe_load((Path(__file__).resolve().parents[2] / "workbench" / "measured_memory.yaml").read_text())["cases"]
BF16 = [r for r in ROWS if r["dtype"] == "bf16"]


def _reserved_gib(row, checkpointing: str) -> float:
    sh = resolve_shape(ModelSpec(**row["model"], tie_embeddings=row.get("tie_embeddings", False)))
    lay = Layout(**{**row["layout"], "activation_checkpointing": checkpointing}, micro_batch=row["micro_batch"],
                 dtype=row["dtype"], device="cuda")
    peak = max(estimate_stage(sh, lay, k).total for k in {0, lay.pp - 1})
    return peak * (1 + ALLOCATOR_RESERVE) / 2**30


@pytest.mark.parametrize("row", BF16, ids=[r["name"] for r in BF16])
def test_torchtitan_reserved_peaks_lie_between_full_and_no_recompute(row):
    """torchtitan's runs used op-level selective checkpointing (it saves some matmul outputs and
    recomputes the rest), a policy between our `full` and `none`: their measured reserved peak
    must lie between ours for those two, on 8 and on 128 GPUs (FSDP shards the states 16x more)."""
    assert row["measured"]["kind"] == "reserved" and row["layout"]["activation_checkpointing"] == "selective"
    measured = row["measured"]["peak_gib"]
    assert _reserved_gib(row, "full") < measured < _reserved_gib(row, "none")


def test_logits_are_sharded_over_tp():
    """The loss runs on vocab-sharded logits (loss_parallel): the last stage's transient logits
    and their fp32 copy shrink with tp (they were once counted whole, which refused layouts that run)."""
    sh = resolve_shape(ModelSpec(preset="llama-7b"))
    tokens = 2 * sh.seq_len

    def buffers(tp):
        return estimate_stage(sh, Layout(tp=tp, micro_batch=2, dtype="bf16", device="cuda"), 0).buffers

    logits = tokens * sh.vocab * (2 + 4)
    assert buffers(1) - buffers(4) == pytest.approx(logits * 3 / 4, rel=1e-6)


def test_device_used_adds_reserve_context_and_nccl_on_cuda_only():
    cuda = Layout(dp=8, tp=2, device="cuda", dtype="bf16")
    used = device_used(10 * 2**30, cuda)
    assert used == 10 * 2**30 * (1 + ALLOCATOR_RESERVE) + CUDA_CONTEXT_BYTES + 3 * 256 * 2**20  # dp, tp, world
    assert device_used(10 * 2**30, Layout(dp=8, device="cpu")) == 10 * 2**30


def test_gpu_buffers_hold_cublas_workspaces_and_bounded_master_chunks():
    """On a GPU `buffers` holds cuBLAS's two 32 MiB workspaces (measured on an H200: 32 MiB after
    the first GEMM, 64 after its backward) and the fp32 master's step chunk: up to 64 Mi elements
    of all-gather staging over the ranks of a sharded master (parallel/master.py), so a zero=1
    run stages at most max(64 Mi, dp x 4 Mi) elements."""
    from workbench.memory.estimate import CUBLAS_WORKSPACE_BYTES

    sh = resolve_shape(ModelSpec(preset="llama-7b"))

    def buffers(device, **kw):
        return estimate_stage(sh, Layout(micro_batch=1, dtype="bf16", device=device, **kw), 0).buffers

    assert CUBLAS_WORKSPACE_BYTES == 64 * 2**20
    # same logits, same activations: cuda adds the workspaces and a 64 Mi-element fp32 grad chunk (4 Mi on CPU)
    assert buffers("cuda") - buffers("cpu") == CUBLAS_WORKSPACE_BYTES + (64 - 4) * 2**20 * 4
    # zero=1: the runtime's chunk (each rank's range of 7B / dp is past 64 Mi elements here): an fp32
    # grad chunk and dp chunks of bf16 all-gather staging, at most 64 Mi elements over the ranks
    # from dp 16 on no more than the 4 Mi-element chunks of a CPU
    from workbench.parallel.master import memory_chunk_size

    for dp in (2, 16, 64):
        c = memory_chunk_size(10**10, cuda=True, world=dp)
        assert dp * c == max(64 * 2**20, dp * 4 * 2**20)
        assert buffers("cuda", dp=dp, zero=1) - buffers("cuda", zero=0) == c * 4 + dp * c * 2 - 64 * 2**20 * 4
