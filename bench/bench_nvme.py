"""ZeRO-Infinity (offload=nvme at zero 3) against zero 3 with CPU offload and without offload, and
our file I/O against dd on the same folder (issue 37).

a) Step time: the same model and dp=2 zero=3 layout with offload none / cpu / nvme, run side by
   side on one pool of 2 gloo ranks, alternating (A B C, C B A, ...); median step time over the
   steps after the first, and each round's ratio nvme/none and nvme/cpu.
b) File throughput on the folder the nvme runs use: our write path (writes through the shared
   mapping + msync, what the step does to the shards) and read path (pages dropped, then read
   ahead with posix_fadvise(WILLNEED) and touched: what the prefetch window does), and the moments'
   path (os.pwrite + fdatasync, os.preadv after dropping the pages), each against dd (write:
   conv=fdatasync; read: after dropping the file's pages), alternating.
DeepSpeed ZeRO-Infinity is not run: see DEEPSPEED_REASON (it is checked on every run).
Run: python -m bench.bench_nvme [--quick]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import interleave, paired_ratios, stats, table, tiny_spec, write_result  # noqa: E402

LAYOUTS = {"none": {}, "cpu": {"offload": "cpu"}, "nvme": {"offload": "nvme"}}


def _deepspeed_reason() -> str | None:
    """Why DeepSpeed's ZeRO-Infinity cannot run here (None if its aio op could build)."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception as e:  # noqa: BLE001 - any import failure is the reason
        return f"deepspeed does not import: {type(e).__name__}: {e}"
    if not AsyncIOBuilder().is_compatible(verbose=False):
        return ("DeepSpeed's NVMe offload (offload_param/offload_optimizer device=nvme) needs its async_io op, "
                "which builds against libaio; libaio-dev (headers + .so) is not installed on this machine, so "
                "AsyncIOBuilder().is_compatible() is False and deepspeed.initialize refuses an nvme config")
    return None


def _step_times(pool, spec: dict) -> float:
    events = pool.run(spec, timeout_s=600)
    steps = sorted((e for e in events if e["event"] == "step"), key=lambda e: e["step"])
    times = [e["step_time_s"] for e in steps[1:]]
    return stats(times)["median"]


