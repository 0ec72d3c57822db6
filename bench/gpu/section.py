"""docs/benchmarks.md's GPU section, rendered from bench/results/gpu.json (bench/gpu/run_all.py).

bench/report.py's `sec_gpu` calls `section`; nothing here reads files or imports torch.
"""
from __future__ import annotations

TITLE = "## GPU: ~1.3B models in bf16: one GPU, ZeRO-3 and TP, memory and step time predicted (catalog, calibrated) vs measured"

ABOUT = (
    "`python -m bench.gpu.run_all --budget-s 540` runs every arm in spawned ranks (never Ray), one device "
    "per rank, and skips an arm that would not fit in what is left of the budget (it says so): **single**, "
    "`gpt-1.3b` in bf16 on one GPU, the per-rank runtime (`workbench.runtime.loop.train`: bf16 weights, "
    "fp32 master) against a plain PyTorch loop (autocast bf16, fp32 weights, AdamW), alternated "
    "(bench/gpu/train_1b.py); **zero3**, dp = every GPU with ZeRO-3 (FSDP2) over nccl, each rank the "
    "single arm's batch; **tp**, tp = every GPU over nccl, the single arm's batch; **calibrate**, `workbench "
    "calibrate` on every GPU (its profile: bench/results/gpu-profile.yaml); **ckpt**, the single arm with "
    "full activation checkpointing; **llama**, llama3.2-1b at the same sequence length on one GPU. MFU "
    "counts 6 N + 12 L h s FLOPs per token against the catalog's dense bf16 peak per GPU. Predictions: "
    "`estimate_memory` (each rank's allocated peak, `torch.cuda.max_memory_allocated`'s convention) and "
    "the step-time model (`workbench.steptime`) for exactly the spec the arm ran, twice: from the "
    "catalog's figures for the GPU (what `plan` says before anyone measured), and from the calibrate "
    "arm's profile. Reserved: the caching allocator's reserve after the run; device use: NVML's, which adds "
    "the CUDA context and NCCL's buffers.")

PENDING = (
    "**GPU figures are pending**: no GPU has been lent yet (on a lent machine: `bash bench/gpu/device_run.sh`, "
    "which says how to prepare it). The same code runs on CPU in a smoke mode "
    "(`python -m bench.gpu.run_all --device cpu --preset gpt-tiny`, gloo, 2 ranks), tested by "
    "tests/unit/test_bench_gpu.py so that it cannot rot; tests/gpu/test_bench_gpu_cuda.py runs it on CUDA.")


def _gib(b) -> str:
    """GiB with two decimals; MiB below 0.1 GiB (the CPU smoke run's tiny model)."""
    if b is None or b != b:
        return "-"
    return f"{b / 2**30:.2f}" if b >= 0.1 * 2**30 else f"{b / 2**20:.1f} MiB"


def _pct(x) -> str:
    return "-" if x is None or x != x else f"{x:.1%}"


def _table(rows: list[list], head: list[str]) -> str:
    return ("| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n"
            + "\n".join("| " + " | ".join(str(c) for c in row) + " |" for row in rows))


def _layout(lay: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in lay.items())


def _measured(arms: dict) -> dict:
    """The arms that trained and were measured (not the calibrate arm, not a skipped or failed one)."""
    return {n: a for n, a in arms.items() if a["status"] == "ok" and "step_time_s" in a}


def _calibrated(st: dict) -> list[str]:
    if "predicted_calibrated" not in st:
        return ["-", "-"]
    return [f"{st['predicted_calibrated']:.3f}", f"{st['measured_over_calibrated']:.2f}"]


def _speed_rows(arms: dict) -> list[list]:
    rows = []
    for name, a in _measured(arms).items():
        st, pred = a["step_time_s"], a["predicted"]
        if "variants" in a:  # the single arm: runtime, and the plain loop beside it
            v = a["variants"]
            rows.append([f"`{name}` runtime", 1, _layout(a["layout"]), f"{v['runtime']['tokens_per_s']['median']:,.0f}",
                         _pct(v["runtime"]["mfu"]["median"]), _pct(pred.get("mfu")), f"{st['measured']:.3f}",
                         f"{st['predicted']:.3f}", f"{st['measured_over_predicted']:.2f}", *_calibrated(st), "-"])
            rows.append([f"`{name}` plain loop", 1, "", f"{v['plain']['tokens_per_s']['median']:,.0f}",
                         _pct(v["plain"]["mfu"]["median"]), "", "", "", "", "", "", ""])
            continue
        rows.append([f"`{name}`", a["world"], _layout(a["layout"]), f"{a['tokens_per_s']:,.0f}", _pct(a["mfu"]),
                     _pct(pred.get("mfu")), f"{st['measured']:.3f}", f"{st['predicted']:.3f}",
                     f"{st['measured_over_predicted']:.2f}", *_calibrated(st), f"{a['cpu_s_per_step_rank0']:.3f}"])
    return rows


