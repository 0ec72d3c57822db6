"""(k) Peers: workbench's ZeRO, CPU offload, TP (+SP) and PP against the scripts a user would write instead.

Each pair runs the same model (`build_model`, same seed), batches (`TokenSource`), shapes and AdamW
on the same 2 gloo ranks of one spawn pool (no process start-up in any measurement), alternated
A B, B A, ... round by round:
  zero1/2/3   workbench dp=2 zero=k  against  bench/peer_fsdp2.py (DDP + ZeroRedundancyOptimizer for
              zero=1, FSDP2 `fully_shard` for 2 and 3), and DeepSpeed's ZeRO (bench/peer_deepspeed.py)
              where DeepSpeed can run here;
  offload     workbench zero=3 offload=cpu  against  FSDP2 with its own CPUOffloadPolicy;
  tp, tp-sp   workbench tp=2 (sequence_parallel)  against  bench/peer_tp.py (`parallelize_module` with
              Colwise/Rowwise/SequenceParallel);
  pp-1f1b, pp-interleaved  workbench pp=2  against  bench/peer_pp.py (`torch.distributed.pipelining`);
  sp/tp       workbench tp=2 with sequence parallel against workbench tp=2 without (issue #35 item 2).
Throughput: tokens/s between rank 0's step ends after `skip` warm-up steps. Ratios are per round
(A/B, the pair measured side by side), then the median with its 95% bootstrap interval. Losses:
the largest relative difference between the two arms' per-step losses (first round).
Run: python -m bench.bench_peers [--quick] [--reps N] [--only zero3,tp-sp] [--preset gpt-mini]
"""
from __future__ import annotations

import argparse
import os
import time

from bench.common import (
    median_ci,
    paired_ratios,
    read_result,
    stats,
    steady_tokens_per_s,
    table,
    tiny_spec,
    write_result,
)

GOAL = 0.95
SP_GOAL = 1.15  # item 2: sequence parallel's step time within 1.15x of plain tp on the same layout

# name: (workbench layout, peer module, peer options); "workbench" as the module: a workbench arm.
PAIRS: dict[str, tuple[dict, str, dict]] = {
    "zero1": ({"dp": 2, "zero": 1}, "peer_fsdp2", {"zero": 1}),
    "zero2": ({"dp": 2, "zero": 2}, "peer_fsdp2", {"zero": 2}),
    "zero3": ({"dp": 2, "zero": 3}, "peer_fsdp2", {"zero": 3}),
    "zero1-ds": ({"dp": 2, "zero": 1}, "peer_deepspeed", {"zero": 1}),
    "zero2-ds": ({"dp": 2, "zero": 2}, "peer_deepspeed", {"zero": 2}),
    "zero3-ds": ({"dp": 2, "zero": 3}, "peer_deepspeed", {"zero": 3}),
    "offload": ({"dp": 2, "zero": 3, "offload": "cpu"}, "peer_fsdp2", {"zero": 3, "offload": "cpu"}),
    "tp": ({"tp": 2}, "peer_tp", {"sp": False}),
    "tp-sp": ({"tp": 2, "sequence_parallel": True}, "peer_tp", {"sp": True}),
    "pp-1f1b": ({"pp": 2, "pp_schedule": "1f1b"}, "peer_pp", {"schedule": "1f1b"}),
    "pp-interleaved": ({"pp": 2, "pp_schedule": "interleaved-1f1b", "virtual_stages": 2}, "peer_pp",
                       {"schedule": "interleaved-1f1b", "virtual": 2}),
    "sp/tp": ({"tp": 2, "sequence_parallel": True}, "workbench", {"layout": {"tp": 2}}),
}
PEER_LABEL = {"peer_fsdp2": "plain FSDP2 / ZeRO optimizer", "peer_tp": "plain parallelize_module",
              "peer_pp": "plain torch.distributed.pipelining", "peer_deepspeed": "DeepSpeed ZeRO",
              "workbench": "workbench tp=2 (no SP)"}


def config(quick: bool, preset: str | None = None) -> dict:
    if quick:
        return {"preset": preset or "gpt-tiny", "steps": 3, "skip": 1, "reps": 1, "warmup": 0}
    return {"preset": preset or "gpt-tiny", "steps": 10, "skip": 3, "reps": 4, "warmup": 1}


def _spec(cfg: dict, layout: dict) -> dict:
    # 4 micro-batches per rank and step for dp=1 layouts, 2 for dp=2: pipelines have micro-batches to overlap.
    return tiny_spec(cfg["preset"], train={"steps": cfg["steps"] + cfg["skip"], "global_batch": 8, "micro_batch": 2,
                                           "lr": 3e-3}, layout=layout)


