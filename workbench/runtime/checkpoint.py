"""Checkpoints of a training run with torch.distributed.checkpoint (DCP), for every layout.

DCP's `get_state_dict` / `set_state_dict` turn DDP, FSDP2 and DTensor (TP) modules into
canonical, layout-free keys, so each rank writes only its shards and a checkpoint loads under
another world size or layout (resharding). What is saved: model, optimizer, extra stateful
objects (the fp16 loss scaler), RNG states per rank; the step, the spec and the run's identity
(`run_id`: the job's WORKBENCH_RUN_ID or cloud job name, checkpoint_lease.run_id) go in the manifest,
so that a caller can tell its own run's checkpoints from another run's under the same URI
(`manifest_run_id`; the notebook's Resume continues only its own, and a fresh run refuses a URI
holding another run's, `check_fresh`). `restore` itself loads the newest complete checkpoint whoever
wrote it: the CLI's explicit --resume, and checkpoints written before runs had an id.
Data needs no state: batch k is a pure function of (data.seed, k). See docs/checkpoints.md.
"""
from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from workbench.errors import ConfigError
from workbench.parallel.tied import saved_names
from workbench.runtime.checkpoint_reshard import fill_optim, home, layout_diff, load_canonical, local_part, master_state
from workbench.runtime.checkpoint_safe import (
    SafeLoadPlanner,
    UnsafeCheckpoint,
    load_value,
    reader_for,
    unsafe_cause,
)
from workbench.runtime.checkpoint_state import (
    module_keys,
    rng_state,
    saved_keys,
    set_rng_state,
    stage,
    state_bytes,
    state_dict_options,
    union_module,
)
from workbench.runtime.checkpoint_store import (
    RUN_ID_KEY,
    Store,
    all_rejected,
    describe_error,
    disk_full,
    fresh_run_conflict,
    manifest_or_problem,
    manifest_spec,
    new_manifest,
)

# DCP says this on every single-process save/load, which is what we mean there.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
# Re-writing a step after a resume from an older one: its manifest was removed first (_prepare).
warnings.filterwarnings("ignore", message="Detected an existing checkpoint in .*overwriting")


OPTIONAL_PARTS = ("scaler",)  # state that may start fresh when a checkpoint lacks it
def _run_id() -> str:
    from workbench.runtime.checkpoint_lease import run_id

    return run_id()


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message says why and what is still intact."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped on resume (incomplete or corrupt) in favour of an older one."""


