"""Re-price a saved GPU result (bench/results/gpu.json) with today's memory and step-time models.

A GPU is lent rarely; the models change more often. The measurements stay as they were; every
prediction beside them (`estimate_memory`, the step-time model from the catalog's figures and from
the calibrate arm's saved profile) is computed again for exactly the spec each arm ran, and the GPU
section of docs/benchmarks.md is regenerated. No GPU or torch device is needed:
    python -m bench.gpu.repredict [bench/results/gpu.json]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runnable as a file from anywhere

RESULT = Path(__file__).resolve().parents[1] / "results" / "gpu.json"


def repredict(result: dict) -> dict:
    """`result` (run_all's JSON) with every arm's predictions recomputed; measurements untouched."""
    from bench.gpu import arms as A
    from bench.gpu.train_1b import flops_per_token
    from workbench.catalog import get_device
    from workbench.hwprofile import profile_from_dict

    c = result["config"]
    base = A.base_spec(c["preset"], c["seq_len"], c["dtype"], c["steps"], c["global_batch"], c["micro_batch"],
                       c["catalog_gpu"])
    cal = result["arms"].get("calibrate", {})
    profile = profile_from_dict(cal["profile"], "calibrate arm") if cal.get("status") == "ok" else None
    for name, a in result["arms"].items():
        if a["status"] != "ok" or "step_time_s" not in a:
            continue
        spec = A.arm_spec(name, a["world"], base)
        pred, mem = A.predict(spec), A.predicted_memory(spec)
        st = a["step_time_s"]
        st.update(A.predicted_steps(spec, st["measured"], profile))
        if "variants" in a:  # the single arm
            peak = a["peak_flops"]
            a["predicted"] = {**pred, "mfu": pred["tokens_per_s"] * a["flops_per_token"] / peak if peak else None}
            a["predicted_peak_gib"] = mem["per_rank"][0] / 2**30
            a["predicted_device_used_gib"] = mem["device_used"] / 2**30
            continue
        fpt = flops_per_token(A.shape_of(spec))
        peak = None if c["catalog_gpu"] == "cpu" else get_device(c["catalog_gpu"]).compute_flops[c["dtype"]]
        a["predicted"] = {**pred, "mfu": pred["tokens_per_s"] * fpt / (a["world"] * peak) if peak else None}
        for m in a["memory"]:
            m["predicted"], m["predicted_device_used"] = mem["per_rank"][m["rank"]], mem["device_used"]
            m["measured_over_predicted"] = m["allocated_peak"] / m["predicted"]
    return result


def main(argv: list[str] | None = None) -> None:
    from bench.report import write_report

    path = Path((argv if argv is not None else sys.argv[1:])[0]) if (argv or sys.argv[1:]) else RESULT
    result = repredict(json.loads(path.read_text()))
    path.write_text(json.dumps(result, indent=2, default=float) + "\n")
    print(f"wrote {path}\nwrote {write_report()}")


if __name__ == "__main__":
    main()