def _arm_job(fn_job: dict, emit) -> None:
    """On each rank of the pool: run one arm (workbench's `train`, or a peer's `train_peer`)."""
    import importlib

    import torch.distributed as dist

    if fn_job["module"] == "workbench":
        from workbench.runtime.loop import train

        times, losses, cpu = [], [], []

        def sink(event):
            if event["event"] == "step":  # rank 0's only
                times.append(time.perf_counter())
                losses.append(event["loss"])

        def at_step_end() -> bool:  # polled once after each step on every rank
            cpu.append(time.process_time())
            return False

        train(fn_job["spec"], sink, should_stop=at_step_end)
        emit({"event": "peer", "rank": dist.get_rank(), "times": times, "cpu": cpu, "losses": losses,
              "workbench": True})
        return
    module = importlib.import_module(f"bench.{fn_job['module']}")
    module.train_peer({"spec": fn_job["spec"], **fn_job["options"]}, emit)


def _summarize(events: list[dict], workbench: bool) -> dict:
    """Rank 0's step ends; the run's per-step loss (workbench: rank 0's global mean; a peer: the
    mean over its dp ranks, or its last pipeline stage)."""
    recs = sorted((e for e in events if e["event"] == "peer"), key=lambda e: e["rank"])
    times = recs[0]["times"]
    if workbench:
        losses = next(e["losses"] for e in recs if e["losses"])
    else:
        with_loss = [e for e in recs if e["losses"] and e.get("last_stage", True)]
        by_dp = {e.get("dp_rank", 0): e["losses"] for e in with_loss}
        losses = [sum(v) / len(v) for v in zip(*by_dp.values())]
    return {"times": times, "cpu": [e["cpu"] for e in recs], "losses": losses}


def _jobs(name: str, cfg: dict) -> dict[str, dict]:
    layout, peer, options = PAIRS[name]
    arms = {"workbench": {"module": "workbench", "spec": _spec(cfg, layout)}}
    if peer == "workbench":
        arms["peer"] = {"module": "workbench", "spec": _spec(cfg, options["layout"])}
    else:
        arms["peer"] = {"module": peer, "spec": arms["workbench"]["spec"], "options": options}
    return arms


def _available(pairs: list[str]) -> list[str]:
    return [p for p in pairs if p in PAIRS]


def run(quick: bool = False, reps: int | None = None, only: list[str] | None = None, preset: str | None = None,
        pool=None, save_as: str | None = None) -> dict:
    """Measure every pair (or `only` those), alternating its two arms; return the result dict
    (also written after each pair as bench/results/<save_as>.json when `save_as` is given)."""
    from workbench.runtime.spawn import SpawnPool
    from workbench.spec import load_spec

    cfg = config(quick, preset)
    if reps:
        cfg["reps"] = reps
    names = _available(only or list(PAIRS))
    own = pool is None
    pool = pool or SpawnPool(2)
    out: dict[str, dict] = {}
    loads: list[float] = []
    try:
        for name in names:
            jobs = _jobs(name, cfg)
            seq = load_spec(jobs["workbench"]["spec"]).model.shape().seq_len
            tokens = jobs["workbench"]["spec"]["train"]["global_batch"] * seq
            runs: dict[str, list[dict]] = {"workbench": [], "peer": []}
            failures: list[str] = []
            for r in range(cfg["warmup"] + cfg["reps"]):
                for arm in ("workbench", "peer") if r % 2 == 0 else ("peer", "workbench"):
                    try:
                        events = pool.run(jobs[arm], fn=_arm_job, timeout_s=900)
                    except Exception as e:  # noqa: BLE001 - the pair reports why; the pool restarts
                        failures.append(f"{arm}: {str(e)[-600:]}")
                        pool = SpawnPool(2)
                        continue
                    if r >= cfg["warmup"]:
                        runs[arm].append(_summarize(events, jobs[arm]["module"] == "workbench"))
                loads.append(os.getloadavg()[0])
            out[name] = _pair_result(runs, tokens, cfg["skip"], failures)
            print(f"{name}: {_line(out[name])}", flush=True)
            if save_as:
                write_result(save_as, merged(read_result(save_as), _result(cfg, out, loads)))
    finally:
        if own:
            pool.close()
    return _result(cfg, out, loads)


