"""The one entrypoint that runs inside a remote job (SageMaker, Vertex AI, Azure ML, a Ray cluster).

It reads the cloud's rendezvous environment and checkpoint location, starts one process per rank
when the cloud started one per node, and runs the same per-rank runtime, resuming from the newest
checkpoint there. `python -m workbench.cloud_entry --spec workbench_job.json` (or as a script).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__" and __package__ in (None, ""):
    # Started as a script (SageMaker's launcher runs `torchrun workbench/cloud_entry.py`): make the
    # bundle root importable so `import workbench` finds the shipped package.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from workbench.errors import ConfigError  # noqa: E402

SAGEMAKER_CHECKPOINTS = "/opt/ml/checkpoints"
DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Rendezvous:
    """Where this node sits in the job: what torchrun needs to start its ranks."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int


def detect_cloud(env: Mapping[str, str]) -> str:
    """sagemaker | vertex | azureml | ray | generic, from the variables each service sets."""
    if env.get("WORKBENCH_CLOUD"):
        return env["WORKBENCH_CLOUD"]
    if "SM_TRAINING_ENV" in env or "SM_CURRENT_HOST" in env:
        return "sagemaker"
    if "CLUSTER_SPEC" in env or "AIP_CHECKPOINT_DIR" in env or "CLOUD_ML_JOB_ID" in env:
        return "vertex"
    if "AZUREML_RUN_ID" in env or any(k.startswith("AZ_BATCHAI_") for k in env):
        return "azureml"
    return "generic"


def launched_per_rank(env: Mapping[str, str]) -> bool:
    """True when a launcher already started one process per rank (torchrun, Azure's PyTorch
    distribution). Vertex sets RANK/WORLD_SIZE per *node*, so LOCAL_RANK is the reliable sign."""
    return "LOCAL_RANK" in env


def gcs_fuse_path(uri: str) -> str:
    """gs://bucket/path -> /gcs/bucket/path: Vertex mounts every bucket the job can read there."""
    return "/gcs/" + uri[len("gs://"):] if uri.startswith("gs://") else uri


def checkpoint_dir(cloud: str, env: Mapping[str, str], given: str | None = None) -> str | None:
    """The local folder the runtime reads and writes checkpoints in, for this cloud.

    SageMaker syncs /opt/ml/checkpoints with CheckpointConfig.S3Uri; Vertex points
    AIP_CHECKPOINT_DIR at <base_output_dir>/checkpoints/ (reached through the /gcs mount); Azure ML
    mounts the read-write output whose path the command passes as --checkpoint-dir.
    """
    if given:
        return gcs_fuse_path(given)
    if env.get("WORKBENCH_CHECKPOINT_DIR"):
        return gcs_fuse_path(env["WORKBENCH_CHECKPOINT_DIR"])
    if cloud == "sagemaker":
        return SAGEMAKER_CHECKPOINTS
    if cloud == "vertex" and env.get("AIP_CHECKPOINT_DIR"):
        return gcs_fuse_path(env["AIP_CHECKPOINT_DIR"])
    if cloud == "azureml" and env.get("AZURE_ML_OUTPUT_CHECKPOINTS"):
        return env["AZURE_ML_OUTPUT_CHECKPOINTS"]
    return None


def _vertex_rendezvous(env: Mapping[str, str]) -> Rendezvous:
    spec = json.loads(env["CLUSTER_SPEC"])
    cluster, task = spec["cluster"], spec["task"]
    pools = sorted(k for k in cluster if k.startswith("workerpool"))  # workerpool0 = the chief
    offsets, total = {}, 0
    for pool in pools:
        offsets[pool] = total
        total += len(cluster[pool])
    host, _, port = cluster["workerpool0"][0].partition(":")
    # Vertex's own MASTER_PORT (prebuilt images) wins; the chief's CLUSTER_SPEC port is its gRPC port.
    return Rendezvous(total, offsets[task["type"]] + int(task.get("index", 0)), env.get("MASTER_ADDR", host),
                      int(env.get("MASTER_PORT", port or DEFAULT_PORT)))


