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

# Input bounds (docs/interop.md): the engines' configs are a few KiB (the largest of the 51 real
# ones in tests/fixtures is under 20 KiB). A Megatron script is read as bash does, which costs time
# quadratic in a word's length, so scripts are held tighter than JSON/YAML/TOML.
MAX_CONFIG_BYTES = 1 << 20
MAX_SCRIPT_CHARS = 1 << 18
MAX_LINE_CHARS = 1 << 16
MAX_DEPTH = 64  # nesting of a parsed config (DeepSpeed's deepest is 3)


def read_config(path: Path) -> str:
    """A config file's text: a regular file of at most MAX_CONFIG_BYTES, UTF-8. ConfigError otherwise."""
    from workbench.spec_input import read_bounded

    data = read_bounded(path, "config file", MAX_CONFIG_BYTES)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"cannot read config {str(path)[:300]!r}: not UTF-8 text (byte {e.start}). Save it as "
                          "UTF-8.") from None


def _check_text(text, label: str) -> None:
    if not isinstance(text, str):
        raise ConfigError(f"a config is text (str), not a value of type {type(text).__name__}; read the file first, "
                          "or use import_config(path).")
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"the config is {len(text):,} characters; configs are a few KiB (the limit is "
                          f"{MAX_CONFIG_BYTES:,}).")
    if label != "megatron":
        return
    if len(text) > MAX_SCRIPT_CHARS:
        raise ConfigError(f"the Megatron-LM script is {len(text):,} characters; launch scripts are a few KiB (the "
                          f"limit is {MAX_SCRIPT_CHARS:,}). Give the training command's lines only.")
    longest = max((len(line) for line in text.splitlines()), default=0)
    if longest > MAX_LINE_CHARS:
        raise ConfigError(f"the Megatron-LM script has a line of {longest:,} characters (the limit is "
                          f"{MAX_LINE_CHARS:,}); split it with backslash continuations, or give the command only.")


def _check_nesting(cfg, label: str) -> None:
    """Refuse a parsed config nested deeper than MAX_DEPTH (iterative, so no RecursionError)."""
    stack = [(cfg, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(f"the {label} config is nested more than {MAX_DEPTH} levels deep; engine configs are a "
                              "few sections of key: value pairs.")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


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
    from workbench.spec import apply_overrides

    _check_text(text, "")
    if format is not None and not isinstance(format, str):
        raise ConfigError(f"format: one of {', '.join(ENGINES)}, not a value of type {type(format).__name__}.")
    engine = _engine(format or detect_format(text))
    # The world size is often the launcher's, not the file's: a --set layout.dp=N fills it in
    # before batch sizes that scale with dp are derived.
    dp = apply_overrides({}, overrides or []).get("layout", {}).get("dp")
    label = engine.__name__.rsplit(".", 1)[-1]
    _check_text(text, label)
    cfg = _parse(engine, text, label)
    raw, warnings = _translate(engine, cfg, label, dp=dp, base=base)
    raw = {"name": name, **raw}
    _check_length(raw, overrides or [], label, warnings)
    return _load(raw, overrides or [], label, warnings)


def _parse(engine, text: str, label: str):
    """The engine's config read from `text`; ConfigError for anything that does not read."""
    try:
        cfg = engine.parse(text)
    except ConfigError:
        raise
    except RecursionError:  # json / tomllib recurse per level
        raise ConfigError(f"the {label} config is nested too deeply to read; engine configs are a few sections of "
                          "key: value pairs.") from None
    except ValueError as e:  # e.g. an integer past Python's 4,300-digit limit
        raise ConfigError(f"cannot read the {label} config: {str(e)[:300]}.") from None
    _check_nesting(cfg, label)
    return cfg


def _translate(engine, cfg, label: str, *, dp, base: str | Path | None) -> tuple[dict, list[str]]:
    """(raw spec, warnings) of the engine's config with `dp` (the --set layout.dp given, if any);
    ConfigError for a value of the wrong kind."""
    try:
        extra = {"base": Path(base) if base is not None else None} if label == "accelerate" else {}
        return engine.to_spec(cfg, dp=int(dp) if dp else None, **extra)
    except ConfigError:
        raise
    except ZeroDivisionError as e:  # a count of 0 the translation divides by (num_machines: 0)
        raise ConfigError(f"the {label} config has a count of 0 where the job needs at least 1 ({e}); e.g. "
                          "num_machines, num_processes or a parallel degree. Fix that value.") from None
    except (TypeError, ValueError, AttributeError, OverflowError, KeyError, IndexError,
            RecursionError) as e:  # a number that is text, a section that is a value, ...
        raise ConfigError(f"the {label} config has a value of the wrong type ({e}). Fix that value; "
                          "docs/interop.md lists the keys read and what they must hold.") from None


def _load(raw: dict, overrides: list[str], label: str, warnings: list[str]):
    """(JobSpec, warnings) of the translated spec with the overrides; a refusal names the assumptions
    the translation made, and a spec that only plans gets a warning that says why it would not run."""
    from workbench.spec import apply_overrides, load_spec
    from workbench.validate import check_runnable

    try:
        spec = load_spec(apply_overrides(raw, overrides))
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
    if not isinstance(path, (str, Path)) or (isinstance(path, str) and ("\0" in path or len(path) > 4096)):
        raise ConfigError(f"cannot read config {str(path)[:200]!r}: give the path of a DeepSpeed JSON, Accelerate "
                          "YAML, Megatron-LM command line or torchtitan TOML.")
    path = Path(path)
    try:
        text = read_config(path)
    except ConfigError as e:
        raise ConfigError(f"cannot read config: {e} Pass the path of a DeepSpeed JSON, Accelerate YAML, "
                          "Megatron-LM command line or torchtitan TOML.") from None
    fmt = format or detect_format(text, path.name)
    return import_text(text, fmt, name=path.stem.replace("_", "-") or "job", overrides=overrides,
                       base=path.parent)


def export_config(spec, engine: str) -> tuple[str, list[str]]:
    """The job in an engine's own terms.

    Returns:
        (config text, warnings): one warning per spec field the engine cannot express.
    """
    from workbench.spec import JobSpec, load_spec

    if not isinstance(engine, str):
        raise ConfigError(f"engine: one of {', '.join(ENGINES)}, not a value of type {type(engine).__name__}.")
    module = _engine(engine)
    if not isinstance(spec, JobSpec):
        spec = load_spec(spec)
    cfg, warnings = module.from_spec(spec)
    return module.dump(cfg), warnings
