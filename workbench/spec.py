"""The job spec: one typed object that describes a training job, from YAML, Python or a widget.

The same object travels unchanged to every backend (it round-trips through YAML/JSON), so what
you validated on your laptop is what runs on the cluster. `load_spec` is the only entry point
users need; it turns every mistake into a `ConfigError` that names the key, the rule and a fix.
The sections and their fields are in spec_fields.py (re-exported here), below validate.py, which
this module calls: no import goes back up.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from workbench.errors import ConfigError, did_you_mean
from workbench.spec_fields import (  # noqa: F401 - the sections are re-exported: `from workbench.spec import ModelSpec`
    AzureMLSection,
    BackendSpec,
    CheckpointSpec,
    DataSpec,
    JobFields,
    LayoutSpec,
    ModelSpec,
    PrecisionSpec,
    RaySection,
    ResourcesSpec,
    RopeScalingSpec,
    SageMakerSection,
    TrackingSpec,
    TrainSpec,
    VertexSection,
)
from workbench.spec_input import (  # noqa: F401 - the bounds are re-exported here, beside the fields
    MAX_BATCH,
    MAX_DEPTH,
    MAX_FFN,
    MAX_LAYERS,
    MAX_PARAMS,
    MAX_PP,
    MAX_RANKS,
    MAX_SEED,
    MAX_SEQ,
    MAX_STEPS,
    MAX_VOCAB,
    MAX_WIDTH,
    check_plain,
    clip,
    parse_yaml,
    read_spec_file,
)
from workbench.validate import validate_spec


class JobSpec(JobFields):
    """A whole training job (its fields: spec_fields.JobFields). Build it with `load_spec`; it
    validates itself there."""

    def replace(self, **overrides: Any) -> JobSpec:
        """A validated copy with dotted-key overrides, e.g. ``replace(**{"layout.dp": 4})``."""
        return load_spec(apply_overrides(self.to_dict(), [f"{k}={json.dumps(v)}" for k, v in overrides.items()]))


# -- loading --------------------------------------------------------------------------------

def _untrusted(raw, source) -> dict:
    """A spec file cannot trust its own factory: like transformers' trust_remote_code, the opt-in
    is the caller's (--trust-factory, --set, or the spec built in Python), never the shared file's."""
    model = raw.get("model") if isinstance(raw, dict) else None
    if not isinstance(model, dict) or not model.get("trust_factory"):
        return raw
    import warnings

    warnings.warn(f"{source}: model.trust_factory in a spec file is ignored; a file cannot vouch for its own "
                  "factory. Pass --trust-factory (or --set model.trust_factory=true) if you trust it.", stacklevel=3)
    return {**raw, "model": {k: v for k, v in model.items() if k != "trust_factory"}}


def load_spec(source: str | Path | dict | JobSpec, overrides: list[str] | None = None, *,
              layout: bool = True) -> JobSpec:
    """Load, override and validate a spec.

    Args:
        source: a YAML/JSON path, a dict, or a JobSpec.
        overrides: ``["layout.dp=4", ...]`` applied before validation.
        layout: False skips the layout's rules (degrees vs resources, batch split): `plan`
            searches layouts, so it needs only the model, resources and batch to be valid.
    Returns:
        A validated JobSpec.
    Raises:
        ConfigError: anything wrong with the spec, with the rule, the numbers and a fix.
    """
    if isinstance(source, JobSpec):
        raw = source.to_dict()
    elif isinstance(source, dict):
        raw = source
    elif isinstance(source, (str, Path)):
        if isinstance(source, str) and not source.strip():
            raise ConfigError("no spec file given. Pass the path of a YAML spec, e.g. examples/quickstart.yaml.")
        if isinstance(source, str) and ("\0" in source or len(source) > 4096):
            raise ConfigError(f"spec path {clip(repr(source), 200)}: not a file path (a NUL byte, or longer "
                              "than 4,096 characters). Pass the path of a YAML spec.")
        raw = _untrusted(read_spec_file(Path(source)), source)
    else:
        raise ConfigError(f"a spec is a YAML/JSON path, a dict or a JobSpec, not {_type_name(source)}. "
                          "E.g. load_spec('examples/quickstart.yaml').")
    if overrides is not None and (not isinstance(overrides, (list, tuple))
                                  or not all(isinstance(o, str) for o in overrides)):
        raise ConfigError(f"overrides: a list of 'key.path=value' strings, not {_short_repr(overrides)}; "
                          "e.g. ['layout.dp=4'].")
    if not isinstance(raw, dict):
        raise ConfigError(f"a spec must be a mapping of sections (name, model, layout, ...), got {type(raw).__name__}.")
    check_plain(raw)
    if overrides:
        raw = apply_overrides(raw, list(overrides))
        check_plain(raw)
    raw = _default_gpus(raw)
    try:
        spec = JobSpec.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_explain(e)) from None
    validate_spec(spec, layout=layout)
    return spec


def _default_gpus(raw: dict) -> dict:
    """Without resources.gpus_per_node, ask for exactly the GPUs the layout needs."""
    res, lay = raw.get("resources"), raw.get("layout")
    if res is not None and not isinstance(res, dict) or lay is not None and not isinstance(lay, dict):
        return raw  # pydantic reports the type error
    if res and "gpus_per_node" in res:
        return raw
    lay = lay or {}
    try:
        world = int(lay.get("dp", 1)) * int(lay.get("tp", 1)) * int(lay.get("pp", 1))
        nodes = int((res or {}).get("nodes", 1))
    except (TypeError, ValueError, OverflowError):  # text, .inf, NaN: pydantic names the field
        return raw
    if world <= 0 or nodes <= 0:
        return raw
    return {**raw, "resources": {**(res or {}), "gpus_per_node": max(1, -(-world // nodes))}}


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML) to a copy of a raw spec dict."""
    out = json.loads(json.dumps(raw))
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {clip(item, 200)!r}: expected key.path=value, e.g. --set layout.dp=4.")
        try:
            value = parse_yaml(text, f"--set {clip(item, 200)!r}")
        except ConfigError as e:
            if "not valid YAML" not in str(e):
                raise  # a bomb or bad text, not merely a plain string
            value = text
        check_plain(value, f"--set {clip(key.strip(), 200)}")
        node = out
        parts = key.strip().split(".")
        if len(parts) > MAX_DEPTH:
            raise ConfigError(f"--set {clip(key.strip(), 200)!r}: a key path of {len(parts):,} parts; a spec nests at "
                              f"most {MAX_DEPTH} deep (e.g. --set layout.dp=4).")
        if not all(parts):
            raise ConfigError(f"--set {clip(item, 200)!r}: the key path {clip(key.strip(), 200)!r} has an empty part "
                              "(a leading, trailing or doubled dot). Write section.key=value, e.g. --set layout.dp=4.")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {clip(item, 200)!r}: {part!r} is a value, not a section.")
            node = child
        node[parts[-1]] = value
    return out


