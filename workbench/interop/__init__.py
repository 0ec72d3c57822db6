"""Configs of the engines teams already run (DeepSpeed, Accelerate, Megatron-LM, torchtitan) in and out.

    spec, warnings = import_config("ds_config.json")          # format detected from the content
    text, warnings = export_config(spec, "torchtitan")        # the same job as a torchtitan TOML

Each warning names one key that has no counterpart on the other side; nothing is dropped silently.
The key-by-key tables are in docs/interop.md.
"""
from __future__ import annotations

import importlib
from pathlib import Path

from workbench.errors import ConfigError
from workbench.interop.common import ENGINES

__all__ = ["ENGINES", "detect_format", "import_config", "import_text", "export_config"]


def _engine(name: str):
    if name not in ENGINES:
        raise ConfigError(f"unknown config format {name!r}. Use one of: {', '.join(ENGINES)}.")
    return importlib.import_module(f"workbench.interop.{name}")


def detect_format(text: str, filename: str = "") -> str:
    """The engine a config text belongs to, from its content (the file suffix breaks ties).

    Raises:
        ConfigError: nothing in the text says which engine it is for.
    """
    head = text.lstrip()
    if head.startswith("{"):  # Accelerate also writes its config as JSON
        return "accelerate" if '"distributed_type"' in text else "deepspeed"
    if "--tensor-model-parallel-size" in text or "pretrain_gpt" in text or "--micro-batch-size" in text:
        return "megatron"
    if "distributed_type" in text or "compute_environment" in text:
        return "accelerate"
    if any(f"[{s}]" in text for s in ("parallelism", "training", "job", "model", "activation_checkpoint")):
        return "torchtitan"
    suffix = Path(filename).suffix.lower()
    by_suffix = {".json": "deepspeed", ".toml": "torchtitan", ".sh": "megatron", ".yaml": "accelerate", ".yml": "accelerate"}
    if suffix in by_suffix:
        return by_suffix[suffix]
    raise ConfigError(f"cannot tell which engine {filename or 'this config'} is for. Pass --format "
                      f"{'|'.join(ENGINES)}.")


def import_text(text: str, format: str | None = None, *, name: str = "job",
                overrides: list[str] | None = None, base: str | Path | None = None):
    """Translate an engine's config text into a validated JobSpec.

    Args:
        text: the config file's content.
        format: deepspeed | accelerate | megatron | torchtitan; None detects it.
        name: the job name (the engines' configs carry none that fits).
        overrides: ``["layout.dp=8", ...]`` applied before validation, for what the file leaves to
            the launcher (e.g. the world size).
        base: the config's folder, where files it names are read (an Accelerate deepspeed_config_file).
    Returns:
        (JobSpec, warnings): one warning per key that has no counterpart here.
    Raises:
        ConfigError: ill-formed input, or a mapped job the workbench cannot run (with the rule and a fix).
    """
    from workbench.spec import apply_overrides, load_spec
    from workbench.validate import check_runnable

    engine = _engine(format or detect_format(text))
    # The world size is often the launcher's, not the file's: a --set layout.dp=N fills it in
    # before batch sizes that scale with dp are derived.
    dp = apply_overrides({}, overrides or []).get("layout", {}).get("dp")
    label = engine.__name__.rsplit(".", 1)[-1]
    try:
        extra = {"base": Path(base) if base is not None else None} if label == "accelerate" else {}
        raw, warnings = engine.to_spec(engine.parse(text), dp=int(dp) if dp else None, **extra)
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError) as e:  # a number that is text, a section that is a value, ...
        raise ConfigError(f"the {label} config has a value of the wrong type ({e}). Fix that value; "
                          "docs/interop.md lists the keys read and what they must hold.") from None
    raw = {"name": name, **raw}
    _check_length(raw, overrides or [], label, warnings)
    try:
        spec = load_spec(apply_overrides(raw, overrides or []))
    except ConfigError as e:
        notes = [w for w in warnings if w.startswith(f"{label}:")]  # the assumptions may be the cause
        raise ConfigError(f"the {label} config maps to a spec the workbench refuses: {e}"
                          + "".join(f"\n  note: {n}" for n in notes)) from None
    try:  # a spec that only plans is still worth having (workbench memory/plan); say why it would not run
        check_runnable(spec)
    except ConfigError as e:
        warnings = warnings + [f"{label}: the imported job can be planned but not run as it is: {e}"]
    return spec, warnings


def _check_length(raw: dict, overrides: list[str], label: str, warnings: list[str]) -> None:
    """A warmup that the file states but a run length it leaves to the script: ask for the length, not a shorter warmup."""
    from workbench.spec import TrainSpec

    train = raw.get("train", {})
    given = "steps" in train or any(o.split("=", 1)[0].strip() == "train.steps" for o in overrides)
    warmup = train.get("warmup_steps", 0)
    if not given and isinstance(warmup, int) and warmup >= TrainSpec().steps:
        raise ConfigError(f"the {label} config warms the learning rate up over {warmup} steps but does not say how "
                          f"long the run is (the spec's default train.steps is {TrainSpec().steps}). Give the run's "
                          f"length: --set train.steps=N with N > {warmup}."
                          + "".join(f"\n  note: {w}" for w in warnings if w.startswith(f"{label}:")))


def import_config(path: str | Path, format: str | None = None, overrides: list[str] | None = None):
    """`import_text` on a file; the job is named after the file. Raises ConfigError if unreadable."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config {str(path)!r}: {e}. Pass the path of a DeepSpeed JSON, Accelerate "
                          "YAML, Megatron-LM command line or torchtitan TOML.") from None
    fmt = format or detect_format(text, path.name)
    return import_text(text, fmt, name=path.stem.replace("_", "-") or "job", overrides=overrides,
                       base=path.parent)


def export_config(spec, engine: str) -> tuple[str, list[str]]:
    """The job in an engine's own terms.

    Returns:
        (config text, warnings): one warning per spec field the engine cannot express.
    """
    module = _engine(engine)
    cfg, warnings = module.from_spec(spec)
    return module.dump(cfg), warnings
