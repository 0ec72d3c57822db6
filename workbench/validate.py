"""Cross-field rules of a JobSpec, checked before any worker starts.

Each rule raises a ConfigError built from the same numbers the runtime will use: the rule, the
numbers, and a fix.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from workbench.catalog import DEVICES
from workbench.errors import ConfigError, did_you_mean
from workbench.parallelism import Parallelism, num_micro_batches
from workbench.spec_input import MAX_PP, clip

if TYPE_CHECKING:
    from workbench.spec_fields import JobFields, ModelSpec


def _factorizations(n: int) -> str:
    """A few (dp, tp, pp) products equal to n, for error messages."""
    out = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            if n % (tp * pp) == 0:
                out.append(f"dp={n // (tp * pp)}, tp={tp}, pp={pp}")
    return "; ".join(out[:3])


def validate_spec(spec: JobFields, layout: bool = True) -> None:
    """Raise ConfigError for the first rule the spec breaks (structure is checked by pydantic).

    layout=False skips the rules of the layout itself (for `plan`, which searches layouts).
    """
    _check_bounds(spec, layout)
    _check_model(spec)
    _check_resources(spec, layout)
    if layout:
        _check_layout(spec)
        _check_batch(spec)
    _check_backend(spec)
    _check_training(spec)


def _check_bounds(spec: JobFields, layout: bool = True) -> None:
    """Products of bounded fields stay bounded (each field's own bound is in spec_fields.py)."""
    from workbench.spec_input import MAX_RANKS

    r, lay = spec.resources, spec.layout
    if r.num_gpus > MAX_RANKS:
        raise ConfigError(f"resources: nodes({r.nodes}) x gpus_per_node({r.gpus_per_node}) = {r.num_gpus:,} GPUs, more "
                          f"than {MAX_RANKS:,}, beyond any real run (and what planning prices per rank). Use at most "
                          f"{MAX_RANKS:,} GPUs.")
    if not layout:
        return
    if lay.world_size > MAX_RANKS:
        raise ConfigError(f"layout: dp({lay.dp}) x tp({lay.tp}) x pp({lay.pp}) = {lay.world_size:,} ranks, more than "
                          f"{MAX_RANKS:,}, beyond any real run. Use degrees whose product is at most {MAX_RANKS:,}.")
    check_stage_bound(Parallelism.from_spec(spec))


def check_stage_bound(par: Parallelism) -> None:
    """At most MAX_PP pipeline stages (pp x virtual stages)."""
    stages = par.num_stages
    if stages > MAX_PP:
        raise ConfigError(f"layout: pp({par.pp}) x virtual_stages({par.virtual_stages}) = {stages:,} pipeline stages, "
                          f"more than {MAX_PP:,}; each holds a block and the deepest published models have ~130. "
                          f"Use at most {MAX_PP:,} stages.")


def _check_model(spec: JobFields) -> None:
    m = spec.model
    kinds = [k for k, v in (("preset", m.preset), ("params", m.params), ("factory", m.factory)) if v is not None]
    if "preset" in kinds and len(kinds) > 1:
        raise ConfigError(f"model: give one of preset, params or factory, not {' and '.join(kinds)} "
                          "(params may stand beside a factory: the size planning uses without running it).")
    if m.factory is not None:
        from workbench.factory import check_origin

        check_origin(m.factory)  # finds the module without running any of its code
        token_dims(m)  # a factory gives vocab and seq_len itself
        return
    if m.params is not None:
        return
    m.shape()  # raises ConfigError for unknown presets / incomplete shapes


def _check_resources(spec: JobFields, layout: bool = True) -> None:
    r = spec.resources
    if r.gpu not in DEVICES:
        hint = did_you_mean(r.gpu, DEVICES)
        raise ConfigError(f"resources.gpu: unknown GPU type {r.gpu!r}.{hint} Known types: {', '.join(DEVICES)}.")
    lay = spec.layout
    if layout and lay.world_size != r.num_gpus:
        raise ConfigError(
            f"dp({lay.dp}) x tp({lay.tp}) x pp({lay.pp}) = {lay.world_size} ranks, but resources give "
            f"{r.num_gpus} GPUs ({r.nodes} node(s) x {r.gpus_per_node}). Use degrees whose product is "
            f"{r.num_gpus} (e.g. {_factorizations(r.num_gpus)}), or set resources.gpus_per_node/nodes "
            f"to give {lay.world_size}."
        )


def _check_layout(spec: JobFields) -> None:
    lay, m = spec.layout, spec.model
    if m.factory is not None:
        if lay.tp > 1 or lay.pp > 1:
            raise ConfigError(
                f"layout: tp={lay.tp}, pp={lay.pp} need the built-in GPT family (its block structure is what "
                "gets split); a factory model runs with data parallelism (dp, zero) only. Set tp=1 and pp=1."
            )
        return
    if m.params is not None:
        return
    shape = m.shape()
    check_tp_divides(shape, lay.tp)
    check_stages(shape, Parallelism.from_spec(spec))
    if lay.activation_checkpointing == "selective" and "checkpoint_every" in lay.model_fields_set \
            and lay.checkpoint_every != 1:
        raise ConfigError(
            f"layout.activation_checkpointing=selective with checkpoint_every={lay.checkpoint_every}: selective now "
            "recomputes the attention core of every block (Korthikanti et al. 2022), and checkpoint_every belongs "
            f"to full. For whole blocks every {lay.checkpoint_every}th (what selective meant before), use "
            f"activation_checkpointing: full, checkpoint_every: {lay.checkpoint_every}.")


def check_layout_rules(shape, par: Parallelism, global_batch: int, explicit_split: bool = False) -> None:
    """Every rule of a layout over a model's shape and batch that `validate` and `run` enforce, on
    plain values, in the order they check them: at most MAX_PP stages, tp divides the widths, each
    stage holds a block, the batch splits into the schedule's micro-batches, and the combinations
    the runtime runs (check_runnable). The step-time model and the planner ask these, so they
    refuse exactly what `validate` + `run` refuse, with the same ConfigError.

    Args:
        shape: ModelShape.
        par: the layout and batch split (a Parallelism, e.g. the planner's memory.Layout).
        global_batch: sequences per step.
        explicit_split: the stages' blocks are given (a published run's engine split its own way, which
            may leave a stage only the embedding or the head), so "each stage holds a block" is not asked.
    Raises:
        ConfigError: the first rule broken, with its numbers and a fix.
    """
    check_stage_bound(par)
    check_tp_divides(shape, par.tp)
    if not explicit_split:
        check_stages(shape, par)
    check_batch_split(par, global_batch)
    check_dp_combinations(par)
    check_model_parallel(par, shape.seq_len)


def check_tp_divides(shape, tp: int) -> None:
    """tp divides heads, KV heads, hidden and the MLP width (each tp rank takes 1/tp of each)."""
    for name, value in (("heads", shape.heads), ("kv_heads", shape.kv_heads), ("hidden", shape.hidden),
                        ("ffn_hidden", shape.ffn_hidden)):
        if value % tp:
            raise ConfigError(
                f"layout.tp({tp}) must divide model.{name}({value}): each tensor-parallel rank takes "
                f"{name}/tp of it. Use tp in {[d for d in (1, 2, 4, 8) if value % d == 0]}."
            )


def check_stages(shape, par: Parallelism) -> None:
    """Each (virtual) pipeline stage holds at least one block."""
    stages = par.num_stages
    if stages > shape.layers:
        raise ConfigError(
            f"layout: {stages} pipeline stages (pp={par.pp}"
            + (f" x virtual_stages={par.virtual_stages}" if stages != par.pp else "")
            + f") but the model has {shape.layers} layers; each stage needs at least one block. "
            f"Use pp <= {shape.layers}."
        )


def _check_batch(spec: JobFields) -> None:
    check_batch_split(Parallelism.from_spec(spec), spec.train.global_batch)


def check_batch_split(par: Parallelism, global_batch: int) -> None:
    """The global batch splits into dp x micro_batch, and into the micro-batches the pipeline
    schedule runs (at least pp for all but GPipe; whole rounds of pp for the multi-stage ones)."""
    per_step = par.dp * par.micro_batch
    if global_batch % per_step:
        lo = max(per_step, global_batch // per_step * per_step)
        raise ConfigError(
            f"train.global_batch({global_batch}) must be divisible by dp({par.dp}) x micro_batch({par.micro_batch}) "
            f"= {per_step}. Use global_batch={lo} or {lo + per_step}, or change micro_batch."
        )
    num_micro = num_micro_batches(global_batch, par.dp, par.micro_batch)
    if par.pp > 1 and num_micro < par.pp and par.pp_schedule != "gpipe":
        raise ConfigError(
            f"layout.pp_schedule={par.pp_schedule} needs at least pp({par.pp}) micro-batches per step, but "
            f"global_batch({global_batch}) / (dp({par.dp}) x micro_batch({par.micro_batch})) = {num_micro}. "
            f"Raise global_batch to {par.pp * per_step} or lower micro_batch."
        )
    rounds = max(1, num_micro // par.pp)
    if par.multi_stage and num_micro % rounds:
        fits = [n for n in range(par.pp, 4 * par.pp + 1) if n % max(1, n // par.pp) == 0]
        raise ConfigError(
            f"layout.pp_schedule={par.pp_schedule} runs micro-batches in rounds of pp({par.pp}): it needs "
            f"micro-batches per step divisible by max(1, micro-batches // pp) = {rounds}, but global_batch"
            f"({global_batch}) / (dp({par.dp}) x micro_batch({par.micro_batch})) = {num_micro}. Use a count "
            f"such as {fits[:4]} (e.g. a multiple of pp)."
        )


def _check_backend(spec: JobFields) -> None:
    b = spec.backend
    if b.spot and b.name in ("sagemaker", "vertex", "azureml"):
        if spec.checkpoint.every_steps == 0 and spec.checkpoint.every_minutes == 0:
            raise ConfigError(
                "backend.spot=true without checkpoints: a preemption would lose the whole run. Set "
                "checkpoint.every_steps (e.g. 100) or checkpoint.every_minutes (e.g. 10)."
            )
        if b.max_wait_s < b.max_runtime_s:
            raise ConfigError(
                f"backend.max_wait_s({b.max_wait_s}) must be >= max_runtime_s({b.max_runtime_s}) with spot: "
                f"it is the total time including waiting for capacity. Use max_wait_s >= {b.max_runtime_s}."
            )


def check_runnable(spec: JobFields, read_remote_data: bool = True) -> None:
    """Rules for running (not just planning) a spec in this release. `read_remote_data` False (a
    cloud backend's check, dry-runs included): token shards at an object-store URI are not read from
    this machine, which may have neither the credentials nor the network the job has; the job makes
    the same check when it starts."""
    if spec.model.params is not None and spec.model.factory is None:
        raise ConfigError(
            f"model: {{params: {spec.model.params:g}}} is a size alone, for planning (workbench memory/plan). "
            "To run, give a preset or a shape, e.g. model: {preset: gpt-tiny}."
        )
    lay = spec.layout
    check_dp_combinations(lay)
    check_model_parallel(lay, spec.model.shape().seq_len if lay.tp > 1 and lay.sequence_parallel else 0)
    path = spec.data.path or ""
    remote = "://" in path and not path.startswith("file://")
    if spec.data.source == "tokens" and (read_remote_data or not remote):  # the shards exist, fit the vocabulary and the split
        from workbench.shards import open_token_data

        d = spec.data
        open_token_data(d.path, *token_dims(spec.model), d.val_fraction, d.packing)


def token_dims(m: ModelSpec) -> tuple[int, int]:
    """(vocab, seq_len) the data must fit: a factory's own fields, else the resolved shape's.

    Raises:
        ConfigError: a factory without vocab or seq_len, or a shape that does not resolve.
    """
    if m.factory is not None:
        if m.vocab is None or m.seq_len is None:
            raise ConfigError("model.factory: also give vocab and seq_len so the data pipeline can feed the model, "
                              "e.g. model: {factory: 'mypkg.models:build', vocab: 256, seq_len: 64}.")
        return m.vocab, m.seq_len
    shape = m.shape()
    return shape.vocab, shape.seq_len


def check_dp_combinations(lay) -> None:
    """ZeRO / offload / precision combinations the runtime cannot do (docs/strategies.md); `lay`: the
    spec's layout or a Parallelism."""
    if lay.offload == "cpu" and lay.zero < 2:
        raise ConfigError(
            f"layout.offload=cpu with zero={lay.zero}: CPU offload is FSDP2's CPUOffloadPolicy, which needs the "
            "parameters sharded by FSDP2. Use zero=2 or zero=3 with offload=cpu, or offload=nvme (any zero)."
        )
    if lay.offload == "nvme" and lay.zero >= 2 and (lay.pp > 1 or lay.tp > 1):
        raise ConfigError(
            f"layout.offload=nvme with zero={lay.zero}, tp={lay.tp}, pp={lay.pp}: the shards' files and their "
            "prefetch hooks follow one model's blocks in forward order over 1-D (dp) FSDP2 shards; pipeline stages "
            "and 2-D (dp x tp) shards are not built in this release. Use tp=1 and pp=1 with "
            f"zero={lay.zero} and nvme, or zero=1 with nvme under tensor/pipeline parallelism.")
    if (lay.zero >= 2 or lay.offload == "cpu") and lay.world_size == 1:
        raise ConfigError(
            f"layout.zero={lay.zero}, offload={lay.offload} on a single rank: FSDP2 shards over a process group "
            "and one rank has nothing to shard with. Use zero=0 or 1 (offload=none or nvme) on one rank, or dp>=2."
        )


def check_model_parallel(lay, seq: int) -> None:
    """What tensor/pipeline parallel cannot run with, each with the reason and a fix; `lay`: the spec's
    layout or a Parallelism, `seq`: the model's sequence length (read with sequence parallelism only)."""
    if lay.tp == 1 and lay.sequence_parallel:  # under pp too: nothing would shard, silently
        raise ConfigError("layout.sequence_parallel=true shards activations across tensor-parallel ranks, "
                          "but tp=1. Set tp >= 2 or sequence_parallel: false.")
    if lay.tp == 1 and lay.pp == 1:
        return
    if lay.tp > 1 and lay.sequence_parallel:
        if seq % lay.tp:
            raise ConfigError(
                f"layout.sequence_parallel with tp({lay.tp}) splits each sequence into tp equal parts, but "
                f"model.seq_len({seq}) is not divisible by {lay.tp}. Use a seq_len that is a multiple of {lay.tp}, "
                "or sequence_parallel: false.")
    if lay.zero > 0 and lay.dp == 1:
        raise ConfigError(
            f"layout.zero={lay.zero} with dp=1: ZeRO shards over the data-parallel ranks and tp({lay.tp}) x "
            f"pp({lay.pp}) leaves one. Set zero=0, or use dp >= 2.")
    if zero_bubble_refused(lay.pp, lay.zero, lay.pp_schedule):
        raise ConfigError(
            "layout.zero=3 with pp_schedule=zero-bubble: torch 2.13's zero-bubble schedule computes weight "
            "gradients in a separate W pass (torch.autograd.grad, outside the FSDP2 hooks), and with FSDP2 "
            "resharding the blocks after every forward (zero=3) the first step's weight gradients come out wrong "
            "(measured on gpt-tiny, dp2 x pp2: step 1 exact, step 2 off by 0.1%, 0.6% after 5 steps; zero=2 with "
            "zero-bubble and zero=3 with interleaved-1f1b are exact). FSDP2 unshard/reshard under torch's pipeline "
            "schedules is pytorch/pytorch#164756. Use zero=2, or pp_schedule=1f1b / interleaved-1f1b with zero=3.")


def zero_bubble_refused(pp: int, zero: int, schedule: str) -> bool:
    """zero=3 under the zero-bubble pipeline schedule drifts in torch 2.13 (see the ConfigError above);
    the planner asks this too, so it never ranks what the runtime refuses."""
    return pp > 1 and zero == 3 and schedule == "zero-bubble"


def check_resume(spec: JobFields, old: JobFields) -> list[str]:
    """Can `spec` continue from a checkpoint written by the spec `old`?

    The model's shape and the optimizer must match (their state is what the checkpoint holds);
    the layout, world size and precision may differ (the checkpoint is resharded, or converted
    between an fp32 master and a torch optimizer: runtime/checkpoint_reshard.py). Other differences that
    change the data or the numerics are allowed but reported.
    Returns:
        Notes on allowed differences that make the resumed run differ from an uninterrupted one.
    Raises:
        ConfigError: an incompatible difference, named with both values and a fix.
    """
    if old.name != spec.name:  # another job: it would continue that job's weights, and mix its steps into that folder
        raise ConfigError(
            f"cannot resume: the checkpoints under {spec.checkpoint.uri} belong to the job {clip(repr(old.name), 100)}, "
            f"and this spec is the job {clip(repr(spec.name), 100)}. Resuming would continue the other job's weights "
            "and optimizer state and write this job's steps among its checkpoints. Give this job a checkpoint.uri of "
            "its own; to start from those weights, use model.init: checkpoint with model.path set to that URI; if "
            f"this is the same job renamed, set name: {clip(repr(old.name), 100)}.")
    diffs = [(f"model.{k}", a, b) for k, a, b in _model_identity(old, spec)]
    if old.train.optimizer != spec.train.optimizer:  # the optimizer state's moments depend on it
        diffs.append(("train.optimizer", old.train.optimizer, spec.train.optimizer))
    if diffs:
        listed = "; ".join(f"{k}: checkpoint has {a!r}, this spec has {b!r}" for k, a, b in diffs)
        raise ConfigError(
            f"cannot resume: the checkpoint was written by an incompatible spec ({listed}). A checkpoint holds "
            "the model's and optimizer's state, so these must match (the layout may change). Restore those "
            "values, or start a fresh run without --resume (or with another checkpoint.uri).")
    notes = []
    for key, a, b in (("data", old.data.model_dump(),
                       spec.data.model_dump()),
                      ("train.global_batch", old.train.global_batch, spec.train.global_batch),
                      ("precision.dtype", old.precision.dtype, spec.precision.dtype)):
        if a != b:
            notes.append(f"resuming with {key} changed ({a!r} -> {b!r}): the run continues, but not on the "
                         "exact curve of the original run")
    return notes


def _model_identity(old: JobFields, new: JobFields) -> list[tuple[str, object, object]]:
    """Differences between the two specs' model architectures: [(field, old, new)]."""
    if old.model.factory or new.model.factory:
        a = (old.model.factory, old.model.kwargs)
        b = (new.model.factory, new.model.kwargs)
        return [] if a == b else [("factory", a, b)]
    sa, sb = old.model.shape(), new.model.shape()
    return [(f, getattr(sa, f), getattr(sb, f)) for f in sa.__dataclass_fields__ if getattr(sa, f) != getattr(sb, f)]


def _check_training(spec: JobFields) -> None:
    """Schedule, evaluation and tracking rules (workbench/schedule.py, docs/training.md)."""
    from workbench.schedule import check_schedule

    check_schedule(spec.train)
    if spec.train.eval_every and spec.data.source != "synthetic" and spec.data.val_fraction <= 0:
        raise ConfigError(f"train.eval_every={spec.train.eval_every} needs held-out data, but data.val_fraction is 0. "
                          "Set data.val_fraction (e.g. 0.05) or eval_every=0.")
    _check_urls(spec.to_dict())


# Query or fragment parameters that carry a credential (pre-signed S3/GCS URLs, Azure SAS, OAuth and
# API tokens), by a part of their name after lower-casing and '-' -> '_'.
_CREDENTIAL_PARTS = ("sig", "token", "key", "secret", "password", "passwd", "auth", "credential", "session", "jwt")
_CREDENTIAL_NAMES = {"code", "pwd"}
# Storage schemes whose user part names a container (abfs://container@account.dfs.core.windows.net);
# on every other scheme (https, git+https, ssh, ray, ...) a user part is a person or a token.
_CONTAINER_SCHEMES = {"abfs", "abfss", "az", "wasb", "wasbs"}
_FIXES = {"tracking.mlflow": "set MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in "
                             "the environment instead",
          "backend.ray.address": "set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) in the environment instead"}


def url_credentials(raw: str) -> list[tuple[str, str, str]]:
    """The credentials a URL carries, as (part, name, value): ("password", "", ...), ("user", "", ...)
    for a user part outside `_CONTAINER_SCHEMES`, ("query", name, ...) for a query or fragment
    parameter named like a credential. One rule for the spec (`_check_urls`) and for the files a
    bundle ships (backends/secret_plugins.py).

    Raises:
        ValueError: not a well-formed URL.
    """
    from urllib.parse import parse_qsl, urlsplit

    url = urlsplit(raw)
    password, user = url.password, url.username
    found = []
    if password is not None:
        found.append(("password", "", password))
    elif user and url.scheme.lower() not in _CONTAINER_SCHEMES:
        found.append(("user", "", user))
    for part in (url.query, url.fragment):
        for name, value in parse_qsl(part.replace(";", "&"), keep_blank_values=True):
            key = name.lower().replace("-", "_")
            if key in _CREDENTIAL_NAMES or any(p in key for p in _CREDENTIAL_PARTS):
                found.append(("query", key, value))
    return found


def _check_urls(raw, path: str = "") -> None:
    """No URL anywhere in the spec carries a credential (`url_credentials`): the spec travels
    (bundles, dry-runs, manifests, reports). The refusal never quotes the URL."""
    if isinstance(raw, dict):
        for key, value in raw.items():
            _check_urls(value, f"{path}.{key}" if path else str(key))
    elif isinstance(raw, list):
        for i, value in enumerate(raw):
            _check_urls(value, f"{path}[{i}]")
    elif isinstance(raw, str) and "://" in raw:
        fix = _FIXES.get(path, "give the credential through the environment or the platform's secret store")
        try:
            found = url_credentials(raw)
        except ValueError:
            raise ConfigError(f"{path}: a value with '://' that is not a well-formed URL, so its parts cannot be "
                              "checked for credentials (it is not shown here). Give a well-formed URL.") from None
        parts = {part for part, _, _ in found}
        params = sorted({name for part, name, _ in found if part == "query"})
        if found:
            what = ("a password" if "password" in parts else f"a credential in its query ({', '.join(params)})"
                    if params else "a user name, which is often a token")
            raise ConfigError(f"{path}: the URL carries {what}, which would travel with the spec (bundles, dry-runs, "
                              f"checkpoint manifests, reports). Remove it and {fix}.")
