"""Hostile-input guards for specs: bounded YAML parsing and a check that a raw spec is plain data.

A spec is a few dozen keys, so anything far larger is a mistake or an attack: YAML aliases that
expand to billions of nodes ("billion laughs"), lists nested a thousand deep, bytes, dates,
undecodable text. Each becomes a short ConfigError before pydantic, json or a repr walks it.
"""
from __future__ import annotations

import datetime
from pathlib import Path

import yaml

from workbench.errors import ConfigError

MAX_DEPTH = 32  # sections are 3 deep; factory kwargs get the rest
MAX_NODES = 20_000  # values after alias expansion; a full spec has ~150
MAX_FILE_BYTES = 1 << 20
MAX_MESSAGE_CHARS = 2_000
# Text after alias expansion: a spec file is at most 1 MiB, so more than twice that is aliases
# repeating one long string (each repeat would be copied by JSON, reprs and error messages).
MAX_TEXT_CHARS = 1 << 21
# Integers: counts, sizes and seeds all fit in 64 bits; Python's own limit is 4,300 digits.
MAX_INT_BITS = 63

# Domain bounds (docs/testing.md, "Bounds"): far past any real job, small enough that planning a
# spec at the bound stays cheap and every product of them stays an exact float.
MAX_RANKS = 1 << 17  # GPUs of one job: 131,072 (Llama 3 405B trained on 16,384; the largest clusters ~100,000)
MAX_PP = 1024  # pipeline stages (pp x virtual stages): each holds a block; the deepest models have ~130
MAX_LAYERS = 1 << 16  # 65,536 blocks: 500x Llama 3 405B's 126, 65x DeepNet's 1,000
MAX_WIDTH = 1 << 20  # hidden, heads: 1,048,576 (the widest published models ~25,000)
MAX_FFN = 1 << 22  # MLP inner width
MAX_VOCAB = 1 << 24  # 16.7M tokens (the largest vocabularies ~256,000)
MAX_SEQ = 1 << 24  # 16.7M tokens per sequence (the longest contexts ~10M)
MAX_PARAMS = 1e15  # a size alone: a quadrillion parameters (the largest dense models ~2e12)
MAX_BATCH = 1 << 20  # sequences per optimizer step (published runs use ~1,000-16,000)
MAX_STEPS = 1 << 40  # optimizer steps, warmup, eval intervals
MAX_SEED = (1 << 63) - 1  # seeds go to torch.manual_seed and numpy (64-bit)


def clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` cut to `limit` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)"


class _SpecLoader(yaml.SafeLoader):
    """SafeLoader bounded in depth and in expanded size while it composes, so a bomb is refused
    before it is built; dates stay strings (a job named 2024-01-01 is a name, not a date)."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._weight: dict[int, int] = {}  # id(node) -> its node count with aliases expanded

    def compose_node(self, parent, index):
        is_alias = self.check_event(yaml.AliasEvent)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise ConfigError(f"nested more than {MAX_DEPTH} levels deep (line {mark.line + 1}). "
                                  "A spec is a few sections of key: value pairs.")
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if is_alias:
            if id(node) not in self._weight:  # the anchor is still being composed: a cycle
                raise ConfigError("a YAML alias refers to its own anchor (a cycle). Write the values out.")
            return node
        children = node.value if isinstance(node, yaml.SequenceNode) else (
            [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else [])
        weight = 1 + sum(self._weight[id(c)] for c in children)
        if weight > MAX_NODES:
            raise ConfigError(f"YAML aliases expand to more than {MAX_NODES:,} values (an alias bomb?). "
                              "A spec is a few dozen keys; write the values out instead of nesting aliases.")
        self._weight[id(node)] = weight
        return node


_SpecLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def parse_yaml(text: str | bytes, where: str):
    """Parse spec YAML (bytes: UTF-8, or UTF-16 with a BOM). Raises ConfigError naming `where`."""
    try:
        return yaml.load(text, Loader=_SpecLoader)
    except ConfigError as e:  # a bound of _SpecLoader
        raise ConfigError(f"{where}: {e}") from None
    except yaml.reader.ReaderError as e:
        raise ConfigError(f"{where}: not UTF-8 text ({clip(str(e.reason), 200)} at position {e.position}). "
                          "Use UTF-8 (save a spec file as UTF-8; UTF-16 needs its byte-order mark).") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {clip(str(e), 500)}") from None
    except RecursionError:  # a parser stage deeper than our composer bound (e.g. flow collections)
        raise ConfigError(f"{where}: nested too deeply; a spec is a few sections of key: value pairs.") from None
    except ValueError as e:  # int() of a number past Python's 4,300-digit limit
        raise ConfigError(f"{where}: a number too long to read ({clip(str(e), 200)}); numbers in a spec fit in "
                          f"{MAX_INT_BITS} bits.") from None


def read_bounded(path: Path, what: str, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; ConfigError otherwise.

    Reads at most limit + 1 bytes, so a device (/dev/zero), a pipe or a file that grows while it
    is read costs no more than the limit.
    """
    shown = clip(str(path), 300)
    try:
        if not path.is_file():
            exists = path.exists()
            raise ConfigError(f"{what} {shown!r} " + ("is not a regular file (a device, pipe or folder)."
                                                     if exists else "does not exist."))
        size = path.stat().st_size
        if size > limit:
            raise ConfigError(f"{what} {shown!r}: {size / 2**20:.1f} MiB is too large (they are a few KiB; "
                              f"the limit is {limit / 2**20:g} MiB).")
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise ConfigError(f"{what} {shown!r}: cannot read it: {e.strerror or e}.") from None
    if len(data) > limit:
        raise ConfigError(f"{what} {shown!r}: more than {limit / 2**20:g} MiB (the limit); it grew while read.")
    return data


def read_spec_file(path: Path):
    """The parsed YAML/JSON of a spec file. Raises ConfigError for a missing, huge or binary file."""
    if not path.exists():
        raise ConfigError(f"spec file {clip(str(path), 300)!r} does not exist. "
                          "Pass the path of a YAML spec, e.g. examples/quickstart.yaml.")
    return parse_yaml(read_bounded(path, "spec file"), clip(str(path), 300))


_SCALARS = (str, int, float, bool, type(None))


def check_plain(raw, where: str = "spec") -> None:
    """Raise ConfigError unless `raw` is JSON-like data of bounded size: dicts with string keys,
    lists, strings (valid Unicode), numbers, booleans and nulls; `where` names its place in errors."""
    stack, seen, chars, checked = [(raw, where, 0)], 0, 0, set()
    while stack:
        value, path, depth = stack.pop()
        seen += 1
        if seen > MAX_NODES or depth > MAX_DEPTH:
            what = f"more than {MAX_NODES:,} values" if seen > MAX_NODES else f"nesting deeper than {MAX_DEPTH}"
            raise ConfigError(f"{clip(path, 200)}: {what}; a spec is a few sections of key: value pairs.")
        if isinstance(value, str):
            chars += len(value)
            if chars > MAX_TEXT_CHARS:
                raise ConfigError(f"{clip(path, 200)}: the spec's text adds up to more than {MAX_TEXT_CHARS:,} "
                                  "characters (YAML aliases repeating a long string?). A spec is a few KiB; "
                                  "write each value once.")
            if id(value) in checked:  # an alias repeats the same object: check its text once
                continue
            checked.add(id(value))
        elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
            raise ConfigError(f"{clip(path, 200)}: the integer {_int_text(value)} is beyond {MAX_INT_BITS} bits; "
                              "every count, size and seed in a spec is far smaller.")
        if isinstance(value, dict):
            for key, child in value.items():
                if not isinstance(key, str):
                    raise ConfigError(f"{clip(path, 200)}: keys must be text, got {_describe(key)}.")
                _check_text(key, path)
                stack.append((child, f"{path}.{key}" if path != "spec" else key, depth + 1))
        elif isinstance(value, list):
            stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, path)
        elif not isinstance(value, _SCALARS):
            raise ConfigError(f"{clip(path, 200)}: {_describe(value)} is not a spec value; use text, a number, "
                              "true/false, a list or a mapping (quote it to keep it as text).")


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # lone surrogates: bytes that were not UTF-8 (argv, os.fsdecode)
        raise ConfigError(f"{clip(path, 200)}: not valid UTF-8 text (undecodable byte at character {e.start}). "
                          "Use UTF-8.") from None


def _int_text(value: int) -> str:
    """An integer for an error message: in full up to 30 digits, else its size (str() of a huge
    int is quadratic and past 4,300 digits refused by Python)."""
    if value.bit_length() <= 100:
        return str(value)
    return f"of about {int(value.bit_length() * 0.30103) + 1:,} digits"


def _describe(value) -> str:
    if isinstance(value, (bytes, bytearray)):
        return f"binary data ({len(value)} bytes)"
    if isinstance(value, (datetime.date, datetime.datetime)):
        return f"a date ({value.isoformat()})"
    return f"a {type(value).__name__}"
