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
d) DeepSpeed ZeRO-Infinity as a fourth arm of (a), alternated with the others: stage 3 with
   offload_param and offload_optimizer on nvme, its ds_config written by the interop mapping
   (workbench/interop/deepspeed.py) from the nvme arm's own spec (only the folder differs), the same
   model and weights, batches, steps and micro-batches, 2 fresh gloo ranks per run, torch's
   AdamW passed in. Rank 0 of each implementation counts the files in its swap folder from inside
   training (DeepSpeed: after init and after step 1, behind a barrier; ours: after step 1) against
   the bytes predicted per rank (`predicted_swap_bytes`), and both loss trajectories are compared.
   DeepSpeed swaps a tensor only from 1 MiB up (MIN_AIO_BYTES), so on gpt-tiny its folder stays
   empty and on gpt-mini it holds the optimizer state alone. Skipped in --quick (QUICK_DEEPSPEED_REASON);
   when libaio or the async_io op is missing, or a DeepSpeed run fails, the result says why and the
   other parts still run.
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
    return _median_after_first(pool.run(spec, timeout_s=600))


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


# --------------------------------------------------------------------------------------------
# d) DeepSpeed ZeRO-Infinity on the same model, batches and ranks, its config built from the same spec.

MIB = 2**20
DS_MIN_AIO_BYTES = MIB  # deepspeed/runtime/swap_tensor/utils.py MIN_AIO_BYTES: a smaller tensor is never swapped


def _rank_of(parts: tuple[str, ...]) -> int | None:
    """The rank a swap file belongs to, from its folders: DeepSpeed's `rank<r>`, ours `rank<r>-...`."""
    for part in parts:
        m = re.fullmatch(r"rank(\d+)(-.*)?", part)
        if m:
            return int(m[1])
    return None


def swap_bytes(folder: str) -> dict:
    """What the files under `folder` hold now, per rank: file count, bytes (st_size) and bytes on disk
    (allocated blocks), and bytes per subfolder (DeepSpeed: zero_stage_3/optimizer, zero_stage_3/
    float32params; ours: shards, moments)."""
    ranks: dict[int, dict] = {}
    for root, _, files in os.walk(folder):
        rel = os.path.relpath(root, folder)
        parts = () if rel == "." else tuple(Path(rel).parts)
        rank = _rank_of(parts)
        if rank is None:
            continue
        kind = "/".join(p for p in parts if _rank_of((p,)) is None) or "files"
        if parts and _rank_of(parts[-1:]) is not None and "-shards-" in parts[-1]:
            kind = "shards + moments"  # ours at zero 2/3: one mapped file of shards, one per moment
        for name in files:
            try:
                st = os.stat(os.path.join(root, name))
            except OSError:  # removed while we walked
                continue
            r = ranks.setdefault(rank, {"files": 0, "bytes": 0, "disk_bytes": 0, "by_kind": {}})
            r["files"] += 1
            r["bytes"] += st.st_size
            r["disk_bytes"] += st.st_blocks * 512
            r["by_kind"][kind] = r["by_kind"].get(kind, 0) + st.st_size
    return {str(k): ranks[k] for k in sorted(ranks)}