def _known_keys(loc: tuple) -> list[str]:
    model: type[BaseModel] = JobSpec
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def _type_name(value: Any) -> str:
    return f"a value of type {type(value).__name__}"


def _short_repr(value: Any, limit: int = 80) -> str:
    """repr of `value` cut to about `limit` characters without building the whole repr first
    (a list of aliases to one long string would be gigabytes)."""
    if isinstance(value, str):
        return clip(repr(value[: limit + 1]), limit) if len(value) > limit else repr(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_short_repr(v, 20) for v in value[:4])
        more = f", … ({len(value)} items)" if len(value) > 4 else ""
        return f"[{inner}{more}]"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 100:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1:,} digits"
    if isinstance(value, (int, float, bool, type(None))):
        return clip(repr(value), limit)
    return _type_name(value)


# Why a bound exists, added to its refusal (docs/testing.md, "Bounds").
_GPUS = "a job of more than 131,072 GPUs is beyond any real run"
_BOUND_WHY = {
    "layout.dp": _GPUS, "layout.tp": _GPUS, "resources.nodes": _GPUS, "resources.gpus_per_node": _GPUS,
    "layout.pp": "each pipeline stage holds a block; the deepest published models have ~130",
    "layout.virtual_stages": "each pipeline stage holds a block; the deepest published models have ~130",
    "model.layers": "500x the deepest published LLM (Llama 3 405B: 126)",
    "model.hidden": "40x the widest published model", "model.heads": "at most one head per unit of width",
    "model.vocab": "60x the largest published vocabulary", "model.seq_len": "past the longest published contexts",
    "model.params": "500x the largest published dense model",
    "train.global_batch": "published runs use ~1,000-16,000 sequences per step",
}


def _explain(err: ValidationError) -> str:
    lines = []
    errors = err.errors()
    for e in errors[:20]:
        loc = tuple(e["loc"])
        where = ".".join(str(p) for p in loc) or "spec"
        if e["type"] == "extra_forbidden":
            known = _known_keys(loc)
            hint = did_you_mean(str(loc[-1]), known)
            lines.append(f"{where}: unknown key.{hint} Known keys here: {', '.join(known)}.")
        else:
            got = e.get("input")
            if e["type"] == "value_error":  # our own validators' messages name what they got
                lines.append(f"{where}: {e['ctx']['error']}.")
                continue
            got_text = "" if isinstance(got, dict) else f" (got {_short_repr(got)})"
            why = f": {_BOUND_WHY[where]}" if e["type"] == "less_than_equal" and where in _BOUND_WHY else ""
            lines.append(f"{where}: {e['msg']}{got_text}{why}.")
    if len(errors) > 20:
        lines.append(f"... and {len(errors) - 20:,} more")
    return clip("invalid spec:\n  " + "\n  ".join(lines))