def _sagemaker_rendezvous(env: Mapping[str, str]) -> Rendezvous:
    hosts = sorted(json.loads(env.get("SM_HOSTS", '["algo-1"]')))
    current = env.get("SM_CURRENT_HOST", hosts[0])
    # The PyTorch DLC's toolkit exports MASTER_ADDR = the first host and MASTER_PORT (7777).
    return Rendezvous(len(hosts), hosts.index(current), env.get("MASTER_ADDR", hosts[0]),
                      int(env.get("MASTER_PORT", DEFAULT_PORT)))


def node_rendezvous(cloud: str, env: Mapping[str, str]) -> Rendezvous:
    """This node's rank among the job's nodes and the master's address, from the cloud's variables."""
    if cloud == "vertex" and "CLUSTER_SPEC" in env:
        return _vertex_rendezvous(env)
    if cloud == "sagemaker" and "SM_HOSTS" in env:
        return _sagemaker_rendezvous(env)
    # torch-style variables (Vertex's prebuilt images, Azure's NODE_RANK): per node here.
    nnodes = int(env.get("WORLD_SIZE", env.get("NODE_COUNT", "1")))
    node_rank = int(env.get("NODE_RANK", env.get("RANK", "0")))
    return Rendezvous(nnodes, node_rank, env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", DEFAULT_PORT)))


def torchrun_command(rdzv: Rendezvous, nproc_per_node: int, args: list[str], max_restarts: int = 0,
                     run: str = "workbench") -> list[str]:
    """The command that starts this node's ranks and runs this module in each, with the same args.

    `max_restarts` (backend.max_failures): torchrun starts every node's rank group again after a
    rank fails, up to that many times; each new group resumes from the newest complete checkpoint.
    Restarts take torchrun's c10d rendezvous (on the master's address and port, id `run`), with a
    fresh store per round (`supervise`): its static one keeps the first attempt's store, whose stale
    addresses the restarted ranks would dial.
    c10d numbers the nodes in the sorted order of their agents, which stays the same across the
    restarts of one job, so a node-local checkpoint folder (SageMaker's) still holds its ranks' files.
    Without restarts the static rendezvous keeps the cloud's node order."""
    if max_restarts:
        where = ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv.master_addr}:{rdzv.master_port}", f"--rdzv-id={run}",
                 f"--max-restarts={max_restarts}"]
    else:
        where = [f"--node_rank={rdzv.node_rank}", f"--master_addr={rdzv.master_addr}",
                 f"--master_port={rdzv.master_port}"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={rdzv.nnodes}",
            f"--nproc_per_node={nproc_per_node}", *where, "-m", "workbench.cloud_entry", *args]


def check_world(spec, env: Mapping[str, str]) -> None:
    """The launcher's world size must be the layout's: a mismatch means a wrong instance shape."""
    world = int(env.get("WORLD_SIZE", "1"))
    if world != spec.world_size:
        raise ConfigError(
            f"the launcher started {world} ranks (WORLD_SIZE) but the spec's layout has dp({spec.layout.dp}) x "
            f"tp({spec.layout.tp}) x pp({spec.layout.pp}) = {spec.world_size}. Match resources.gpus_per_node x "
            "nodes to the machines' GPUs, or change the layout.")


def _emit(event: dict) -> None:
    # One write per line: ranks share the job's stdout, and a single write below PIPE_BUF is not
    # interleaved with another rank's (print() writes the text and the newline separately).
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _print_sink(rank: int):
    def sink(event: dict) -> None:
        if rank == 0 or event.get("event") == "memory":
            _emit(event)
    return sink


def resume_mode(strict: bool):
    """What a cloud job resumes with: the newest complete checkpoint, else step 1 (RESUME_OR_FRESH:
    a restarted job whose checkpoints are all incomplete, e.g. cut by SageMaker's background sync,
    starts again instead of dying on every restart); `strict` refuses instead (exit 2)."""
    from workbench.runtime.checkpoint_store import RESUME_OR_FRESH

    return True if strict else RESUME_OR_FRESH


