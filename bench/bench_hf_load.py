"""Peak host memory per rank when loading released weights (`model: {init: hf}`), against the
model's size: each rank should hold its share, never the whole model.

Writes a random Llama-style transformers folder (fp32 safetensors, sharded with an index, written
one shard at a time), then for each layout starts fresh gloo rank processes that build the
parallelized model from it exactly as a run does (meta model -> pp split -> tp -> FSDP ->
materialize, which reads the rank's slices) and report their high-water resident memory (VmHWM)
before and after, the anonymous (non file-backed) part, and the parameter bytes they hold.

Usage: python bench/bench_hf_load.py [--layers 8] [--hidden 1024] [--vocab 16000] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

LAYOUTS = {"single": (1, {}), "tp2": (2, {"tp": 2}), "pp2": (2, {"pp": 2}), "zero3-dp2": (2, {"dp": 2, "zero": 3}),
           "tp2-pp2": (4, {"tp": 2, "pp": 2})}


def status() -> dict[str, int]:
    """This process's VmHWM, VmRSS, RssAnon and RssFile in bytes (/proc/self/status)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def load_rank(spec: dict, sink) -> None:
    """Build this rank's parallelized model from spec (init: hf) and report its memory."""
    import gc

    import safetensors  # noqa: F401 - imports before the baseline: their memory is not the load's
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401

    import workbench.hf_import  # noqa: F401
    from workbench.models import build_model_meta
    from workbench.parallel.apply import parallelize
    from workbench.parallel.mesh import build_mesh
    from workbench.parallelism import Parallelism
    from workbench.spec import load_spec

    gc.collect()
    before = status()
    s = load_spec(spec)
    par = Parallelism.from_spec(s)
    mesh = build_mesh("cpu", dp=par.dp, tp=par.tp, pp=par.pp)
    model = parallelize(build_model_meta(s), mesh, par, device=torch.device("cpu"), seed=0)
    held = 0
    for m in model.modules:
        for p in {id(p): p for p in m.parameters()}.values():
            local = p.to_local() if hasattr(p, "to_local") else p
            held += local.numel() * local.element_size()
    after = status()
    sink({"event": "load", "rank": dist.get_rank() if dist.is_initialized() else 0, "before": before,
          "after": after, "held": held})


def write_model(directory: Path, layers: int, hidden: int, vocab: int) -> int:
    """A random fp32 Llama folder; returns its weights' bytes. One shard in memory at a time."""
    import torch
    from safetensors.torch import save_file

    from workbench.export import hf_config, to_hf
    from workbench.models import GPT
    from workbench.spec import ModelSpec

    shape = ModelSpec(family="llama", layers=layers, hidden=hidden, heads=hidden // 64, kv_heads=max(2, hidden // 256),
                      vocab=vocab, seq_len=256).shape()
    with torch.device("meta"):
        meta = GPT(shape)
    names = {k: tuple(v.shape) for k, v in to_hf(meta.state_dict(), shape).items()}
    gen = torch.Generator().manual_seed(0)
    weight_map, shard, size, total, n = {}, {}, 0, 0, 0

    def flush():
        nonlocal shard, size, n
        if shard:
            n += 1
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(directory / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for name, dims in names.items():
        t = torch.randn(dims, generator=gen) * 0.02
        shard[name] = t
        size += t.numel() * 4
        total += t.numel() * 4
        if size >= 64 << 20:
            flush()
    flush()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                         "weight_map": weight_map}))
    hf_config(shape).save_pretrained(str(directory))
    return total


def main() -> None:
    from workbench.runtime.spawn import SpawnPool

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--out", help="folder for the model (default: a temporary one)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(args.out or tmp)
        d.mkdir(parents=True, exist_ok=True)
        size = write_model(d, args.layers, args.hidden, args.vocab)
        mib = 1 << 20
        print(f"model: {size / mib:.0f} MiB of fp32 weights ({size // 4 / 1e6:.0f}M parameters), {d}")
        print(f"{'layout':<10} {'rank':>4} {'held MiB':>9} {'HWM +MiB':>9} {'anon +MiB':>9} "
              f"{'HWM+/model':>10} {'HWM+/held':>9}")
        rows = []
        for name in args.layouts.split(","):
            world, layout = LAYOUTS[name]
            spec = {"model": {"init": "hf", "path": str(d), "seq_len": 256}, "layout": layout,
                    "train": {"global_batch": 8, "micro_batch": 1 if layout.get("pp") else 4}}
            with SpawnPool(world) as pool:
                events = pool.run(spec, fn=load_rank, timeout_s=1200)
            for e in sorted((e for e in events if e["event"] == "load"), key=lambda e: e["rank"]):
                grew = e["after"]["VmHWM"] - e["before"]["VmHWM"]
                anon = e["after"]["RssAnon"] - e["before"]["RssAnon"]
                rows.append({"layout": name, "rank": e["rank"], "held": e["held"], "hwm_growth": grew,
                             "anon_growth": anon, "model": size})
                print(f"{name:<10} {e['rank']:>4} {e['held'] / mib:>9.0f} {grew / mib:>9.0f} {anon / mib:>9.0f} "
                      f"{grew / size:>10.2f} {grew / max(e['held'], 1):>9.2f}")
        print(json.dumps({"model_bytes": size, "rows": rows}))


if __name__ == "__main__":
    main()