def _memory_rows(arms: dict) -> list[list]:
    rows = []
    for name, a in _measured(arms).items():
        if "variants" in a:
            v, pred = a["variants"]["runtime"], a.get("predicted_peak_gib")
            ratio = f"{v['peak_gib'] / pred:.2f}" if pred else "-"
            res, used = v.get("reserved_gib"), a.get("predicted_device_used_gib")
            rows.append([f"`{name}` runtime", 0, _gib(v["peak_gib"] * 2**30), _gib(pred and pred * 2**30), ratio,
                         _gib(res and res * 2**30), "-", _gib(used and used * 2**30)])
            continue
        for m in a["memory"]:
            ratio = m["measured_over_predicted"]
            rows.append([f"`{name}`", m["rank"], _gib(m["allocated_peak"]), _gib(m["predicted"]),
                         "-" if ratio is None else f"{ratio:.2f}", _gib(m["reserved"]), _gib(m["device_used"]),
                         _gib(m["predicted_device_used"])])
    return rows


def _why(a: dict) -> str:
    """A skipped arm's reason, or the last line of a failed arm's error."""
    if a.get("reason"):
        return a["reason"]
    lines = (a.get("error") or "").strip().splitlines()
    return lines[-1][:200] if lines else "?"


def section(r: dict | None) -> str:
    """The markdown section for run_all's result (`r`), or the pending note when there is none."""
    out = [TITLE, ABOUT]
    if not r:
        return "\n\n".join(out + [PENDING])
    c, m = r["config"], r.get("machine", {})
    if c.get("device") == "cpu":
        out.append("**A CPU smoke run (gloo), not GPU figures**: MFU is not defined on the CPU; the "
                   "step-time model's CPU figures are nominal.")
    out.append(f"{m.get('gpu', '?')} x {m.get('device_count', '?')} visible, {m.get('date_utc', '?')}, torch "
               f"{m.get('torch', '?')}; `{c['preset']}`, {c['dtype']}, {c['steps']} steps of which the first "
               f"{c['warmup']} are warm-up, global batch {c['global_batch']} per data-parallel rank, micro-batch "
               f"{c['micro_batch']}; the whole run {r.get('used_s', float('nan')):.0f} s of a {c['budget_s']:.0f} s budget.")
    out.extend(r.get("notes", []))
    arms = r["arms"]
    speed = _speed_rows(arms)
    if speed:
        out.append(_table(speed, ["arm", "GPUs", "layout", "tokens/s", "MFU", "MFU predicted", "step s",
                                  "step s predicted", "measured / predicted", "step s calibrated",
                                  "measured / calibrated", "rank 0 CPU s/step"]))
    single = arms.get("single", {})
    if single.get("status") == "ok":
        out.append(f"Runtime / plain loop tokens/s: {single['ratio']['median']:.3f} "
                   f"({single['ratio']['min']:.3f}..{single['ratio']['max']:.3f}, {single['ratio']['n']} rounds).")
    mem = _memory_rows(arms)
    if mem:
        out.append(_table(mem, ["arm", "rank", "allocated peak GiB", "predicted GiB", "measured / predicted",
                                "reserved GiB", "device use GiB (NVML)", "predicted device use GiB"]))
    cal = arms.get("calibrate", {})
    if cal.get("status") == "ok":
        out.append(f"The calibrate arm's {cal['mode']} profile ({cal['wall_s']:.0f} s; `workbench calibrate`'s "
                   f"table):\n\n```\n{cal['summary']}\n```")
    notes = [f"- `{n}` {a['status']}: {_why(a)}" for n, a in arms.items() if a["status"] != "ok"]
    if notes:
        out.append("\n".join(notes))
    return "\n\n".join(out)