def merged(previous: dict | None, result: dict) -> dict:
    """`result` with the pairs it did not run (`--only`) kept from `previous` (the file it replaces),
    with their labels and layouts, and the previous notes: the notes are written by hand, and say
    which pairs ran when."""
    if not previous:
        return result
    out = dict(result)
    for key in ("pairs", "peer_labels", "layouts"):
        out[key] = {**previous.get(key, {}), **result[key]}
    if previous.get("notes") and not result.get("notes"):
        out["notes"] = previous["notes"]
    return out


def _result(cfg: dict, out: dict, loads: list[float]) -> dict:
    return {"config": {**cfg, "global_batch": 8, "micro_batch": 2, "world": 2}, "pairs": out, "goal": GOAL,
            "sp_goal": SP_GOAL, "peer_labels": {n: PEER_LABEL[PAIRS[n][1]] for n in out},
            "layouts": {n: PAIRS[n][0] for n in out}, "load_avg_1m": stats(loads)}


def _pair_result(runs: dict[str, list[dict]], tokens: int, skip: int, failures: list[str]) -> dict:
    n = min(len(runs["workbench"]), len(runs["peer"]))
    if n == 0:
        return {"failed": failures}
    tps = {arm: [steady_tokens_per_s(x["times"], tokens, skip) for x in rs[:n]] for arm, rs in runs.items()}
    ratios = paired_ratios(tps["workbench"], tps["peer"])
    # The second view, robust to other processes' load: CPU seconds per steady step summed over the
    # ranks (a pipeline's stages may split the blocks differently; peer / workbench: > 1 when
    # workbench spends less CPU per step).
    cpu = {arm: [sum((c[-1] - c[skip]) / (len(c) - 1 - skip) for c in x["cpu"]) for x in rs[:n]]
           for arm, rs in runs.items()}
    cpu_ratios = paired_ratios(cpu["peer"], cpu["workbench"])
    a, b = runs["workbench"][0]["losses"], runs["peer"][0]["losses"]
    rel = max((abs(x - y) / abs(y) for x, y in zip(a, b)), default=float("nan"))
    return {"tokens_per_s": {arm: stats(v) for arm, v in tps.items()}, "ratios": ratios, "ratio": stats(ratios),
            "cpu_s_per_step": {arm: stats(v) for arm, v in cpu.items()}, "cpu_ratio": stats(cpu_ratios),
            "ratio_ci95": median_ci(ratios),  # one round: (ratio, ratio)
            "loss_rel_diff": rel, "losses": {"workbench": a, "peer": b}, "rounds": n, "failed": failures}


def _why(p: dict) -> str:
    """The last error line of a pair's failed runs ("?" when none names an error)."""
    why = [line for f in p.get("failed", []) for line in f.splitlines() if "Error" in line][-1:]
    return why[0].strip()[:160] if why else "?"


def _lost(p: dict) -> str:
    """"", or "; " and how many arm runs of a measured pair failed and why: its ratio rests on fewer rounds."""
    n = len(p.get("failed", []))
    return f"; {n} arm run{'s' * (n > 1)} failed ({_why(p)}), {p['rounds']} rounds measured" if n else ""


def _line(p: dict) -> str:
    if "ratio" not in p:
        return "failed: " + "; ".join(p["failed"])[-300:]
    lo, hi = p["ratio_ci95"]
    return (f"workbench/peer tokens/s {p['ratio']['median']:.3f} ({p['ratio']['min']:.3f}..{p['ratio']['max']:.3f}, "
            f"95% {lo:.3f}..{hi:.3f}), peer/workbench CPU per step {p['cpu_ratio']['median']:.3f}, "
            f"losses within {p['loss_rel_diff']:.1e}" + _lost(p))


def summary_rows(result: dict) -> list[list]:
    rows = []
    for name, p in result["pairs"].items():
        if "ratio" not in p:
            continue
        goal = f"<= 1/{SP_GOAL}" if name == "sp/tp" else f">= {GOAL}"
        rows.append(["k) peers", f"{name}: workbench / {result['peer_labels'][name]} tokens/s", p["ratio"]["median"],
                     f"{p['ratio']['min']:.3f}..{p['ratio']['max']:.3f}", goal])
    return rows