def _partition_numels(spec_dict: dict, world: int) -> list[int]:
    """Each trainable tensor's partition per rank, as DeepSpeed's ZeRO-3 cuts it (ceil(numel / world))."""
    from workbench.models import build_model_meta
    from workbench.spec import load_spec

    model = build_model_meta(load_spec(spec_dict))
    return [-(-p.numel() // world) for p in model.parameters() if p.requires_grad]


def predicted_swap_bytes(spec_dict: dict, world: int) -> dict:
    """Bytes per rank each implementation should hold in files after step 1 (fp32, AdamW).

    Ours (zero 2/3 + nvme): the fp32 parameter shard and both moments, 12 bytes x numel / world (plus
    FSDP2's dim-0 padding and page alignment). DeepSpeed (stage 3, offload_optimizer nvme): per optimizer
    sub-group (`sub_group_size` 1e9 elements: one here) the fp32 partition, exp_avg and exp_avg_sq, 12
    bytes x the partition, but only when the sub-group is at least DS_MIN_AIO_BYTES (else all stays in
    host memory); offload_param nvme: the fp32 partition of each parameter whose partition is at least
    DS_MIN_AIO_BYTES (4 bytes each), the others stay in host memory."""
    parts = _partition_numels(spec_dict, world)
    numel = sum(parts)
    optimizer = 12 * numel if 4 * numel >= DS_MIN_AIO_BYTES else 0
    params = sum(4 * n for n in parts if 4 * n >= DS_MIN_AIO_BYTES)
    return {"partition_numel": numel, "ours": 12 * numel, "deepspeed_optimizer": optimizer,
            "deepspeed_params": params, "deepspeed": optimizer + params,
            "deepspeed_params_swappable": sum(1 for n in parts if 4 * n >= DS_MIN_AIO_BYTES),
            "tensors": len(parts)}


def deepspeed_config(spec_dict: dict) -> tuple[dict, list[str]]:
    """The ds_config the interop mapping (workbench/interop/deepspeed.py) writes for this spec, with
    what a benchmark run adds: torch's AdamW is passed in (the mapping's optimizer block would make
    DeepSpeed build its cpu_adam op, another C++ JIT build), so the block is dropped and
    `zero_force_ds_cpu_optimizer` is off; no progress printing."""
    from workbench.interop.deepspeed import from_spec
    from workbench.spec import load_spec

    cfg, notes = from_spec(load_spec(spec_dict))
    zero = cfg["zero_optimization"]
    if zero.get("stage") != 3 or zero.get("offload_param", {}).get("device") != "nvme" \
            or zero.get("offload_optimizer", {}).get("device") != "nvme":
        raise ValueError(f"the mapping did not write ZeRO-Infinity for a zero3 + nvme spec: {zero}")
    cfg.pop("optimizer", None)
    cfg.update(zero_force_ds_cpu_optimizer=False, zero_allow_untested_optimizer=True, steps_per_print=10**9,
               wall_clock_breakdown=False)
    return cfg, notes


def _deepspeed_rank(job: dict, sink) -> None:
    """One rank of the DeepSpeed arm: the spec's model (same seed: same weights), the same batches,
    torch's AdamW; rank 0 emits step events like workbench's and samples the swap folder after init
    and after step 1 (a barrier first, so that every rank's step-1 writes are done)."""
    import deepspeed
    import torch.distributed as dist

    from bench.peer_common import adamw, build_token_source, rank_batch, setup, token_loss

    spec, model = setup(job)
    rank, world = dist.get_rank(), dist.get_world_size()
    t = spec.train
    cfg, _ = deepspeed_config(job["spec"])
    deepspeed.comm.comm.cdb = None  # bind DeepSpeed's comm to this job's process group (see peer_deepspeed)
    deepspeed.init_distributed(dist_backend="gloo")
    start = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adamw(spec, model.parameters()), config=cfg)
    dist.barrier()
    if rank == 0:
        sink({"event": "swap", "when": "after init", "init_s": time.perf_counter() - start,
              "ranks": swap_bytes(job["folder"])})
    source = build_token_source(spec)
    micro = t.global_batch // world // t.micro_batch
    import torch

    for step in range(1, t.steps + 1):
        begin = time.perf_counter()
        total = torch.zeros(())
        for mb in rank_batch(spec, source, step, rank, world).split(t.micro_batch):
            loss = token_loss(engine(mb[:, :-1]), mb)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / micro / world
        dist.all_reduce(total)  # the global mean, as workbench's step event reports it
        elapsed = time.perf_counter() - begin
        if rank == 0:
            sink({"event": "step", "step": step, "loss": float(total), "step_time_s": elapsed})
        if step == 1:
            dist.barrier()
            if rank == 0:
                sink({"event": "swap", "when": "after step 1", "ranks": swap_bytes(job["folder"])})
    engine.destroy()
    sink({"event": "end", "status": "completed", "step": t.steps})


def _ours_rank(job: dict, sink) -> None:
    """One rank of a workbench arm: `train`, rank 0 sampling the swap folder after its step 1."""
    import torch.distributed as dist

    from workbench.runtime.loop import train

    first = dist.get_rank() == 0

    def watch(event: dict) -> None:
        sink(event)
        if first and event["event"] == "step" and event["step"] == 1:
            sink({"event": "swap", "when": "after step 1", "ranks": swap_bytes(job["folder"])})

    train(job["spec"], watch)


QUICK_DEEPSPEED_REASON = (
    "skipped in quick mode: each DeepSpeed run costs about 30 s of process start-up and engine init here "
    "before its first step, and on the quick model (gpt-tiny) DeepSpeed would hold nothing in files: its "
    "optimizer sub-group (121k elements per rank, 0.46 MiB in fp32) and every parameter partition are "
    "below DeepSpeed's 1 MiB swap minimum (MIN_AIO_BYTES), so it keeps them all in host memory")


class DeepSpeedArm:
    """The DeepSpeed arm: each run on 2 fresh ranks (DeepSpeed's import patches torch, and it keeps
    module globals bound to the first process group it saw (deepspeed.utils.groups, the comm backend)
    and a parameter counter that names its swap files: a second engine in the same process fails with
    "Group ... is not registered"); our arms' processes never import it. Each run starts from an empty
    swap folder; a failed run stops the arm and keeps the reason, so the other arms go on."""

    def __init__(self, spec: dict, folder: str, world: int):
        self.spec, self.folder, self.world = spec, folder, world
        self.error: str | None = None
        self.losses: list[float] = []
        self.swap: dict = {}
        self.init_s: list[float] = []

    def __call__(self) -> float:
        from workbench.errors import WorkerError
        from workbench.runtime.spawn import SpawnPool

        if self.error:
            return float("nan")
        shutil.rmtree(self.folder, ignore_errors=True)
        os.makedirs(self.folder)
        pool = SpawnPool(self.world)
        try:
            events = pool.run({"spec": self.spec, "folder": self.folder}, fn=_deepspeed_rank, timeout_s=900)
        except WorkerError as e:
            text = str(e)
            self.error = f"the DeepSpeed run failed: {text[:300]} ... {text[-400:]}" if len(text) > 700 else \
                f"the DeepSpeed run failed: {text}"
            return float("nan")
        finally:
            pool.close()
        swaps = {e["when"]: e["ranks"] for e in events if e["event"] == "swap"}
        swaps["after the run"] = swap_bytes(self.folder)  # DeepSpeed leaves its optimizer files behind
        self.swap = swaps
        self.init_s += [e["init_s"] for e in events if e["event"] == "swap" and "init_s" in e]
        self.losses = [e["loss"] for e in sorted((e for e in events if e["event"] == "step"), key=lambda e: e["step"])]
        return _median_after_first(events)


def _median_after_first(events: list[dict]) -> float:
    steps = sorted((e for e in events if e["event"] == "step"), key=lambda e: e["step"])
    return stats([e["step_time_s"] for e in steps[1:]])["median"]


def _loss_agreement(ours: list[float], theirs: list[float]) -> dict:
    diffs = [abs(a - b) / abs(a) for a, b in zip(ours, theirs)]
    return {"step1_rel": diffs[0] if diffs else float("nan"), "max_rel": max(diffs, default=float("nan")),
            "steps": len(diffs)}


def run(quick: bool = False) -> dict:
    from workbench.runtime.spawn import SpawnPool

    preset, steps, reps = ("gpt-tiny", 4, 2) if quick else ("gpt-mini", 5, 3)
    folder = tempfile.mkdtemp(prefix="bench-nvme-", dir=os.environ.get("WORKBENCH_NVME_DIR", "/tmp"))
    load_before = os.getloadavg()[0]

    def spec_of(name: str, path: str) -> dict:
        return tiny_spec(preset, train={"steps": steps, "global_batch": 8, "micro_batch": 2},
                         layout={"dp": 2, "zero": 3, "nvme_path": path, **LAYOUTS[name]},
                         resources={"gpu": "cpu", "gpus_per_node": 2})

    ours_folder, ds_folder = os.path.join(folder, "ours"), os.path.join(folder, "deepspeed")
    os.makedirs(ours_folder)
    if quick:  # libaio is checked, the op is not built or loaded
        ds_reason = _deepspeed_reason(build=False) or ""
        ds_reason = QUICK_DEEPSPEED_REASON if ds_reason.startswith("libaio is present") else ds_reason
    else:
        ds_reason = _deepspeed_reason(build=True)
    ds_spec = spec_of("nvme", ds_folder)  # the nvme arm's spec; only its folder differs
    ds = None if ds_reason else DeepSpeedArm(ds_spec, ds_folder, 2)
    ours_seen: dict = {"losses": [], "swap": {}}
    pool = SpawnPool(2)
    try:
        def job(name):
            spec = spec_of(name, ours_folder)
            if name != "nvme":
                return lambda: _step_times(pool, spec)

            def nvme() -> float:  # rank 0 samples the folder after step 1
                events = pool.run({"spec": spec, "folder": ours_folder}, fn=_ours_rank, timeout_s=600)
                ours_seen["swap"] = next(e["ranks"] for e in events if e["event"] == "swap")
                ours_seen["losses"] = [e["loss"] for e in sorted((e for e in events if e["event"] == "step"),
                                                                 key=lambda e: e["step"])]
                return _median_after_first(events)
            return nvme

        arms = {name: job(name) for name in LAYOUTS}
        if ds is not None:
            arms["deepspeed"] = ds
        times = interleave(arms, reps=reps)
    finally:
        pool.close()
    out = {"model": preset, "layout": "dp2 zero3", "steps": steps, "rounds": reps, "folder": folder,
           "step_s": {k: stats(v) for k, v in times.items() if k != "deepspeed"},
           "ratio_nvme_none": stats(paired_ratios(times["nvme"], times["none"])),
           "ratio_nvme_cpu": stats(paired_ratios(times["nvme"], times["cpu"]))}
    predicted = predicted_swap_bytes(ds_spec, 2)
    ds_out: dict = {"predicted_bytes_per_rank": predicted, "nvme_swap": ours_seen["swap"],
                    "nvme_losses": ours_seen["losses"]}
    if ds is not None and ds.error:
        ds_reason = ds.error
    if ds_reason:
        ds_out["not_run"] = ds_reason
    else:
        assert ds is not None
        ds_out.update(config=deepspeed_config(ds_spec)[0], step_s=stats(times["deepspeed"]),
                      nvme_step_s=stats(times["nvme"])["median"],
                      ratio_deepspeed_nvme=stats(paired_ratios(times["deepspeed"], times["nvme"])),
                      init_s=stats(ds.init_s), swap=ds.swap, losses=ds.losses,
                      loss_agreement=_loss_agreement(ours_seen["losses"], ds.losses))
    out["deepspeed"] = ds_out
    out["io"] = throughput(folder, 64 if quick else 256, reps)
    out["demo"] = demonstrate(quick, folder)
    out["load_average"] = [load_before, os.getloadavg()[0]]
    shutil.rmtree(folder, ignore_errors=True)
    return out


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
              *deepspeed_section(r.get("deepspeed"))]
    return "\n".join(lines)


