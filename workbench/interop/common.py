"""Shared pieces of the config translators: the warning list, flattening, and what a spec leaves unsaid.

Every translator returns its result together with a list of warnings, one per key that has no
counterpart on the other side, each naming the key, so nothing is ever dropped in silence.
Torch-free on purpose: importing a config must not need the training stack.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from workbench.parallelism import Parallelism, is_multi_stage

# The optimizer and loss-scaler constants our runtime uses (workbench/parallel/step.py and
# precision.DynamicLossScaler). Kept here as plain numbers so this package never imports torch;
# tests/unit/test_interop.py checks that they stay equal to the runtime's.
ADAM_BETAS, ADAM_EPS, SGD_MOMENTUM = (0.9, 0.999), 1e-8, 0.9
LOSS_SCALE_WINDOW = 2000  # steps without overflow before the fp16 loss scale doubles; halves on any overflow


def scaled(ratio: float, lr: float) -> float:
    """ratio x lr without the last-digit noise of the product (min_lr from an engine's min-lr ratio)."""
    return float(f"{ratio * lr:.12g}")


def lag_note(engine: str, counter: str) -> str:
    """The one difference every mapped decaying or warming schedule keeps: which step the formula is read at."""
    return (f"the learning-rate schedule is the same formula, but {engine} evaluates it at {counter}, "
            "so its rate can trail ours by a step")
ENGINES = ("deepspeed", "accelerate", "megatron", "torchtitan")
_SECRET = re.compile(r"(token|key|secret|password|passwd|credentials?)$|secret|password", re.I)


class Notes:
    """The warnings of one translation, one line per key."""

    def __init__(self, engine: str):
        self.engine = engine
        self.lines: list[str] = []

    def unmapped(self, key: str, value: Any, why: str = "") -> None:
        """A key of the engine's config that has no meaning in a workbench spec."""
        reason = f": {why}" if why else ": no counterpart in the workbench spec"
        if _SECRET.search(key):
            value = "<redacted>"  # warnings reach terminals and logs; secrets never do
        self.lines.append(f"{self.engine} key {key!r} = {value!r} not mapped{reason}")

    def unexpressed(self, key: str, value: Any, why: str = "") -> None:
        """A spec field the engine's config cannot say."""
        reason = f": {why}" if why else f": {self.engine} has no setting for it"
        self.lines.append(f"spec {key} = {value!r} not exported{reason}")

    def note(self, text: str) -> None:
        """A mapped key whose meaning differs in a way the reader should know."""
        self.lines.append(f"{self.engine}: {text}")

    def unmapped_rest(self, flat: dict[str, Any], used: Iterable[str], why: dict[str, str] | None = None) -> None:
        """Warn for every key of `flat` not in `used` that sets something (None/False/empty set nothing).

        `why` gives a reason per key prefix, e.g. {"scheduler": "the spec's learning rate is constant"}.
        """
        used, why = set(used), why or {}
        for key, value in flat.items():
            if key not in used and not _unset(value):
                prefix = next((p for p in why if key == p or key.startswith(p + ".")), None)
                self.unmapped(key, value, why.get(prefix, ""))


def _unset(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, (list, dict, str)) and not value)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and scalars are leaves."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def set_path(raw: dict, key: str, value: Any) -> None:
    """raw["a"]["b"] = value for key "a.b", creating sections on the way."""
    *parents, leaf = key.split(".")
    for p in parents:
        raw = raw.setdefault(p, {})
    raw[leaf] = value


def unexpressed_fields(spec, expressed: Iterable[str], notes: Notes, why: dict[str, str] | None = None) -> None:
    """Warn for each field of `spec` that differs from the default, matters, and the engine cannot say.

    Args:
        spec: a validated JobSpec.
        expressed: dotted spec keys the exporter wrote (prefixes cover whole sections).
        why: optional reasons per dotted key or section name.
    """
    from workbench.spec import JobSpec

    expressed, why = tuple(expressed), why or {}
    defaults = flatten(JobSpec().to_dict())
    for key, value in flatten(spec.to_dict()).items():
        if value == defaults.get(key, object()) or key in _inert(spec):
            continue
        if any(key == e or key.startswith(e + ".") for e in expressed):
            continue
        notes.unexpressed(key, value, why.get(key) or why.get(key.split(".")[0], ""))


def _inert(spec) -> set[str]:
    """Fields whose value changes nothing given the others (e.g. nvme_path without offload=nvme)."""
    lay, res, out = spec.layout, spec.resources, set()
    if res.gpus_per_node == -(-lay.world_size // res.nodes):
        out.add("resources.gpus_per_node")  # what load_spec derives from the layout anyway
    if lay.offload != "nvme":
        out.add("layout.nvme_path")
    if lay.activation_checkpointing != "full":
        out.add("layout.checkpoint_every")
    if lay.pp == 1:
        out |= {"layout.pp_schedule", "layout.virtual_stages"}
    elif not is_multi_stage(lay.pp_schedule):
        out.add("layout.virtual_stages")
    if spec.train.schedule == "constant":
        out.add("train.min_lr")  # a constant rate never decays to it
    if spec.precision.dtype != "fp16":
        out.add("precision.initial_loss_scale")
    if lay.dp == 1 or (lay.zero >= 2 and lay.offload == "nvme"):  # Parallelism.fsdp_unit_mb
        out.add("layout.bucket_mb")
    return out


def said(spec, key: str) -> bool:
    """Whether the spec says `key` ("train.lr"): set explicitly, or different from the default.

    An export writes what the spec says; a field the spec leaves at its default was never stated
    (e.g. imported from a config that left it to the training script), so writing it would invent it.
    """
    section, name = key.split(".", 1)
    sec = getattr(spec, section)
    return name in sec.model_fields_set or getattr(sec, name) != getattr(type(sec)(), name)


def batch_split(spec) -> tuple[int, int]:
    """(micro_batch, accumulation steps per dp rank) of a validated spec."""
    par = Parallelism.from_spec(spec)
    return par.micro_batch, par.num_micro