def section(r, doc, img) -> str:
    """docs/benchmarks.md's section for bench/results/peers.json (`r`: that dict, or None)."""
    out = ["## k) Peers: ZeRO, CPU offload, TP, SP and PP against the scripts a user would write",
           "Each pair runs the same model (same seed), batches, shapes and AdamW on the same 2 gloo ranks of one "
           "spawn pool, alternated A B, B A round by round: `workbench` is the per-rank runtime (`train`, what "
           "every backend runs); the peer is a plain script: `bench/peer_fsdp2.py` (DDP + ZeroRedundancyOptimizer "
           "for zero=1; FSDP2 `fully_shard` per block and the root for zero=2/3; `CPUOffloadPolicy` for offload), "
           "`bench/peer_tp.py` (`parallelize_module` with `ColwiseParallel` / `RowwiseParallel` / "
           "`SequenceParallel`), `bench/peer_pp.py` (`torch.distributed.pipelining` with `Schedule1F1B` / "
           "`ScheduleInterleaved1F1B`). Tokens/s between rank 0's step ends after the warm-up steps; ratio "
           "workbench / peer per round, then the median, its spread and 95% bootstrap interval; CPU/step is the "
           "ranks' process CPU seconds per steady step, summed over the ranks, peer / workbench (> 1: workbench "
           "spends less), the view that "
           "other processes' load disturbs least. `sp/tp` is "
           "workbench with sequence parallel against workbench without, same tp=2 (goal: SP within "
           f"{SP_GOAL}x of plain TP's step time, i.e. a ratio >= {1 / SP_GOAL:.2f})."]
    if not r:
        return "\n\n".join(out + ["_Not measured yet: run `python -m bench.bench_peers`._"])
    rows = []
    for name, p in r["pairs"].items():
        label = r["peer_labels"].get(name, "")
        if "ratio" not in p:
            rows.append([f"`{name}`", label, "failed: " + _why(p), "", "", "", "", "", ""])
            continue
        lo, hi = p["ratio_ci95"]
        goal = 1 / r.get("sp_goal", SP_GOAL) if name == "sp/tp" else r["goal"]
        met = "met" if p["ratio"]["median"] >= goal else "**not met**"
        rows.append([f"`{name}`", label, f"{p['tokens_per_s']['workbench']['median']:,.0f} / "
                     f"{p['tokens_per_s']['peer']['median']:,.0f}", f"**{p['ratio']['median']:.3f}**",
                     f"{p['ratio']['min']:.3f}..{p['ratio']['max']:.3f}", f"{lo:.3f}..{hi:.3f}",
                     f"{p['cpu_ratio']['median']:.3f}" if "cpu_ratio" in p else "-",
                     f"{p['loss_rel_diff']:.1e}", f"{met} (>= {goal:.2f})" + _lost(p)])
    head = ["pair", "peer", "tokens/s workbench / peer", "ratio", "spread", "95% interval",
            "CPU/step peer / workbench", "loss rel. diff", "goal"]
    out.append("| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n"
               + "\n".join("| " + " | ".join(str(c) for c in row) + " |" for row in rows))
    c, load = r["config"], r.get("load_avg_1m", {})
    out.append(f"{c['preset']}, 2 ranks, global batch {c['global_batch']}, micro-batch {c['micro_batch']}, "
               f"{c['steps']} measured steps after {c['skip']} warm-up, {c['reps']} rounds per pair; "
               f"1-minute load average {load.get('min', float('nan')):.1f}..{load.get('max', float('nan')):.1f} "
               "during the run.")
    if r.get("notes"):
        out.append(r["notes"])
    m = r.get("machine", {})
    out.append(f"_Measured {m.get('date_utc', '?')}, 1-minute load average {m.get('load_avg_1m', '?')} at its end._")
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="gpt-tiny, 3 steps, one round per pair")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--only", help="comma-separated pairs: " + ",".join(PAIRS))
    ap.add_argument("--preset")
    ap.add_argument("--name", default="peers", help="results file name (bench/results/NAME.json)")
    args = ap.parse_args(argv)
    only = args.only.split(",") if args.only else None
    unknown = [n for n in only or [] if n not in PAIRS]
    if unknown:
        ap.error(f"unknown pairs {unknown}; choose from {list(PAIRS)}")
    previous = read_result(args.name)  # before `run` rewrites it pair by pair
    result = run(args.quick, args.reps, only, args.preset, save_as=args.name)
    path = write_result(args.name, merged(previous, result))
    kept = sorted(set((previous or {}).get("pairs", {})) - set(result["pairs"]))
    if kept:
        print(f"kept {len(kept)} pairs of the previous {path.name} ({', '.join(kept)}) and its notes")
    rows = [[n, *(p["ratio"][k] for k in ("median", "min", "max")), p["loss_rel_diff"]]
            for n, p in result["pairs"].items() if "ratio" in p]
    print(table(rows, ["pair", "workbench/peer median", "min", "max", "loss rel diff"]))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
