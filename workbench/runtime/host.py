"""What a rank adds to its memory events about its host and its GPU: the process's resident memory
and, on a CUDA device with nvidia-ml-py installed, the GPU's utilisation and memory in use (NVML)."""
from __future__ import annotations

import functools
import os


def host_figures(device) -> dict:
    """``{"host": {"rss_bytes": B}}`` and, on a CUDA device NVML can see, ``{"gpu": {"util_percent":
    %, "memory_used_bytes": B, "memory_total_bytes": B}}``; whatever cannot be read is left out (never raises)."""
    out: dict = {}
    rss = _rss_bytes()
    if rss is not None:
        out["host"] = {"rss_bytes": rss}
    if getattr(device, "type", None) == "cuda":
        gpu = _gpu(device.index if device.index is not None else 0)
        if gpu:
            out["gpu"] = gpu
    return out


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _gpu(index: int) -> dict:
    handle = _nvml_handle(index, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if handle is None:
        return {}
    import pynvml

    try:
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    except pynvml.NVMLError:
        return {}
    return {"util_percent": float(util.gpu), "memory_used_bytes": int(mem.used), "memory_total_bytes": int(mem.total)}


@functools.cache
def _nvml_handle(index: int, visible: str | None):
    """NVML's handle of torch's cuda:`index` (NVML counts every GPU; CUDA_VISIBLE_DEVICES, which Ray
    sets, maps torch's index to a physical index or a UUID); None without nvidia-ml-py or NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        names = [v.strip() for v in (visible or "").split(",") if v.strip()]
        name = names[index] if index < len(names) else str(index)
        if name.isdigit():
            return pynvml.nvmlDeviceGetHandleByIndex(int(name))
        return pynvml.nvmlDeviceGetHandleByUUID(name)
    except Exception:  # noqa: BLE001 - no nvidia-ml-py, no driver, a MIG id: the events go without GPU figures
        return None
