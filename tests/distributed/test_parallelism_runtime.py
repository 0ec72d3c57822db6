"""The runtime's parallelized model agrees with Parallelism's facts: what each rank really built
(FSDP2 modules, shards after forward, an fp32 master and its group, the stored dtype, DDP, the
stage modules, loss_parallel, checkpoint wrappers) is what parallelism.py says the layout implies,
which is what the memory and step-time models price."""
import contextlib

import pytest
import torch

from workbench.parallelism import Parallelism
from workbench.spec import load_spec

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

TINY = {"preset": "gpt-tiny"}
TIED = {"preset": "gpt-tiny", "tie_embeddings": True}
# name: (world, model, dtype, layout)
CASES = {
    "dp2-ddp": (2, TINY, "fp32", {"dp": 2}),
    "dp2-zero1-bf16": (2, TINY, "bf16", {"dp": 2, "zero": 1}),
    "dp2-zero2-bf16": (2, TINY, "bf16", {"dp": 2, "zero": 2}),
    "dp2-zero3-full": (2, TINY, "fp32", {"dp": 2, "zero": 3, "activation_checkpointing": "full"}),
    # 0.4 MiB: gpt-tiny's blocks (0.19 MiB of fp32 gradient each) two to an FSDP2 unit, not one unit in all.
    "dp2-zero3-units": (2, TINY, "fp32", {"dp": 2, "zero": 3, "bucket_mb": 0.4}),
    "tp2-fp16": (2, TINY, "fp16", {"tp": 2}),
    "pp2-interleaved-bf16-tied": (2, TIED, "bf16", {"pp": 2, "pp_schedule": "interleaved-1f1b"}),
    "dp2-tp2-sp-zero3-bf16": (4, TINY, "bf16", {"dp": 2, "tp": 2, "zero": 3, "sequence_parallel": True}),
    "dp2-pp2-zero1-fp16": (4, TINY, "fp16", {"dp": 2, "pp": 2, "zero": 1}),
}
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _spec(world: int, model: dict, dtype: str, layout: dict) -> dict:
    return {"model": model, "layout": layout, "precision": {"dtype": dtype},
            "train": {"global_batch": 4 * world, "micro_batch": 1, "steps": 1},
            "resources": {"gpus_per_node": world}}


def _dp_sharded(p) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor) and "dp" in (p.device_mesh.mesh_dim_names or ())


def observe(spec: dict, sink) -> None:
    """Parallelize the spec's model on this rank and sink what was really built."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from workbench.models import build_model_meta
    from workbench.parallel.apply import parallelize
    from workbench.parallel.local import local
    from workbench.parallel.mesh import build_mesh
    from workbench.runtime.loop import init_distributed

    spec = load_spec(spec)
    ctx, p = init_distributed(), Parallelism.from_spec(spec)
    mesh = build_mesh(ctx.device.type, dp=p.dp, tp=p.tp, pp=p.pp)
    out = parallelize(build_model_meta(spec), mesh, p, device=ctx.device, seed=0)
    blocks = list(out.modules[0].blocks.values())
    weight = next(w for w in blocks[0].parameters() if w.ndim == 2)
    if isinstance(out.model, DistributedDataParallel):
        sync = "ddp"
    elif isinstance(out.modules[0], FSDPModule):
        sync = "fsdp"
    else:
        sync = "all-reduce" if p.dp > 1 else "none"
    root = out.modules[0]
    seen = {
        "fsdp": isinstance(root, FSDPModule) and _dp_sharded(weight),
        "needs_master": out.master is not None,
        "master_sharded": out.master is not None and out.master.group is not None,
        "param_dtype": DTYPES[local(weight).dtype],
        "grad_sync": sync,
        "chunks": len(out.modules),
        "num_stages": out.num_stages,
        "loss_parallel": out.loss_context is not contextlib.nullcontext,
        "checkpointing": any(isinstance(b, CheckpointWrapper) for b in blocks),
    }
    if seen["fsdp"]:
        seen["units"] = len({id(m._get_fsdp_state()) for m in root.modules() if isinstance(m, FSDPModule)})
    if seen["fsdp"] and p.pp == 1:
        torch.manual_seed(1)  # the same tokens on every rank (tp ranks need the same input)
        out.model(torch.randint(0, spec.model.shape().vocab, (1, 16), device=ctx.device))
        seen["reshard_after_forward"] = _dp_sharded(next(w for w in blocks[0].parameters() if w.ndim == 2))
        # Gradient accumulation: a micro-batch but the step's last runs under no_sync; zero=2 keeps the
        # gathered weights past its backward for the next forward, the last one reshards them (apply.py).
        x = torch.randint(0, spec.model.shape().vocab, (1, 16), device=ctx.device)
        with out.no_sync():
            out.model(x).float().sum().backward()
        kept = not _dp_sharded(next(w for w in blocks[0].parameters() if w.ndim == 2))
        out.model(x).float().sum().backward()
        sink({"event": "gathered", "kept": kept, "sharded_after_last": _dp_sharded(
            next(w for w in blocks[0].parameters() if w.ndim == 2))})
    sink({"event": "seen", "rank": ctx.rank, "seen": seen})


def _units(spec, par: Parallelism) -> dict:
    """What the memory and step-time models count (pp = 1): FSDP2 units (the root is one), and
    whether a block is freed after forward (not where the whole model is the root's one unit)."""
    from workbench.memory.params import block_numel, unit_blocks, whole_unit

    if not par.fsdp or par.pp > 1:  # a pipeline's stages hold their own blocks: not counted here
        return {}
    shape = spec.model.shape()
    if whole_unit(shape.num_params() / par.tp, par.fsdp_unit_mb):
        return {"units": 1, "reshard_after_forward": False}
    k = unit_blocks(block_numel(shape, par.tp), par.fsdp_unit_mb)
    return {"units": 1 + -(-shape.layers // k)}


@pytest.mark.parametrize("name", list(CASES))
def test_runtime_builds_what_parallelism_says(spawn_pools, name):
    world, model, dtype, layout = CASES[name]
    spec = _spec(world, model, dtype, layout)
    par = Parallelism.from_spec(load_spec(spec))
    facts = {**par.facts(), **_units(load_spec(spec), par)}
    events = spawn_pools.get(world).run(spec, fn=observe, timeout_s=120)
    seen = [e["seen"] for e in events if e["event"] == "seen"]
    assert len(seen) == world
    for rank_seen in seen:
        assert rank_seen == {k: facts[k] for k in rank_seen}, (name, rank_seen)
    if facts["fsdp"] and layout.get("pp", 1) == 1:
        assert all("reshard_after_forward" in s for s in seen)  # the forward check ran
        gathered = [(e["kept"], e["sharded_after_last"]) for e in events if e["event"] == "gathered"]
        assert gathered == [(layout["zero"] == 2, True)] * world, gathered