def restart_count(env: Mapping[str, str]) -> int:
    """How many times torchrun restarted this node's ranks (TORCHELASTIC_RESTART_COUNT)."""
    try:
        return int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def run_ranks(spec, strict: bool = False) -> dict:
    """This process is one rank: run the per-rank loop on `spec` (as `main` loaded it, once),
    resuming from the newest complete checkpoint in its checkpoint.uri (step 1 when there is none,
    unless `strict`)."""
    from workbench.runtime.loop import train
    from workbench.runtime.preemption import stop_with_parent

    if launched_per_rank(os.environ):
        stop_with_parent()  # the launcher's death is a preemption notice: never train on unsupervised
    return train(spec, sink=_print_sink(int(os.environ.get("RANK", "0"))), resume=resume_mode(strict),
                 attempt=restart_count(os.environ))


EXIT_DIR = "WORKBENCH_EXIT_DIR"  # where each rank started by `supervise` leaves its exit code


def supervise(cmd: list[str]) -> int:
    """Run torchrun (`cmd`) as a child, pass SIGTERM/SIGINT on to it, and exit as the ranks did:
    2 if a rank refused the job (a ConfigError), 75 if they stopped on a preemption notice, 0 when
    torchrun succeeded, else 1. torchrun itself exits 1 for any rank that does not exit 0."""
    import subprocess
    import tempfile

    from workbench.runtime.preemption import EXIT_PREEMPTED

    _become_subreaper()  # ranks orphaned by a dying torchrun become our children: we wait for them too
    with tempfile.TemporaryDirectory(prefix="workbench-exit-") as folder:
        # Each rendezvous round's ranks get a store of their own (rank 0's, on a free port): with the
        # agent's shared store, restarted ranks would read the dead attempt's addresses and fail to connect.
        proc = subprocess.Popen(cmd, env={**os.environ, EXIT_DIR: folder, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})

        def forward(signum, _frame) -> None:
            # SIGHUP: the service's launcher that started us died (stop_with_parent below): a notice too.
            proc.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            from workbench.runtime.preemption import stop_with_parent

            stop_with_parent()
            returncode = proc.wait()
            _wait_for_orphans()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        codes = last_attempt_codes(Path(folder))
    code = 2 if 2 in codes else EXIT_PREEMPTED if EXIT_PREEMPTED in codes else 0 if returncode == 0 else 1
    if code:  # the last line, below torchrun's own report of ranks that did not exit 0
        said = {2: "a rank refused the job (see its error above)", 1: "a rank failed (see above)",
                EXIT_PREEMPTED: "stopped on a preemption notice after writing a checkpoint; run again to resume"}
        print(f"workbench: exit {code}: {said[code]}", file=sys.stderr, flush=True)
    return code


def last_attempt_codes(folder: Path) -> set[int]:
    """The exit codes the ranks of torchrun's last attempt left (exit-a<attempt>-rank<r>): an
    earlier attempt's failure that a restart recovered from does not count."""
    found: dict[int, set[int]] = {}
    for p in folder.glob("exit-a*-rank*"):
        attempt = p.name[len("exit-a"):].partition("-")[0]
        try:
            found.setdefault(int(attempt), set()).add(int(p.read_text() or 1))
        except ValueError:
            continue
    return found[max(found)] if found else set()


def _become_subreaper() -> None:
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER (Linux)
    except (OSError, AttributeError):
        pass


def _wait_for_orphans() -> None:
    """Reap every remaining child: ranks whose torchrun died finish their checkpoint first
    (runtime/preemption.py, stop_with_parent)."""
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def _exit_code(result) -> int:
    from workbench.runtime.preemption import EXIT_PREEMPTED

    status = result.get("status", "completed") if isinstance(result, dict) else "completed"
    return {"completed": 0, "preempted": EXIT_PREEMPTED}.get(status, 1)


