"""A run's start-up, launch to the end of step 1, from its `startup` event (the local backend
sends one per run, backends/local_ray.py): which parts are Ray's, which torch's and which ours.

The driver's phases follow one another on its monotonic clock and add up to the whole; each rank
reports durations on its own clock (no clock is compared across processes), among them the rank
process's start and imports, which run while the driver waits for the relays and for rank 0's store.
Pure: an event in, rows or text out.
"""
from __future__ import annotations

# (key, where, who, what): who is "Ray", "torch" or "ours"
DRIVER_PHASES = [
    ("checks_s", "driver", "ours", "spec loaded and checked, checkpoint lease"),
    ("ray_s", "driver", "Ray", "Ray init / attach"),
    ("job_s", "driver", "ours", "job object"),
    ("placement_s", "driver", "Ray", "placement group"),
    ("relays_s", "driver", "Ray", "relay actors started (kept ones: checked)"),
    ("store_s", "driver", "ours", "rank 0's process ready, TCPStore served"),
    ("ranks_s", "driver", "ours", "job sent to step 1 delivered"),
]
RANK_PHASES = [
    ("python_start_s", "rank", "ours", "rank process start (Python, rank entry)"),
    ("import_torch_s", "rank", "torch", "import torch"),
    ("import_workbench_s", "rank", "ours", "import workbench runtime"),
    ("import_dynamo_s", "rank", "torch", "import torch._dynamo (meta-device init)"),
    ("job_waited_s", "rank", "ours", "job waited for the imports"),
    ("spec_s", "rank", "ours", "spec on the rank"),
    ("process_group_s", "rank", "torch", "process group (TCPStore rendezvous), mesh"),
    ("model_s", "rank", "ours", "model build + parallelize"),
    ("data_s", "rank", "ours", "data open"),
    ("checkpoint_s", "rank", "ours", "checkpointer"),
    ("first_step_s", "rank", "ours", "step 1 compute"),
]
OVERLAPPED = {"python_start_s", "import_torch_s", "import_workbench_s", "import_dynamo_s"}


def startup_rows(event: dict, rank: str = "0") -> list[list]:
    """[phase, who, seconds] for the driver's phases, then rank `rank`'s (those marked "(overlapped)"
    ran while the driver waited for the relays and the store; "(before launch)": in a rank process
    kept from the driver's previous job), then launch to step 1."""
    rows = [[f"driver: {what}", who, event["driver"][key]] for key, _, who, what in DRIVER_PHASES
            if key in event["driver"]]
    phases = event["ranks"].get(rank, {})
    early = " (before launch)" if event.get("reused") else " (overlapped)"
    for key, _, who, what in RANK_PHASES:
        if key in phases:
            rows.append([f"  rank {rank}: {what}{early if key in OVERLAPPED else ''}", who, phases[key]])
    rows.append(["launch to end of step 1", "", event["launch_to_step_1_s"]])
    return rows


def by_owner(event: dict, rank: str = "0") -> dict[str, float]:
    """Seconds of launch to step 1 by owner: the driver's Ray phases are Ray's; the driver's wait for
    rank 0's imports (`store_s`, and any wait of the job for them) is split as the imports are
    (torch and torch._dynamo: torch's; the process start and the runtime: ours); the rank's process
    group is torch's; the rest is ours."""
    driver, phases = event["driver"], event["ranks"].get(rank, {})
    ray = sum(driver.get(k, 0.0) for k, _, who, _ in DRIVER_PHASES if who == "Ray")
    total = event["launch_to_step_1_s"] or sum(driver.values())
    waited = driver.get("store_s", 0.0) + phases.get("job_waited_s", 0.0)
    imports = sum(phases.get(k, 0.0) for k in OVERLAPPED)
    torch_imports = phases.get("import_torch_s", 0.0) + phases.get("import_dynamo_s", 0.0)
    torch_part = waited * torch_imports / imports if imports else 0.0
    torch_part += phases.get("process_group_s", 0.0)
    return {"Ray": ray, "torch": torch_part, "ours": max(0.0, total - ray - torch_part)}


def format_startup(event: dict, rank: str = "0") -> str:
    """The start-up as a text table, then its split by owner."""
    rows = [[name, who, f"{seconds:.2f}"] for name, who, seconds in startup_rows(event, rank)]
    widths = [max(len(str(r[i])) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}} s" for r in rows]
    split = by_owner(event, rank)
    lines.append("critical path: " + ", ".join(f"{k} {v:.2f} s" for k, v in split.items())
                 + (" (relays and rank processes kept from the previous run)" if event.get("reused") else ""))
    return "\n".join(lines)
