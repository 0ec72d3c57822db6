"""A plain single-process PyTorch training loop: the peer of the runtime in one process.

Same model (`workbench.build_model`), same batches (`TokenSource`), same optimizer as the spec;
nothing else: no hooks, no metrics, no sinks. Optional autocast for bf16 on a GPU.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F

from workbench.data import build_token_source
from workbench.parallel.materialize import build_model
from workbench.spec import load_spec


def train_plain(spec, device: str = "cpu", autocast_dtype: torch.dtype | None = None, on_step=None) -> dict:
    """Train `spec` (dp=1) with a textbook loop.

    Args:
        spec: spec dict or JobSpec; uses model, data and train.
        device: "cpu" or "cuda".
        autocast_dtype: e.g. torch.bfloat16 to run forward/backward under autocast (weights and
            optimizer stay fp32, as with the runtime's bf16 policy).
        on_step: called after each step (a profiler's `step`).
    Returns:
        {"times": wall-clock step ends, "cpu_times": this process's CPU time at step ends,
         "losses": per-step mean loss, "peak_bytes": CUDA peak or 0}.
    """
    spec = load_spec(spec)
    t = spec.train
    torch.manual_seed(t.seed)
    model = build_model(spec).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    source = build_token_source(spec)
    num_micro = t.global_batch // t.micro_batch
    amp = (lambda: torch.autocast(torch.device(device).type, dtype=autocast_dtype)) if autocast_dtype \
        else contextlib.nullcontext
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times, cpu_times, losses = [], [], []
    for step in range(1, t.steps + 1):
        batch = source.global_batch(step, t.global_batch).to(device)
        total = torch.zeros((), device=device)
        for mb in batch.split(t.micro_batch):
            with amp():
                logits = model(mb[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), mb[:, 1:].flatten()) / num_micro
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        losses.append(total.item())  # syncs the device: the step is done
        times.append(time.time())
        cpu_times.append(time.process_time())
        if on_step is not None:
            on_step()
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
    return {"times": times, "cpu_times": cpu_times, "losses": losses, "peak_bytes": int(peak)}