def run_on_ray(spec, ckpt: str | None, strict: bool = False) -> int:
    """Inside a Ray job: run with the local-Ray launcher, which joins the cluster this job runs on,
    and print its metrics events as JSON lines as they come (they are the job's log)."""
    import ray

    from backends.local_start import start
    from workbench.runtime.preemption import forward_signal

    if not ray.is_initialized():
        # Join the cluster this job runs on (RAY_ADDRESS is set by the Jobs API) before the local
        # launcher would start a cluster of its own; workers inherit the job's working_dir.
        ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    if ckpt:
        spec = spec.replace(**{"checkpoint.uri": ckpt})
    handle = start(spec.replace(**{"backend.name": "local"}), resume=resume_mode(strict))
    # `ray job stop` sends SIGTERM (then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S, which our request sets
    # to the grace period): the ranks stop after a step and checkpoint, rank 0 reports the end and
    # releases the lease, before the driver (and with it its actors) goes.
    with forward_signal(handle.cancel, signals=(signal.SIGTERM, signal.SIGINT)):
        for event in handle.follow():
            _emit(event)
    end = next((e for e in reversed(handle.events) if e["event"] == "end"), None)
    if end is None:  # no rank reported the end: a cancel before the ranks started, or a failure
        stopped = handle.status().state.value == "stopped"
        end = {"event": "end", "status": "preempted" if stopped else "failed",
               "step": max((e["step"] for e in handle.events if e["event"] == "step"), default=0)}
        _emit(end)
    return _exit_code(end)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m workbench.cloud_entry")
    p.add_argument("--spec", default="workbench_job.json", help="the job spec shipped in the bundle")
    p.add_argument("--checkpoint-dir", help="local checkpoint folder (default: the cloud's)")
    p.add_argument("--resume-or-fresh", action="store_true",
                   help="the default: resume from the newest complete checkpoint, else start at step 1")
    p.add_argument("--strict-resume", action="store_true",
                   help="refuse (exit 2) when there are checkpoints and none of them is complete")
    args, _ = p.parse_known_args(argv)  # clouds may append their own arguments
    if args.strict_resume and args.resume_or_fresh:
        raise ConfigError("--strict-resume and --resume-or-fresh contradict each other: give one of them.")

    from workbench.spec import load_spec

    env = os.environ
    cloud = detect_cloud(env)
    ckpt = checkpoint_dir(cloud, env, args.checkpoint_dir)
    # Loaded once, pointing at the cloud's checkpoint folder: as a rank, this process runs on it.
    spec = load_spec(args.spec, [f"checkpoint.uri={json.dumps(ckpt)}"] if ckpt else None)
    if cloud == "ray":
        return run_on_ray(spec, ckpt, args.strict_resume)
    if not launched_per_rank(env) and (spec.world_size > 1 or spec.backend.max_failures):
        rdzv = node_rendezvous(cloud, env)
        from workbench.runtime.checkpoint_lease import RUN_ID_VARS

        run = next((env[v] for v in RUN_ID_VARS if env.get(v)), spec.name)  # the same on every node
        cmd = torchrun_command(rdzv, spec.resources.gpus_per_node, argv, spec.backend.max_failures, run)
        print(f"workbench: {cloud} node {rdzv.node_rank}/{rdzv.nnodes}: {' '.join(cmd)}", flush=True)
        return supervise(cmd)
    if launched_per_rank(env):
        check_world(spec, env)
    return _exit_code(run_ranks(spec, args.strict_resume))


def entry(argv: list[str] | None = None) -> int:
    """`main` with its documented exit codes (0 completed, 1 failed, 2 refused, 75 preempted),
    left in $WORKBENCH_EXIT_DIR for the `supervise` that started this rank."""
    try:
        code = main(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    folder = os.environ.get(EXIT_DIR)
    if folder and os.path.isdir(folder):
        name = f"exit-a{restart_count(os.environ)}-rank{os.environ.get('RANK', '0')}"
        Path(folder, name).write_text(str(code))
    return code


if __name__ == "__main__":
    sys.exit(entry())