def _drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _dd(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(["dd", *args], check=True, capture_output=True)
    return time.perf_counter() - start


def throughput(folder: str, mib: int, reps: int) -> dict:
    """Bytes/s of our mapped-file and pread/pwrite paths against dd, on `folder`, alternating."""
    import torch

    from workbench.parallel.offload import MappedFile, _bytes_view

    nbytes = mib * 2**20
    mapped = MappedFile(os.path.join(folder, "mapped.f32"), nbytes)
    moments = os.path.join(folder, "moments.f32")
    dd_file = os.path.join(folder, "dd.bin")
    buf = torch.rand(nbytes // 4)
    fd = os.open(moments, os.O_RDWR | os.O_CREAT, 0o600)

    def mapped_write() -> float:
        t = time.perf_counter()
        mapped.flat.copy_(buf)
        mapped.flush()
        return nbytes / (time.perf_counter() - t)

    def mapped_read() -> float:
        mapped.evict(0, mapped.nbytes)
        t = time.perf_counter()
        mapped.prefetch(0, mapped.nbytes)
        float(mapped.flat.sum())  # every page touched
        return nbytes / (time.perf_counter() - t)

    def pwrite() -> float:
        view, done = _bytes_view(buf), 0
        t = time.perf_counter()
        while done < nbytes:
            done += os.pwrite(fd, view[done:], done)
        os.fdatasync(fd)
        return nbytes / (time.perf_counter() - t)

    def pread() -> float:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t = time.perf_counter()
        got = os.preadv(fd, [_bytes_view(buf)], 0)
        assert got == nbytes
        return nbytes / (time.perf_counter() - t)

    def dd_write() -> float:
        return nbytes / _dd(["if=/dev/zero", f"of={dd_file}", "bs=1M", f"count={mib}", "conv=fdatasync"])

    def dd_read() -> float:
        _drop(dd_file)
        return nbytes / _dd([f"if={dd_file}", "of=/dev/null", "bs=1M"])

    try:
        writes = interleave({"mapped": mapped_write, "pwrite": pwrite, "dd": dd_write}, reps=reps)
        reads = interleave({"mapped": mapped_read, "pread": pread, "dd": dd_read}, reps=reps)
    finally:
        os.close(fd)
    return {"mib": mib,
            "write": {k: stats(v) for k, v in writes.items()}, "read": {k: stats(v) for k, v in reads.items()},
            "write_ratio_mapped_dd": stats(paired_ratios(writes["mapped"], writes["dd"])),
            "write_ratio_pwrite_dd": stats(paired_ratios(writes["pwrite"], writes["dd"])),
            "read_ratio_mapped_dd": stats(paired_ratios(reads["mapped"], reads["dd"])),
            "read_ratio_pread_dd": stats(paired_ratios(reads["pread"], reads["dd"]))}


def run(quick: bool = False) -> dict:
    from workbench.runtime.spawn import SpawnPool

    preset, steps, reps = ("gpt-tiny", 4, 2) if quick else ("gpt-mini", 5, 3)
    folder = tempfile.mkdtemp(prefix="bench-nvme-", dir=os.environ.get("WORKBENCH_NVME_DIR", "/tmp"))
    load_before = os.getloadavg()[0]
    pool = SpawnPool(2)
    try:
        def job(name):
            spec = tiny_spec(preset, train={"steps": steps, "global_batch": 8, "micro_batch": 2},
                             layout={"dp": 2, "zero": 3, "nvme_path": folder, **LAYOUTS[name]},
                             resources={"gpu": "cpu", "gpus_per_node": 2})
            return lambda: _step_times(pool, spec)

        times = interleave({name: job(name) for name in LAYOUTS}, reps=reps)
    finally:
        pool.close()
    io = throughput(folder, 64 if quick else 256, reps)
    shutil.rmtree(folder, ignore_errors=True)
    return {"model": preset, "layout": "dp2 zero3", "steps": steps, "rounds": reps, "folder": folder,
            "step_s": {k: stats(v) for k, v in times.items()},
            "ratio_nvme_none": stats(paired_ratios(times["nvme"], times["none"])),
            "ratio_nvme_cpu": stats(paired_ratios(times["nvme"], times["cpu"])),
            "io": io, "deepspeed": _deepspeed_reason() or "runs (not measured here)",
            "load_average": [load_before, os.getloadavg()[0]]}


def section(r: dict, doc: str = "", img: str = "") -> str:
    """Markdown for docs/benchmarks.md (the integrator wires it into bench/report.py)."""
    if not r:
        return "## l) ZeRO-Infinity (offload=nvme)\n\nnot run\n"
    s, io = r["step_s"], r["io"]
    rows = [[k, f"{v['median']:.3f}", f"{v['min']:.3f}..{v['max']:.3f}"] for k, v in s.items()]
    lines = [f"## l) ZeRO-Infinity (offload=nvme): {r['model']} {r['layout']}, {r['rounds']} alternating rounds",
             "", "```", table(rows, ["offload", "step s (median)", "range"]), "```", "",
             f"nvme / none: {r['ratio_nvme_none']['median']:.2f}x; nvme / cpu: {r['ratio_nvme_cpu']['median']:.2f}x "
             f"(paired per round; load average {r['load_average'][0]:.1f} -> {r['load_average'][1]:.1f}).", "",
             f"File throughput on the same folder ({io['mib']} MiB, MB/s, median):", ""]
    io_rows = [[f"{kind} {k}", f"{v['median'] / 1e6:.0f}"] for kind in ("write", "read") for k, v in io[kind].items()]
    lines += ["```", table(io_rows, ["path", "MB/s"]), "```", "",
              f"ours / dd: mapped write {io['write_ratio_mapped_dd']['median']:.2f}, pwrite "
              f"{io['write_ratio_pwrite_dd']['median']:.2f}, mapped read {io['read_ratio_mapped_dd']['median']:.2f}, "
              f"pread {io['read_ratio_pread_dd']['median']:.2f}.", "", f"DeepSpeed ZeRO-Infinity: {r['deepspeed']}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    result = run(args.quick)
    path = write_result("nvme", result)
    print(section(result))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