class Checkpointer:
    """Saves and restores one rank's share of a run. Every method is called on all ranks.

    Args:
        spec: the job spec as a dict (recorded in each manifest, checked on resume).
        modules: this rank's model modules (one, or several pipeline stages).
        optimizer: the torch optimizer over their parameters, or None when an extra holds the
            optimizer state (the fp32 master of mixed precision / zero=1).
        extra_state: other objects with state_dict()/load_state_dict(), e.g. {"scaler": scaler}.
        on_saved: called on rank 0 with (step, url) as soon as its manifest is written (committed),
            before old checkpoints are dropped.
        warn: called on rank 0 with a message when a checkpoint is skipped on resume.
        clock: seconds, monotonic (injectable for tests of time-based saves).
        loaded: `spec` as the JobSpec the run loaded (a resume is checked against it); without it,
            loaded from `spec` when a resume needs it.
    """

    def __init__(self, spec: dict, modules: list[nn.Module], optimizer: torch.optim.Optimizer | None, *,
                 extra_state: dict | None = None,
                 on_saved: Callable[[int, str], None] | None = None,
                 warn: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 loaded=None):
        cfg = spec.get("checkpoint", {})
        self.spec, self.optimizer, self._loaded = spec, optimizer, loaded
        self.uri = cfg.get("uri")
        self.every_steps = int(cfg.get("every_steps", 0))
        self.every_s = float(cfg.get("every_minutes", 0.0)) * 60.0
        self.keep = int(cfg.get("keep", 3))
        self.rejected_steps: list[int] = []  # steps restore() skipped as incomplete or corrupt
        self.async_save = bool(cfg.get("async_save", False))
        self.module = modules[0] if len(modules) == 1 else union_module(modules)
        self.names = saved_names(modules)  # a tied copy/head saved as the embedding: one weight
        self.extra_state = dict(extra_state or {})
        self.on_saved, self._warn_cb, self.clock = on_saved, warn, clock
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        # A separate gloo group: checkpoint collectives run on CPU and, with async_save, in a
        # background thread next to the training collectives of the default group.
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.store = Store(self.uri) if self.uri else None
        self.run_id = _run_id()  # recorded in each manifest (manifest_run_id)
        # One rank per view of the store deletes there (ranks of a node share its folder).
        views = self._gather(self.store.view_id() if self.store else None)
        self._leader = views.index(views[self.rank]) == self.rank
        self.lease = self._take_lease() if self.store else None
        self.last_saved_step = 0
        self._last_save_time = clock()
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._need_bytes = 0
        self.last_blocking_s = 0.0
        self._staging: dict = {}  # CPU buffers reused by background saves (one in flight at a time)

    def _take_lease(self):
        """Rank 0 takes the URI's lease; every rank raises the same LeaseHeld if another run has it."""
        from workbench.runtime.checkpoint_lease import Lease, LeaseHeld

        lease, refused = Lease(self.store), None
        if self.rank == 0:
            try:
                lease.acquire()
            except LeaseHeld as e:
                refused = ("held", str(e))
            except Exception as e:  # noqa: BLE001 - the store failed: every rank raises it below
                refused = ("store", describe_error(e))
        refused = self._broadcast(refused)
        if refused and refused[0] == "held":
            raise LeaseHeld(refused[1])
        if refused:
            raise CheckpointError(f"could not take the lease on {self.uri}: {refused[1]}")
        return lease if self.rank == 0 else None

    @property
    def enabled(self) -> bool:
        return self.store is not None

    # -- schedule -----------------------------------------------------------------------
    def flags(self, step: int, stop_requested: bool, *, last_step: int) -> list[bool]:
        """This rank's [stop, time-based save due] after `step`. The loop agrees on them over the
        ranks (each True if it is on any rank: a stop on any rank stops all, a save due on any
        rank's clock saves on all) and passes the agreed flags to `decide`."""
        time_due = self.enabled and self.every_s > 0 and self.clock() - self._last_save_time >= self.every_s
        return [stop_requested and step < last_step, time_due]

    def decide(self, step: int, agreed: list[bool], *, last_step: int) -> tuple[bool, bool]:
        """(save now, stop now) after `step`, from the flags agreed over the ranks (`flags`)."""
        stop, time_due = agreed
        if not self.enabled:
            return False, stop
        step_due = self.every_steps > 0 and step % self.every_steps == 0
        return stop or time_due or step_due or step == last_step, stop

    # -- save ---------------------------------------------------------------------------
    def save(self, step: int, *, block: bool = False) -> None:
        """Write a checkpoint of `step`; in the background if async_save and not `block`.

        Raises:
            CheckpointError: this or the previous (async) save failed; earlier checkpoints
                are intact.
        """
        self.wait()
        lost = self._broadcast(self.lease.lost if self.lease else None)
        if lost:
            raise CheckpointError(f"checkpoint of step {step} not written: {lost}. This run stops writing there.")
        entered = time.perf_counter()  # the pause training sees (after any previous save finished)
        self._last_save_time = self.clock()
        state, _ = self._state_dict()
        rng = rng_state()
        if self.async_save and not block:
            staged = stage(state, self._staging)  # training changes the live tensors from now on
            self._thread = threading.Thread(target=self._write_bg, args=(step, staged, rng),
                                            name=f"checkpoint-{step}", daemon=True)
            self._thread.start()
            self.last_blocking_s = time.perf_counter() - entered
        else:
            self._write(step, state, rng)
            self.last_blocking_s = time.perf_counter() - entered

    def wait(self) -> None:
        """Block until a background save finishes; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._thread_error is not None:
            error, self._thread_error = self._thread_error, None
            raise error

    def close(self) -> None:
        """Finish a background save and release the URI's lease."""
        try:
            self.wait()
        finally:
            if self.lease is not None:
                self.lease.release()

    def _write_bg(self, step: int, state: dict, rng: dict) -> None:
        try:
            self._write(step, state, rng)
        except BaseException as e:  # noqa: BLE001 - re-raised on the training thread by wait()
            self._thread_error = e

    def _write(self, step: int, state: dict, rng: dict) -> None:
        import torch.distributed.checkpoint as dcp

        start, store = time.perf_counter(), self.store
        self._need_bytes = state_bytes(state)
        directory = store.step_dir(step)
        self._phase(step, "preparing the directory", lambda: self._prepare(directory))
        rng_file = f"rng-rank{self.rank:05d}.pt"
        self._phase(step, "writing RNG states", lambda: store.write_torch(f"{directory}/{rng_file}", rng))
        writer = _recording(self._writer(directory))
        self._phase(step, "writing tensors", lambda: dcp.save(state, storage_writer=writer,
                                                               process_group=self.group, no_dist=self.group is None))
        # Each rank reads back what it wrote, in its own view: rank 0 never needs to see them.
        mine = [rng_file, *writer.written()] + ([".metadata"] if self.rank == 0 else [])
        sums = self._phase(step, "checksumming", lambda: {rel: store.checksum(f"{directory}/{rel}") for rel in mine})
        files = {rel: info for part in self._gather(sums) for rel, info in part.items()}

        def commit():
            if self.rank == 0:
                manifest = new_manifest(step, self.spec, self.world, files, time.perf_counter() - start)
                manifest[RUN_ID_KEY] = self.run_id
                store.write_manifest(directory, manifest)
                if self.on_saved is not None:  # now, not after the collectives below: a rank lost
                    self.on_saved(step, store.url(directory))  # in them must not hide a committed step
                return store.committed_steps()[:self.keep]
            return None

        kept = self._phase(step, "committing", commit, everyone=False)
        self._retain(kept, step)
        self.last_saved_step = step

    def _writer(self, path: str):
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        if self.store.local:
            return FileSystemWriter(path, single_file_per_rank=True, sync_files=True, thread_count=1)
        return FsspecWriter(self.store.url(path), single_file_per_rank=True, sync_files=False, thread_count=1)

    def _prepare(self, directory: str) -> None:
        """Un-commit a step about to be (re)written, in every view; each rank makes its folder."""
        if self._leader:
            self.store.remove_manifest(directory)
        self.store.fs.makedirs(directory, exist_ok=True)

    def _retain(self, kept: list[int], step: int) -> None:
        """keep-N on every node: each view's leader drops its own files of the dropped steps,
        all manifests first, so a half-deleted step is never complete anywhere."""
        doomed = self.store.doomed(kept, current=step) if self._leader else []
        self._phase(step, "dropping old manifests", lambda: [self.store.remove_manifest(d) for d in doomed],
                    committed=True)
        self._phase(step, "dropping old checkpoints", lambda: [self.store.remove(d) for d in doomed], committed=True)

    def _phase(self, step: int, what: str, fn: Callable, everyone: bool = True, committed: bool = False):
        """Run one phase of a save and agree on its outcome: all ranks raise the same error.

        A failure before the commit removes the step's files; after it (`committed`) they stay.
        """
        result, error = None, None
        try:
            result = fn()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - turned into a CheckpointError below
            error = describe_error(e)
        errors = [e for e in self._gather(error) if e]
        if errors:
            if self._leader and not committed:  # frees the space a full disk needs
                self.store.remove(self.store.step_dir(step))
            full = None if error is None or "no space left" in error else disk_full(self.store, self._need_bytes)
            errors = [e for e in self._gather(full) if e] + errors
            prev = f"step {self.last_saved_step}" if self.last_saved_step else "none written by this run"
            raise CheckpointError(
                f"checkpoint of step {step} to {self.uri} failed while {what}: {errors[0]}. "
                f"The previous checkpoint is intact ({prev}); the partial files were removed."
                + (" Free space on that volume, lower checkpoint.keep, or point checkpoint.uri at a "
                   "larger one, then resume with --resume." if "no space left" in errors[0].lower() else ""))
        return self._broadcast(result) if not everyone else result

    # -- restore ------------------------------------------------------------------------
    def check_fresh(self) -> None:
        """Before a fresh run's first step: every rank raises the same ConfigError when the URI
        holds another run's checkpoints (checkpoint_store.fresh_run_conflict); nothing is written."""
        if not self.enabled:
            return
        conflict = None
        if self.rank == 0:  # (rank 0's view: the one a resume reads the manifests in)
            try:
                conflict = fresh_run_conflict(self.store, self.run_id, self.keep)
            except Exception as e:  # noqa: BLE001 - the store failed: every rank raises it below
                conflict = f"could not list the checkpoints under {self.uri}: {describe_error(e)}"
        conflict = self._broadcast(conflict)
        if conflict:
            raise ConfigError(conflict)

    def _loaded_spec(self):
        """The run's JobSpec: the one it loaded, else `spec` loaded once here."""
        if self._loaded is None:
            from workbench.spec import load_spec

            self._loaded = load_spec(self.spec)
        return self._loaded

    def restore(self, *, or_fresh: bool = False) -> int:
        """Load the newest complete, intact checkpoint; returns its step (0 when none).

        A checkpoint that is incomplete or corrupt is skipped with a warning, never loaded.
        Args:
            or_fresh: when every checkpoint is rejected, start at step 0 instead of raising.
        Raises:
            ConfigError: the checkpoint was written by an incompatible spec (e.g. another model
                shape), or every checkpoint under the URI was rejected (each named, with why).
        """
        from workbench.validate import check_resume

        if not self.enabled:
            self._warn("resume requested but checkpoint.uri is not set; starting from step 0")
            return 0
        rejected = []
        self.rejected_steps = []
        for step in self._broadcast(self.store.committed_steps() if self.rank == 0 else None):
            # Only rank 0's view need hold the manifest (per-node folders before a sync).
            manifest, problem = self._broadcast(manifest_or_problem(self.store, step) if self.rank == 0 else None)
            problems = [problem] if problem else self.store.verify(step, manifest, self.rank, self.world)
            problems = sorted({p for part in self._gather(problems) for p in part})
            if problems:
                rejected.append((step, "; ".join(problems[:3])))
                self.rejected_steps.append(step)
                self._warn(f"checkpoint step {step} under {self.uri} is incomplete or corrupt "
                           f"({rejected[-1][1]}); falling back to the previous complete checkpoint")
                continue
            for note in check_resume(self._loaded_spec(), manifest_spec(manifest, self.uri)):
                self._warn(note)
            problems = self._load_step(step, manifest)
            if problems:  # forged or planted files that passed size and CRC-32: the load is what finds them
                rejected.append((step, "; ".join(problems[:3])))
                self.rejected_steps.append(step)
                self._warn(f"checkpoint step {step} under {self.uri} could not be loaded ({rejected[-1][1]}); "
                           "falling back to the previous complete checkpoint")
                continue
            self.last_saved_step = step
            self._last_save_time = self.clock()
            return step
        if rejected and not or_fresh:
            raise all_rejected(self.uri, rejected)
        self._warn(f"no complete checkpoint under {self.uri}; starting from step 0")
        return 0

    def _load_step(self, step: int, manifest: dict) -> list[str]:
        """Load one verified step and this rank's RNG streams; what made that fail on any rank (the
        same list on every rank), empty when it loaded. A failed load leaves partial state that the
        next step's load overwrites whole."""
        try:
            self._load(step, manifest)
            problems = self._restore_rng(step, manifest)
        except ConfigError:
            raise
        except (Exception, CheckpointException) as e:
            cause = unsafe_cause(e)
            problems = [f"not plain checkpoint data ({cause})" if cause else f"unreadable ({describe_error(e)})"]
        return sorted({p for part in self._gather(problems) for p in part})

    def _restore_rng(self, step: int, manifest: dict) -> list[str]:
        """Set this rank's RNG streams from the step's RNG file; [why] when that file is not an RNG state."""
        if manifest.get("world_size") != self.world:  # per-rank streams only map 1:1 on the same world
            return []
        name = f"rng-rank{self.rank:05d}.pt"
        try:
            set_rng_state(load_value(self.store.read_bytes(f"{self.store.step_dir(step)}/{name}")))
        except (UnsafeCheckpoint, ValueError) as e:
            return [f"{name}: not plain checkpoint data ({e})" if isinstance(e, UnsafeCheckpoint) else f"{name}: {e}"]
        return []

    def _load(self, step: int, manifest: dict) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        path = self.store.step_dir(step)
        url = self.store.url(path)
        reader = reader_for(self.store.local)
        saved = {key.split(".", 1)[0] for key in reader(url).read_metadata().state_dict_metadata}
        state, back = self._state_dict()
        layout, saved_layout = self.spec.get("layout", {}), manifest.get("layout", {})
        if home(set(state)) != home(saved):
            return self._load_converted(step, manifest, reader, url, state, back, saved)
        missing = [part for part in state if part not in saved]
        for part in missing:
            if part not in OPTIONAL_PARTS:
                raise ConfigError(
                    f"cannot resume: the checkpoint of step {step} under {self.uri} has no {part!r} state, which "
                    f"this run needs ({layout_diff(saved_layout, layout)}). Resume with the checkpoint's layout, "
                    "or start a fresh run.")
            self._warn(f"the checkpoint of step {step} has no {part!r} state; it starts fresh")
        present = {k: v for k, v in state.items() if k not in missing}
        dcp.load(present, storage_reader=reader(url), planner=SafeLoadPlanner(), process_group=self.group,
                 no_dist=self.group is None)
        set_model_state_dict(self.module, module_keys(present["model"], back["model"]))
        if self.optimizer is not None:
            set_optimizer_state_dict(self.module, self.optimizer, module_keys(present["optim"], back["optim"]),
                                     options=state_dict_options())
        for name, obj in self.extra_state.items():
            if name in present:
                obj.load_state_dict(present[name])

    def _load_converted(self, step: int, manifest: dict, reader, url: str, state: dict, back: dict,
                        saved: set) -> None:
        """Load a checkpoint whose optimizer state lives in the other home (see checkpoint_reshard)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        from workbench.models import build_model_meta

        # check_resume made the writer's model this run's: build it from our spec, never from the file's
        writer_model = build_model_meta(self._loaded_spec())
        order = [(n, p.shape) for n, p in writer_model.named_parameters() if p.requires_grad]
        optimizer = self.spec.get("train", {}).get("optimizer", "adamw")
        dist_kwargs = {"process_group": self.group, "no_dist": self.group is None}
        canonical = load_canonical(reader, url, manifest, order, optimizer, **dist_kwargs)
        weights = {k: local_part(canonical.weights[k], v) for k, v in state["model"].items()}
        set_model_state_dict(self.module, module_keys(weights, back["model"]))
        if self.optimizer is not None:
            optim = module_keys(fill_optim(state["optim"], canonical, optimizer), back["optim"])
            set_optimizer_state_dict(self.module, self.optimizer, optim, options=state_dict_options())
        master = self.extra_state.get("master")
        if master is not None:
            master.load_state_dict(master_state(master, canonical))
        if "scaler" in state and "scaler" in saved:
            scaler = {"scaler": state["scaler"]}
            dcp.load(scaler, storage_reader=reader(url), planner=SafeLoadPlanner(), **dist_kwargs)
            self.extra_state["scaler"].load_state_dict(scaler["scaler"])
        self._warn(f"the checkpoint of step {step} keeps its optimizer state in {home(saved)!r}, this run in "
                   f"{home(set(state))!r} ({layout_diff(manifest.get('layout', {}), self.spec.get('layout', {}))}): "
                   "converted through full fp32 weights and moments")

    def _state_dict(self) -> tuple[dict, dict]:
        """(this rank's state keyed as saved, the way back to the modules' keys: checkpoint_state.saved_keys)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:  # the optimizer state lives in an extra (an fp32 master)
            state = {"model": get_model_state_dict(self.module)}
        else:
            model_sd, optim_sd = get_state_dict(self.module, self.optimizer, options=state_dict_options())
            state = {"model": model_sd, "optim": optim_sd}
        for name, obj in self.extra_state.items():
            state[name] = obj.state_dict()
        return saved_keys(state, self.names)

    # -- collectives on the checkpoint group ----------------------------------------------
    def _gather(self, obj) -> list:
        if self.group is None:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _broadcast(self, obj):
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _warn(self, message: str) -> None:
        if self.rank == 0:
            warnings.warn(message, CheckpointWarning, stacklevel=2)
            if self._warn_cb is not None:
                self._warn_cb(message)


def _recording(writer):
    """`writer` that also remembers the files this rank wrote (DCP's write results)."""
    results = []
    write_data = writer.write_data

    def recorded(plan, planner):
        future = write_data(plan, planner)
        results.append(future)
        return future

    writer.write_data = recorded
    writer.written = lambda: sorted({r.storage_data.relative_path for f in results for r in f.wait()})
    return writer


def build_checkpointer(spec, modules: list[nn.Module], optimizer: torch.optim.Optimizer | None,
                       sink: Callable[[dict], None], extra_state: dict | None = None) -> Checkpointer:
    """The loop's Checkpointer: `checkpoint` and `warning` events go to `sink` (from rank 0)."""
    return Checkpointer(spec.to_dict(), modules, optimizer, extra_state=extra_state, loaded=spec,
                        on_saved=lambda step, url: sink({"event": "checkpoint", "step": step, "uri": url}),
                        warn=lambda message: sink({"event": "warning", "message": message}))
