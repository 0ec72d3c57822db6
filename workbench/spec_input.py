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
    before it is built; a key given twice in one mapping is an error, not a silent overwrite;
    YAML 1.1's octal, binary and base-60 numbers (016 is 14, 1:30 is 90) are refused rather than
    read as another value; dates stay strings (a job named 2024-01-01 is a name, not a date)."""

    def __init__(self, stream, kind: str = "spec"):
        super().__init__(stream)
        self.kind = kind  # "spec", "hardware profile", ...: what the messages call the text
        self._depth = 0
        self._composed = 0  # nodes composed so far, aliases not expanded
        self._weight: dict[int, int] = {}  # id(node) -> its node count with aliases expanded

    def compose_node(self, parent, index):
        is_alias = self.check_event(yaml.AliasEvent)
        mark = self.peek_event().start_mark
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise ConfigError(f"nested more than {MAX_DEPTH} levels deep (line {mark.line + 1}). "
                                  f"A {self.kind} is a few sections of key: value pairs.")
            self._composed += not is_alias
            if self._composed > MAX_NODES:  # counted as they come: a long flat list stops here, not once built
                raise ConfigError(f"more than {MAX_NODES:,} values (line {mark.line + 1}). A {self.kind} is a few "
                                  "sections of key: value pairs.")
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
                              f"A {self.kind} is a few dozen keys; write the values out instead of nesting aliases.")
        self._weight[id(node)] = weight
        return node

    def construct_mapping(self, node, deep=False):
        first: dict[str, int] = {}
        for key, _ in node.value:  # before merge keys (<<) are flattened: a key given after a merge overrides it
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                line = key.start_mark.line + 1
                if key.value in first:
                    raise ConfigError(f"line {line}: the key {clip(repr(key.value), 100)} is given twice in one "
                                      f"section (first at line {first[key.value]}); the second would silently "
                                      "replace the first. Keep one.")
                first[key.value] = line
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node):
        value = super().construct_yaml_int(node)
        digits = node.value.replace("_", "").lstrip("+-")
        form = ("base-60" if ":" in digits else "binary" if digits.startswith("0b") else
                "octal" if len(digits) > 1 and digits[0] == "0" and digits[1] != "x" else None)
        if form:
            raise ConfigError(f"line {node.start_mark.line + 1}: {clip(node.value, 40)} is a YAML 1.1 {form} number "
                              f"(it reads as {_int_text(value)}). Write the number in decimal, or quote it to keep "
                              "it as text.")
        return value

    def construct_yaml_float(self, node):
        if ":" in node.value:
            raise ConfigError(f"line {node.start_mark.line + 1}: {clip(node.value, 40)} is a YAML 1.1 base-60 number. "
                              "Write the number in decimal, or quote it to keep it as text.")
        return super().construct_yaml_float(node)


_SpecLoader.add_constructor("tag:yaml.org,2002:int", _SpecLoader.construct_yaml_int)
_SpecLoader.add_constructor("tag:yaml.org,2002:float", _SpecLoader.construct_yaml_float)
_SpecLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def parse_yaml(text: str | bytes, where: str, kind: str = "spec"):
    """Parse the YAML of a `kind` ("spec", "hardware profile", ...) read from `where` (bytes:
    UTF-8, or UTF-16 with a BOM). Raises ConfigError naming `where`."""
    try:
        loader = _SpecLoader(text, kind)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except ConfigError as e:  # a bound of _SpecLoader
        raise ConfigError(f"{where}: {e}") from None
    except yaml.reader.ReaderError as e:
        if e.encoding == "unicode" and not 0xD800 <= e.character <= 0xDFFF:  # decoded: a control character
            raise ConfigError(f"{where}: a control character (U+{e.character:04X}) at position {e.position}; YAML "
                              "text allows tabs and line breaks only. Remove it.") from None
        raise ConfigError(f"{where}: not UTF-8 text ({clip(str(e.reason), 200)} at position {e.position}). "
                          f"Use UTF-8 (save a {kind} file as UTF-8; UTF-16 needs its byte-order mark).") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {clip(str(e), 500)}") from None
    except RecursionError:  # a parser stage deeper than our composer bound (e.g. flow collections)
        raise ConfigError(f"{where}: nested too deeply; a {kind} is a few sections of key: value pairs.") from None
    except ValueError as e:  # int() of a number past Python's 4,300-digit limit
        raise ConfigError(f"{where}: a number too long to read ({clip(str(e), 200)}); numbers in a {kind} fit in "
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
            raise ConfigError(f"{what} {shown!r}: {size:,} bytes is too large (the limit is {limit / 2**20:g} MiB).")
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise ConfigError(f"{what} {shown!r}: cannot read it: {e.strerror or e}.") from None
    if len(data) > limit:
        raise ConfigError(f"{what} {shown!r}: more than {limit / 2**20:g} MiB (the limit); it grew while read.")
    return data


def read_spec_file(path: Path):
    """The parsed YAML/JSON of a spec file. Raises ConfigError for a missing, huge, binary or
    empty file (a truncated or wrong file would otherwise run on defaults)."""
    try:
        missing = not path.exists()
    except OSError as e:  # a name longer than the file system allows
        raise ConfigError(f"spec file {clip(str(path), 300)!r}: cannot read it: {e.strerror or e}.") from None
    if missing:
        raise ConfigError(f"spec file {clip(str(path), 300)!r} does not exist. "
                          "Pass the path of a YAML spec, e.g. examples/quickstart.yaml.")
    raw = parse_yaml(read_bounded(path, "spec file"), clip(str(path), 300))
    if raw is None:
        raise ConfigError(f"spec file {clip(str(path), 300)!r} is empty (or only comments). A spec needs at least "
                          "its model, e.g. model: {preset: gpt-tiny}; see examples/quickstart.yaml.")
    return raw


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
