"""(d) DDP bucketed all-reduce overlapped with backward, against one all-reduce after backward.

On 2 gloo ranks, each round times forward+backward (with its gradient sync) for: DDP with small
to default buckets, DDP with one huge bucket, a single flat all-reduce after backward (no
overlap), backward with no communication at all, and the all-reduce alone. The time hidden
behind backward is (compute + all-reduce alone) - measured.
Run: python -m bench.bench_overlap [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import time

from bench.common import interleave, stats, table, tiny_spec, write_result

BUCKETS_MB = [0.25, 1.0, 4.0, 25.0]
ONE_BUCKET_MB = 4096.0  # larger than the model: all gradients in one bucket, reduced at the end


def config(quick: bool) -> dict:
    if quick:
        return {"preset": "gpt-tiny", "micro_batch": 2, "reps": 1, "iters": 2, "buckets": [1.0]}
    return {"preset": "gpt-mini", "micro_batch": 1, "reps": 8, "iters": 5, "buckets": BUCKETS_MB}


def _overlap_job(cfg: dict, sink) -> None:
    """Runs on every rank of a SpawnPool (process group already up)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from workbench.parallel.ddp import apply_ddp
    from workbench.parallel.materialize import build_model
    from workbench.parallel.mesh import build_mesh
    from workbench.spec import load_spec

    torch.manual_seed(0)
    world, rank = dist.get_world_size(), dist.get_rank()
    spec = tiny_spec(cfg["preset"], layout={"dp": world}, train={"micro_batch": cfg["micro_batch"]})
    mesh = build_mesh("cpu", dp=world, tp=1, pp=1)
    seq = load_spec(spec).model.shape().seq_len
    tokens = torch.randint(0, 256, (cfg["micro_batch"], seq + 1), generator=torch.Generator().manual_seed(rank))

    def fwd_bwd(model):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()

    plain = build_model(spec)
    params = list(plain.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    ddps = {mb: apply_ddp(build_model(spec), mesh, bucket_mb=mb) for mb in cfg["buckets"] + [ONE_BUCKET_MB]}

    def after_backward():
        fwd_bwd(plain)
        # One flat all-reduce once backward is done: nothing overlaps.
        torch.cat([p.grad.flatten() for p in params], out=flat)
        dist.all_reduce(flat)
        torch.cat([p.grad.flatten() for p in params], out=flat)  # copy back costs the same again

    def timed(fn):
        def once():
            dist.barrier()
            samples = []
            for _ in range(cfg["iters"]):
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
            return statistics.median(samples)
        return once

    variants = {f"ddp bucket {mb:g} MiB": timed(lambda m=m: fwd_bwd(m)) for mb, m in ddps.items() if mb != ONE_BUCKET_MB}
    variants["ddp one bucket"] = timed(lambda: fwd_bwd(ddps[ONE_BUCKET_MB]))
    variants["all-reduce after backward"] = timed(after_backward)
    variants["backward, no communication"] = timed(lambda: fwd_bwd(plain))
    variants["all-reduce alone"] = timed(lambda: dist.all_reduce(flat))
    times = interleave(variants, reps=cfg["reps"], warmup=1)
    if rank == 0:
        sink({"event": "overlap", "times": times, "grad_bytes": flat.numel() * 4})


def run(quick: bool = False, pool=None) -> dict:
    """Measure on a 2-rank SpawnPool (started here unless `pool` is given)."""
    from workbench.runtime.spawn import SpawnPool

    cfg = config(quick)
    own = pool is None
    pool = pool or SpawnPool(2)
    try:
        events = pool.run(cfg, fn=_overlap_job, timeout_s=900)
    finally:
        if own:
            pool.close()
    ev = next(e for e in events if e["event"] == "overlap")
    med = {name: stats(v) for name, v in ev["times"].items()}
    compute = med["backward, no communication"]["median"]
    comm = med["all-reduce alone"]["median"]
    rows = {}
    for name, s in med.items():
        if name in ("backward, no communication", "all-reduce alone"):
            continue
        t = s["median"]
        rows[name] = {"step_s": s, "exposed_comm_s": t - compute, "hidden_s": compute + comm - t,
                      "hidden_frac": (compute + comm - t) / comm if comm else float("nan")}
    return {"config": {**cfg, "dp": 2, "grad_bytes": ev["grad_bytes"]},
            "times": ev["times"],
            "compute_s": med["backward, no communication"], "allreduce_s": med["all-reduce alone"], "variants": rows}


def summary_rows(result: dict) -> list[list]:
    v = result["variants"]
    small = min((k for k in v if k.startswith("ddp bucket")), key=lambda k: v[k]["step_s"]["median"])
    none = v["all-reduce after backward"]
    return [["d) overlap", f"{small} / all-reduce after backward (fwd+bwd time)",
             v[small]["step_s"]["median"] / none["step_s"]["median"], "", "< 1"],
            ["d) overlap", f"{small}: share of all-reduce hidden behind backward", v[small]["hidden_frac"], "", ""]]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    result = run(args.quick)
    path = write_result("overlap", result)
    rows = [[k, r["step_s"]["median"], r["step_s"]["min"], r["step_s"]["max"], r["exposed_comm_s"], r["hidden_frac"]]
            for k, r in result["variants"].items()]
    rows += [["backward, no communication", result["compute_s"]["median"], result["compute_s"]["min"],
              result["compute_s"]["max"], 0.0, float("nan")],
             ["all-reduce alone", result["allreduce_s"]["median"], result["allreduce_s"]["min"],
              result["allreduce_s"]["max"], float("nan"), float("nan")]]
    print(table(rows, ["fwd+bwd+sync (s)", "median", "min", "max", "exposed comm (s)", "comm hidden"]))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