def _mib(n) -> str:
    return f"{n / MIB:.1f} MiB"


def _per_rank(ranks: dict) -> str:
    """'rank 0: 28.1 MiB in 3 files (zero_stage_3/optimizer), rank 1: ...' or 'no files'."""
    if not ranks:
        return "no files"
    return ", ".join(f"rank {k}: {_mib(v['bytes'])} in {v['files']} files ({', '.join(v['by_kind'])})"
                     for k, v in ranks.items())


def deepspeed_section(d) -> list[str]:
    """The DeepSpeed arm's lines: step time against ours, what each holds in files, the losses."""
    if d is None:
        return []
    if isinstance(d, str):  # a result written before the arm existed: the reason alone
        return [f"DeepSpeed ZeRO-Infinity: {d}.", ""]
    p = d["predicted_bytes_per_rank"]
    pred = (f"predicted per rank: ours {_mib(p['ours'])} (fp32 shard + 2 AdamW moments, 12 B x "
            f"{p['partition_numel']:,} elements), DeepSpeed {_mib(p['deepspeed'])} (optimizer "
            f"{_mib(p['deepspeed_optimizer'])}, parameters {_mib(p['deepspeed_params'])}: "
            f"{p['deepspeed_params_swappable']} of {p['tensors']} parameter partitions reach its 1 MiB swap minimum)")
    if "not_run" in d:
        return [f"DeepSpeed ZeRO-Infinity: not run: {d['not_run']}. Ours held {_per_rank(d['nvme_swap'])} "
                f"after step 1; {pred}.", ""]
    a, zero = d["loss_agreement"], d["config"]["zero_optimization"]
    lines = ["DeepSpeed ZeRO-Infinity (stage 3, offload_param and offload_optimizer on nvme, its config "
             "written by workbench/interop/deepspeed.py from the nvme arm's spec; torch's AdamW passed in), "
             "alternated with the arms above, each run on 2 fresh ranks:", "",
             f"- step time: deepspeed {d['step_s']['median']:.3f} s (median) against ours (nvme) "
             f"{d.get('nvme_step_s', float('nan')):.3f} s; deepspeed / nvme {d['ratio_deepspeed_nvme']['median']:.2f}x "
             f"(paired per round, range {d['ratio_deepspeed_nvme']['min']:.2f}..{d['ratio_deepspeed_nvme']['max']:.2f}); "
             f"engine init {d['init_s']['median']:.1f} s, not in the step time.",
             f"- in files, sampled by rank 0 from inside the training processes: ours after step 1 "
             f"{_per_rank(d['nvme_swap'])}; DeepSpeed after init {_per_rank(d['swap'].get('after init', {}))}, "
             f"after step 1 {_per_rank(d['swap'].get('after step 1', {}))}, and after the run "
             f"{_per_rank(d['swap'].get('after the run', {}))} (DeepSpeed does not delete them); {pred}.",
             f"- losses (global mean per step): ours {', '.join(f'{x:.6f}' for x in d['nvme_losses'])}; "
             f"DeepSpeed {', '.join(f'{x:.6f}' for x in d['losses'])}: relative difference "
             f"{a['step1_rel']:.1e} at step 1, at most {a['max_rel']:.1e} over {a['steps']} steps.",
             f"- nvme_path {zero['offload_param']['nvme_path']}: DeepSpeed writes zero_stage_3/optimizer/rank<r>/ "
             "and zero_stage_3/float32params/rank<r>/ under it; ours rank<r>-shards-*/.", ""]
    return lines


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
