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
c) The demonstration (issue 37, item 5): a model whose states do not fit in the memory given to
   the job trains with nvme and is killed without it. Each arm (dp2 zero3: none, cpu, nvme) runs on
   fresh ranks inside a memory cgroup (v1: memory.limit_in_bytes; `ulimit -v` would count the
   mappings), first without a limit, measuring its peak (the ranks' summed RSS, sampled, and the
   cgroup's max_usage_in_bytes), then under one cap chosen between the nvme arm's peak RSS and the
   others' peak anonymous RSS (what no reclaim can free without swap), when such a cap exists.
DeepSpeed ZeRO-Infinity is not run: see DEEPSPEED_REASON (it is checked on every run).
Run: python -m bench.bench_nvme [--quick]   (the demonstration needs root and cgroup v1's memory controller)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import interleave, paired_ratios, stats, table, tiny_spec, write_result  # noqa: E402

LAYOUTS = {"none": {}, "cpu": {"offload": "cpu"}, "nvme": {"offload": "nvme"}}


def _deepspeed_reason(build: bool = True) -> str | None:
    """Why DeepSpeed's ZeRO-Infinity cannot run here (None when its async_io op builds and loads).

    The op is the one DeepSpeed's accelerator picks (CPU here: deepspeed/ops/op_builder/cpu), built
    by JIT on first use and cached in TORCH_EXTENSIONS_DIR: 12 C++ files at -O0 against torch's
    headers, about 20 minutes on this 2-core host under load. `build=False` checks libaio only."""
    try:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        builder = accelerator.create_op_builder("AsyncIOBuilder")
    except Exception as e:  # noqa: BLE001 - any import failure is the reason
        return f"deepspeed does not import: {type(e).__name__}: {e}"
    if builder is None:
        return f"DeepSpeed's {accelerator.device_name()} accelerator has no AsyncIOBuilder (the async_io op)"
    if not builder.is_compatible(verbose=False):
        return ("DeepSpeed's NVMe offload (offload_param/offload_optimizer device=nvme) needs its async_io op, "
                "which builds against libaio; libaio-dev (headers + .so) is not installed on this machine "
                "(apt-get install libaio-dev), so AsyncIOBuilder().is_compatible() is False and "
                "deepspeed.initialize refuses an nvme config")
    if not build:
        return "libaio is present; DeepSpeed's async_io op was not built in this (quick) run"
    try:
        builder.load(verbose=False)
    except Exception as e:  # noqa: BLE001 - the build's own error is the reason
        return f"DeepSpeed's async_io op does not build or load here: {type(e).__name__}: {str(e)[-400:]}"
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


# --------------------------------------------------------------------------------------------
# c) The demonstration: the same job under a memory cap, with and without nvme.

CGROUP_V1 = "/sys/fs/cgroup/memory"
DEMO_ARMS = {"none": {}, "cpu": {"offload": "cpu"}, "nvme": {"offload": "nvme"}}
# Model states dominate, compute stays small: 1 sequence of 16 tokens per rank and step. Full:
# 8 x 1024, vocab 32k (134M parameters, 16 bytes each with AdamW: 1.07 GB per rank at dp2 without
# offload); quick: 4 x 768 (53M).
DEMO_MODELS = {False: {"family": "gpt", "layers": 8, "hidden": 1024, "heads": 16, "vocab": 32768, "seq_len": 16},
               True: {"family": "gpt", "layers": 4, "hidden": 768, "heads": 12, "vocab": 32768, "seq_len": 16}}
CAP_MARGIN = 1.2  # the others' need over the nvme arm's peak must exceed this for a cap between them


def _cgroup_reason() -> str | None:
    """Why the demonstration cannot cap memory here (None when it can)."""
    if not os.path.isfile(os.path.join(CGROUP_V1, "memory.limit_in_bytes")):
        return (f"cgroup v1's memory controller is not mounted at {CGROUP_V1} (cgroup v2's memory.max is not "
                "supported by this benchmark)")
    if not os.access(CGROUP_V1, os.W_OK):
        return f"{CGROUP_V1} is not writable (run as root to make a memory cgroup)"
    return None


class MemoryCgroup:
    """A cgroup v1 memory cgroup for one arm's ranks, with an optional limit (bytes)."""

    def __init__(self, name: str, limit_bytes: int | None):
        self.path = os.path.join(CGROUP_V1, name)
        os.makedirs(self.path, exist_ok=True)
        if limit_bytes is not None:
            self._write("memory.limit_in_bytes", str(limit_bytes))

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def _read(self, name: str) -> str:
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def add(self, pid: int) -> None:
        self._write("cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        return [int(x) for x in self._read("cgroup.procs").split()]

    def peak_bytes(self) -> int:
        return int(self._read("memory.max_usage_in_bytes"))

    def failcnt(self) -> int:
        """How often the usage hit the limit (each time the kernel reclaimed, or failed to)."""
        return int(self._read("memory.failcnt"))

    def oom_kills(self) -> int:
        for line in self._read("memory.oom_control").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def remove(self) -> None:
        for _ in range(50):  # the killed processes leave the cgroup once reaped
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)


def _rss(pid: int) -> tuple[int, int]:
    """(VmRSS, RssAnon) of a process, in bytes ((0, 0) once it is gone)."""
    out = {"VmRSS:": 0, "RssAnon:": 0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(None, 1)[0]
                if key in out:
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out["VmRSS:"], out["RssAnon:"]


class PeakSampler:
    """Samples the summed RSS (and anonymous RSS) of a cgroup's processes every `every_s` seconds."""

    def __init__(self, cgroup: MemoryCgroup, every_s: float = 0.1):
        self.cgroup, self.every_s = cgroup, every_s
        self.peak_rss = self.peak_anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                pids = self.cgroup.pids()
            except OSError:
                pids = []
            rss = [_rss(p) for p in pids]
            self.peak_rss = max(self.peak_rss, sum(r for r, _ in rss))
            self.peak_anon = max(self.peak_anon, sum(a for _, a in rss))
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _demo_rank(job: dict, sink) -> None:
    """One rank of a demonstration arm: `train`, with rank 0 appending each step to job["progress"]
    (a killed job's events never reach the pool; the file keeps the steps it did)."""
    import torch.distributed as dist

    from workbench.runtime.loop import train

    first = dist.get_rank() == 0

    def progress(event: dict) -> None:
        sink(event)
        if first and event["event"] == "step":
            with open(job["progress"], "a") as f:
                f.write(json.dumps({"step": event["step"], "loss": event["loss"]}) + "\n")

    train(job["spec"], progress)


def demo_arm(name: str, spec: dict, cap_bytes: int | None, timeout_s: float, fn=_demo_rank) -> dict:
    """One arm (`fn`: workbench's `train`, or DeepSpeed's) on 2 fresh ranks in a cgroup of their own
    (limited to `cap_bytes`, or not)."""
    from workbench.errors import WorkerError
    from workbench.runtime.spawn import SpawnPool

    cgroup = MemoryCgroup(f"workbench-bench-nvme-{name}-{os.getpid()}", cap_bytes)
    fd, progress = tempfile.mkstemp(prefix=f"bench-nvme-{name}-", suffix=".jsonl")
    os.close(fd)
    pool = SpawnPool(2)
    try:
        for pid in pool.pids:  # before they import torch: (nearly) all their memory is charged here
            cgroup.add(pid)
        sampler = PeakSampler(cgroup)
        start = time.perf_counter()
        try:
            job = {"spec": spec, "progress": progress, "folder": spec["layout"]["nvme_path"]}
            events = pool.run(job, fn=fn, timeout_s=timeout_s)
            outcome = "completed" if any(e["event"] == "end" and e.get("status") == "completed"
                                         for e in events) else "ended without completing"
        except WorkerError as e:
            detail = str(e).splitlines()[0]
            oom = cgroup.oom_kills()
            signal = re.search(r"(rank \d+) \(pid \d+\) was killed by (\w+)", detail)
            if oom and signal:
                outcome = f"OOM-killed ({signal[1]}, {signal[2]})"
            else:
                outcome = ("OOM-killed" if oom else "failed") + f": {detail[:120]}"
        wall = time.perf_counter() - start
        sampler.stop()
        with open(progress) as f:
            steps = sum(1 for _ in f)
        return {"arm": name, "cap_bytes": cap_bytes, "outcome": outcome, "steps_done": steps,
                "steps": spec["train"]["steps"], "peak_rss_bytes": sampler.peak_rss,
                "peak_anon_bytes": sampler.peak_anon, "cgroup_peak_bytes": cgroup.peak_bytes(),
                "limit_hits": cgroup.failcnt(), "wall_s": wall}
    finally:
        pool.close()
        cgroup.remove()
        if os.path.exists(progress):
            os.unlink(progress)


def demonstrate(quick: bool, folder: str) -> dict:
    """Every arm uncapped (its peak), then every arm under one cap between nvme's need and the others'."""
    reason = _cgroup_reason()
    if reason:
        return {"not_run": reason}
    arms = ["none", "nvme"] if quick else list(DEMO_ARMS)
    steps = 1 if quick else 2
    spec = tiny_spec(train={"steps": steps, "global_batch": 2, "micro_batch": 1, "lr": 3e-4}, layout={"dp": 2})
    spec["model"] = dict(DEMO_MODELS[quick])
    specs = {a: {**spec, "layout": {"dp": 2, "zero": 3, "nvme_path": folder, **DEMO_ARMS[a]}} for a in arms}
    timeout_s = 300 if quick else 900
    uncapped = [demo_arm(a, specs[a], None, timeout_s) for a in arms]
    out: dict = {"model": DEMO_MODELS[quick], "layout": "dp2 zero3", "steps": steps, "uncapped": uncapped,
                 "capped": []}
    by = {r["arm"]: r for r in uncapped}
    if any(r["outcome"] != "completed" for r in uncapped):
        out["cap_reason"] = "an arm failed without a cap: " + "; ".join(
            f"{r['arm']}: {r['outcome']}" for r in uncapped if r["outcome"] != "completed")
        return out
    nvme_need = by["nvme"]["peak_rss_bytes"]  # everything resident, shared libraries and mapped files included
    others_need = min(r["peak_anon_bytes"] for r in uncapped if r["arm"] != "nvme")  # what cannot be reclaimed
    out.update(nvme_need_bytes=nvme_need, others_need_bytes=others_need)
    if others_need < CAP_MARGIN * nvme_need:
        out["cap_reason"] = (f"no cap separates the arms: the others' anonymous peak {others_need / 2**30:.2f} GiB is "
                             f"not {CAP_MARGIN}x nvme's peak RSS {nvme_need / 2**30:.2f} GiB")
        return out
    cap = int((nvme_need * others_need) ** 0.5) // 2**20 * 2**20  # geometric middle, whole MiB
    out["cap_bytes"] = cap
    out["capped"] = [demo_arm(a, specs[a], cap, timeout_s) for a in arms]
    return out


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
    demo = demonstrate(quick, folder)
    shutil.rmtree(folder, ignore_errors=True)
    return {"model": preset, "layout": "dp2 zero3", "steps": steps, "rounds": reps, "folder": folder,
            "step_s": {k: stats(v) for k, v in times.items()},
            "ratio_nvme_none": stats(paired_ratios(times["nvme"], times["none"])),
            "ratio_nvme_cpu": stats(paired_ratios(times["nvme"], times["cpu"])),
            "io": io, "demo": demo, "deepspeed": _deepspeed_reason(build=not quick) or "its async_io op builds and loads (not measured here)",
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
              f"pread {io['read_ratio_pread_dd']['median']:.2f}.", "", *demo_section(r.get("demo")),
              f"DeepSpeed ZeRO-Infinity: {r['deepspeed']}.", ""]
    return "\n".join(lines)


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def demo_section(d: dict | None) -> list[str]:
    """The demonstration's lines: each arm without a cap (its peak), then under the cap."""
    if not d:
        return []
    if "not_run" in d:
        return [f"Demonstration under a memory cap: not run ({d['not_run']}).", ""]
    m = d["model"]
    lines = [f"Demonstration under a memory cap (cgroup v1): gpt {m['layers']} x {m['hidden']}, vocab {m['vocab']}, "
             f"{d['layout']}, {d['steps']} steps, 1 sequence of {m['seq_len']} tokens per rank and step:", ""]
    rows = [[r["arm"], _gib(r["cap_bytes"]) if r["cap_bytes"] else "none", r["outcome"], _gib(r["peak_rss_bytes"]),
             _gib(r["peak_anon_bytes"]), _gib(r["cgroup_peak_bytes"]), f"{r['steps_done']}/{r['steps']}"]
            for r in d["uncapped"] + d["capped"]]
    lines += ["```", table(rows, ["arm", "cap", "outcome", "peak RSS (sum)", "anon", "cgroup peak", "steps"]), "```", ""]
    if "cap_reason" in d:
        lines += [f"No capped run: {d['cap_reason']}.", ""]
    else:
        lines += [f"The cap, {_gib(d['cap_bytes'])}, lies between the nvme arm's uncapped peak RSS "
                  f"({_gib(d['nvme_need_bytes'])}, mapped files and shared libraries included) and the smallest "
                  f"anonymous peak of the others ({_gib(d['others_need_bytes'])}, which no reclaim can free "
                  "without swap). Peaks are sampled every 0.1 s; 'cgroup peak' is the cgroup's "
                  "max_usage_in_bytes (page cache included, capped at the limit).", ""]
    return lines


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
