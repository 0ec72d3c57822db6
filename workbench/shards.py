"""Token shards: `workbench data prepare` writes them, `data.source: tokens` reads them.

On storage (a local directory or any fsspec URI), as nanoGPT's .bin files and Megatron's
indexed datasets do it: flat little-endian uint16 (uint32 when the vocabulary needs it) token
arrays, one file per shard, plus `index.json` (dtype, token counts, tokenizer) and the
tokenizer itself (`tokenizer.json`; none for byte-level). The shards are one token stream;
documents end with the tokenizer's EOS token. Reading maps the files (np.memmap) or, on an
object store, fetches byte ranges, so a rank touches only the windows it trains on.

Fine-tuning data (chat / instruct records, chat_data.py) adds a loss mask beside each token shard
(mask-NNNNN.bin, one uint8 per token, 1 = trains) and examples.bin (uint64 boundaries: example i
is tokens [b[i], b[i + 1]) of the stream), both listed in the index with checked sizes.
"""
from __future__ import annotations

import bisect
import itertools
import json
from array import array
from collections.abc import Iterator
from os import PathLike
from pathlib import Path

import numpy as np

from workbench.chat_data import FORMATS, ExampleEncoder, record_format
from workbench.errors import ConfigError

INDEX = "index.json"
TOKENIZER = "tokenizer.json"
FORMAT = "workbench-tokens/1"
DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per file
_ENCODE_CHARS = 1 << 22  # text handed to one encode_batch call
_LINES_CHARS = 1 << 20  # a plain-text file is read in pieces of about this size
TEXT_SUFFIXES = (".txt", ".md", ".text")
# Input bounds (docs/training.md): nothing is read whole. A text line is read in pieces of at most
# _LINES_CHARS; a jsonl line (one document, parsed as JSON) may be at most MAX_JSONL_LINE_CHARS; any
# document longer than _LINES_CHARS is tokenized in consecutive pieces of that size (a word across
# a cut becomes two tokens' worth), so memory stays bounded by the piece, not the document.
_TRAIN_CHARS = 1 << 12
MAX_JSONL_LINE_CHARS = 1 << 26  # 64 Mi characters
MAX_SHARD_TOKENS = 1 << 40
MAX_BPE_VOCAB = 1 << 20  # a BPE trained here (the largest published vocabularies are ~256,000)
# index.json: ~60 bytes a shard; 2^18 shards of the default size are 70 T tokens.
MAX_INDEX_BYTES = 1 << 24
MAX_SHARDS = 1 << 18


# -- reading the inputs --------------------------------------------------------------------

def _input_files(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and _kind(f))
        elif p.is_file():
            files.append(p)
        else:
            raise ConfigError(f"data prepare: input {item!r} does not exist. Give local text, .jsonl or .parquet "
                              "files, or a directory (e.g. a Hugging Face dataset saved with save_to_disk).")
    bad = [str(f) for f in files if not _kind(f)]
    if bad or not files:
        raise ConfigError(f"data prepare: cannot read {bad or inputs}: use .txt/.md, .jsonl, .parquet or .arrow "
                          "files (or a directory of them).")
    return files


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    for suffix in (".jsonl", ".parquet", ".arrow"):
        if name.endswith(suffix):
            return suffix[1:]
    return None


def iter_pieces(files: list[Path], text_field: str = "text") -> Iterator[tuple[str, bool]]:
    """(text, ends_document) pieces of every input, streamed (no file is read whole).

    A plain-text file is one document read in ~1 MiB pieces of whole lines; each jsonl line,
    parquet row and Arrow row (Hugging Face `save_to_disk` files) is a document.
    """
    for path in files:
        kind = _kind(path)
        if kind == "text":
            yield from _text_pieces(path)
        elif kind == "jsonl":
            for n, line in _jsonl_lines(path):
                yield from _cut(_field(_json_line(line, f"{path}:{n}"), text_field, f"{path}:{n}"))
        else:
            for batch in _arrow_batches(path, text_field):
                for text in batch.column(0).to_pylist():
                    if text is not None and not isinstance(text, str):
                        raise ConfigError(f"data prepare: {path}: column {text_field!r} holds "
                                          f"{type(text).__name__} values, not text. Name a text column with --text-field.")
                    yield from _cut(text or "")


def _training_texts(pieces) -> Iterator[str]:
    """The BPE's training text in runs of at most _TRAIN_CHARS: a merge rescans each distinct word,
    so one word of a million characters (a line without spaces) would cost hours; real words are
    far shorter than a run, and a cut every _TRAIN_CHARS characters changes no merge that matters."""
    for text, _ in pieces:
        for i in range(0, len(text), _TRAIN_CHARS):
            yield text[i:i + _TRAIN_CHARS]


def _cut(text: str) -> Iterator[tuple[str, bool]]:
    """One document as pieces of at most _LINES_CHARS characters; the last ends the document."""
    for i in range(0, max(len(text), 1), _LINES_CHARS):
        yield text[i:i + _LINES_CHARS], i + _LINES_CHARS >= len(text)


def _jsonl_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of a jsonl file, each read with a bounded readline."""
    try:
        with open(path, encoding="utf-8") as f:
            n = 0
            while line := f.readline(MAX_JSONL_LINE_CHARS + 1):
                n += 1
                if len(line) > MAX_JSONL_LINE_CHARS and not line.endswith("\n"):
                    raise ConfigError(f"data prepare: {path}:{n} is a line of more than {MAX_JSONL_LINE_CHARS:,} "
                                      "characters; a jsonl line is one document. Split the document, or give it as "
                                      "a .txt file (read in pieces, any length).")
                if line.strip():
                    yield n, line
    except UnicodeDecodeError as e:
        raise ConfigError(f"data prepare: {path} is not UTF-8 text (byte {e.start} of a piece). jsonl is UTF-8.") from None


def _json_line(line: str, where: str):
    try:
        return json.loads(line)
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"data prepare: {where} is not a JSON object ({str(e)[:200]}). Each jsonl line is one "
                          "object, e.g. {\"text\": \"...\"}.") from None


def _text_pieces(path: Path) -> Iterator[tuple[str, bool]]:
    with open(path, encoding="utf-8", errors="replace") as f:
        buf, size = [], 0
        while line := f.readline(_LINES_CHARS):  # a line longer than that comes in pieces
            buf.append(line)
            size += len(line)
            if size >= _LINES_CHARS:
                yield "".join(buf), False
                buf, size = [], 0
        yield "".join(buf), True


def _field(row, text_field: str, where: str) -> str:
    if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
        raise ConfigError(f"data prepare: {where} has no string field {text_field!r}. Name the field with --text-field.")
    return row[text_field]


def _arrow_batches(path: Path, text_field: str | list[str]):
    try:
        yield from _arrow_batches_unchecked(path, [text_field] if isinstance(text_field, str) else text_field)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow's errors (ArrowInvalid, OSError, ...) on a file that is not one
        raise ConfigError(f"data prepare: cannot read {path} as {path.suffix[1:]} ({type(e).__name__}: "
                          f"{str(e)[:300]}). Is it really a {path.suffix[1:]} file?") from None


def _arrow_batches_unchecked(path: Path, columns: list[str]):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def check(names) -> None:
        missing = [c for c in columns if c not in names]
        if missing:
            raise ConfigError(f"data prepare: {path} has no column {missing[0]!r} (columns: {names}). Name the text "
                              "column with --text-field, or the format with --format.")

    if path.suffix == ".parquet":
        pf = pq.ParquetFile(path)
        check(pf.schema_arrow.names)
        yield from pf.iter_batches(columns=columns)
        return
    with pa.memory_map(str(path)) as source:  # datasets' save_to_disk writes the Arrow stream format
        reader = pa.ipc.open_stream(source)
        check(reader.schema.names)
        for batch in reader:
            yield batch.select(columns)


def arrow_columns(path: Path) -> list[str]:
    """The column names of a parquet or Arrow file (its schema only)."""
    def names() -> list[str]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if path.suffix == ".parquet":
            return list(pq.ParquetFile(path).schema_arrow.names)
        with pa.memory_map(str(path)) as source:
            return list(pa.ipc.open_stream(source).schema.names)

    try:
        return names()
    except Exception as e:  # noqa: BLE001 - as in _arrow_batches
        raise ConfigError(f"data prepare: cannot read {path} as {path.suffix[1:]} ({type(e).__name__}: "
                          f"{str(e)[:300]}). Is it really a {path.suffix[1:]} file?") from None


# -- writing shards ------------------------------------------------------------------------

def prepare(inputs: list[str], out: str, *, tokenizer: str = "bpe", vocab_size: int = 4096,
            text_field: str = "text", shard_tokens: int = DEFAULT_SHARD_TOKENS, progress: bool = True,
            format: str = "auto") -> dict:
    """Tokenize local files into token shards + index under `out` (a path or fsspec URI).

    Args:
        inputs: text/.md, .jsonl, .parquet, .arrow files or directories of them.
        out: destination directory (local or e.g. s3://bucket/prefix).
        tokenizer: "bpe" (trained here on the inputs), "bytes", a local tokenizer.json, or a
            Hugging Face model folder (its tokenizer.json, special tokens and chat template).
        vocab_size: the BPE's vocabulary size (tokenizer="bpe" only).
        text_field: the text column of jsonl / parquet / Arrow inputs.
        shard_tokens: tokens per shard file.
        progress: a progress bar with MB/s on stderr.
        format: "text" (documents), "chat" (records with messages) or "instruct" (prompt +
            completion), or "auto": the one the records' fields name. chat and instruct write a
            loss mask beside the tokens (workbench/chat_data.py).
    Returns:
        The index (also written to `out`/index.json).
    Raises:
        ConfigError: missing or unreadable inputs, a bad tokenizer, records of no known format.
    """
    from workbench.tokenizer import build_tokenizer

    _check_prepare_args(inputs, out, tokenizer, vocab_size, text_field, shard_tokens)
    inputs, out, tokenizer = [str(i) for i in inputs], str(out), str(tokenizer)
    files = _input_files(inputs)
    fmt = data_format(files, format, text_field)
    texts = iter_pieces(files, text_field) if fmt == "text" else ((t, True) for t in training_texts(files, fmt))
    tok = build_tokenizer(tokenizer, _training_texts(texts), vocab_size)
    if tok.eos_id is None and tok.kind != "bytes":  # bytes join documents by design (docs/training.md)
        import sys

        from workbench.tokenizer import EOS, EOS_ALIASES

        print(f"warning: {tokenizer} has no end-of-document token ({', '.join((EOS, *EOS_ALIASES))}): documents "
              "are joined without a separator, so the model sees them as one text.", file=sys.stderr)
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    try:
        if fmt != "text":
            return write_examples(files, fmt, tok, out, dtype, shard_tokens, progress)
        return _write(files, tok, out, dtype, text_field, shard_tokens, progress)
    except ConfigError:
        raise
    except (OSError, ValueError, ImportError) as e:  # not writable, a file where the folder goes, no such protocol
        raise ConfigError(f"data prepare: cannot write the shards to --out {out[:300]!r} ({type(e).__name__}: "
                          f"{str(e)[:300]}). Give a writable directory or fsspec URI.") from None


def _check_prepare_args(inputs, out, tokenizer, vocab_size, text_field, shard_tokens) -> None:
    """Bounds and types of prepare's arguments, before anything is read."""
    if not isinstance(inputs, (list, tuple)) or not inputs or not all(isinstance(i, (str, PathLike)) for i in inputs):
        raise ConfigError("data prepare: inputs are a list of file or directory paths.")
    for name, value in (("out", out), ("tokenizer", tokenizer), ("text_field", text_field)):
        value = str(value) if isinstance(value, PathLike) else value
        if not isinstance(value, str) or not value or "\0" in value or len(value) > 4096:
            raise ConfigError(f"data prepare: {name} must be a non-empty path or name (str), got {str(value)[:100]!r}.")
    for name, value, hi in (("--shard-tokens", shard_tokens, MAX_SHARD_TOKENS), ("--vocab-size", vocab_size, MAX_BPE_VOCAB)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= hi:
            raise ConfigError(f"data prepare: {name} {str(value)[:40]} is out of range: use 1..{hi:,} (e.g. "
                              f"{'--shard-tokens 268435456' if name == '--shard-tokens' else '--vocab-size 4096'}).")


def _write(files, tok, out: str, dtype, text_field: str, shard_tokens: int, progress: bool) -> dict:
    import fsspec

    fs, root = fsspec.core.url_to_fs(out)
    fs.makedirs(root, exist_ok=True)
    writer = _ShardWriter(fs, root, dtype, shard_tokens)
    bar = _bar(sum(f.stat().st_size for f in files), progress)
    docs, source_bytes, batch, batch_chars = 0, 0, [], 0
    for text, ends in iter_pieces(files, text_field):
        batch.append((text, ends))
        batch_chars += len(text)
        docs += ends
        if batch_chars >= _ENCODE_CHARS:
            source_bytes += _encode_into(tok, batch, writer, bar)
            batch, batch_chars = [], 0
    source_bytes += _encode_into(tok, batch, writer, bar)
    writer.close()
    if bar is not None:
        bar.close()
    return write_index(fs, root, tok, writer, {"num_documents": docs, "source_bytes": source_bytes})


def write_index(fs, root: str, tok, writer: _ShardWriter, extra: dict) -> dict:
    """index.json (and the tokenizer beside it) of the shards `writer` wrote."""
    index = {"format": FORMAT, "dtype": np.dtype(writer.dtype).name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
             "tokenizer": tok.kind, "tokenizer_file": TOKENIZER if tok.kind != "bytes" else None,
             "num_tokens": writer.total, **extra, "shards": writer.shards}
    if tok.kind != "bytes":
        with fs.open(f"{root}/{TOKENIZER}", "w") as f:
            f.write(tok.to_str())
    with fs.open(f"{root}/{INDEX}", "w") as f:
        json.dump(index, f, indent=1)
    return index


def _bar(total: int, enabled: bool):
    if not enabled:
        return None
    import sys

    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="tokenizing", file=sys.stderr)


def _encode_into(tok, batch: list[tuple[str, bool]], writer: _ShardWriter, bar) -> int:
    if not batch:
        return 0
    ids = tok.encode_batch([t for t, _ in batch])
    eos = tok.eos_id
    parts = []
    for (_, ends), piece in zip(batch, ids):
        parts.append(piece)
        if ends and eos is not None:
            parts.append([eos])
    count = sum(len(p) for p in parts)
    writer.write(np.fromiter(itertools.chain.from_iterable(parts), dtype=writer.dtype, count=count))
    done = sum(len(t.encode("utf-8")) for t, _ in batch)
    if bar is not None:
        bar.update(done)
    return done


class _ShardWriter:
    """Appends tokens to shard-00000.bin, shard-00001.bin, ... of at most `shard_tokens` each, and
    with `masked` their loss masks to mask-00000.bin, ... (one uint8 per token, cut alike)."""

    def __init__(self, fs, root: str, dtype, shard_tokens: int, masked: bool = False):
        self.fs, self.root, self.dtype, self.shard_tokens, self.masked = fs, root, dtype, shard_tokens, masked
        self.shards: list[dict] = []
        self.total = 0
        self._file, self._mask_file, self._count = None, None, 0

    def write(self, tokens: np.ndarray, mask: np.ndarray | None = None) -> None:
        while len(tokens):
            if self._file is None or self._count == self.shard_tokens:
                self._open_next()
            take = tokens[: self.shard_tokens - self._count]
            self._file.write(take.astype("<" + np.dtype(self.dtype).str[1:], copy=False).tobytes())
            if self._mask_file is not None and mask is not None:
                self._mask_file.write(mask[: len(take)].astype(np.uint8, copy=False).tobytes())
                mask = mask[len(take):]
            self._count += len(take)
            self.total += len(take)
            self.shards[-1]["tokens"] = self._count
            tokens = tokens[len(take):]

    def _open_next(self) -> None:
        self.close()
        n = len(self.shards)
        self._file, self._count = self.fs.open(f"{self.root}/shard-{n:05d}.bin", "wb"), 0
        self.shards.append({"file": f"shard-{n:05d}.bin", "tokens": 0})
        if self.masked:
            self._mask_file = self.fs.open(f"{self.root}/mask-{n:05d}.bin", "wb")
            self.shards[-1]["mask"] = f"mask-{n:05d}.bin"

    def close(self) -> None:
        for f in (self._file, self._mask_file):
            if f is not None:
                f.close()
        self._file = self._mask_file = None


# -- fine-tuning records: chat / instruct jsonl, parquet, Arrow ---------------------------------

_RECORDS_PER_BATCH = 512  # records encoded in one tokenizer batch


def data_format(files: list[Path], fmt: str, text_field: str) -> str:
    """The inputs' format: `fmt`, or (fmt="auto") the one every file's first record names.

    Raises:
        ConfigError: an unknown format, files of different formats, chat/instruct from .txt files.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"data prepare: --format {str(fmt)[:40]!r} is not one of {', '.join(FORMATS)}.")
    found = {}
    for path in files:
        kind = _kind(path)
        if kind == "text":
            found[path] = "text"
        elif fmt != "auto":
            found[path] = fmt
        elif kind == "jsonl":
            found[path] = next((record_format(row, where, text_field) for row, where in _jsonl_records(path)), "text")
        else:
            found[path] = record_format(dict.fromkeys(arrow_columns(path)), str(path), text_field)
    kinds = sorted(set(found.values()))
    if len(kinds) > 1 or (fmt not in ("auto", "text") and kinds != [fmt]):
        text = [str(p) for p, k in found.items() if k == "text"][:3]
        raise ConfigError(f"data prepare: the inputs mix formats ({', '.join(f'{p}: {k}' for p, k in list(found.items())[:4])}"
                          f"). Prepare text ({text or 'none'}) and {'/'.join(k for k in kinds if k != 'text') or fmt} "
                          "records into separate shards; chat and instruct records come from .jsonl, .parquet or .arrow files.")
    return kinds[0]


def _jsonl_records(path: Path):
    for n, line in _jsonl_lines(path):
        yield _json_line(line, f"{path}:{n}"), f"{path}:{n}"


def iter_records(files: list[Path], fmt: str):
    """(record, where, source characters) of every input, streamed."""
    columns = ["messages"] if fmt == "chat" else ["prompt", "completion"]
    for path in files:
        if path.name.lower().endswith(".jsonl"):
            for row, where in _jsonl_records(path):
                yield row, where, len(str(row))
            continue
        n = 0
        for batch in _arrow_batches(path, columns):
            for row in batch.to_pylist():
                n += 1
                yield row, f"{path}: row {n}", len(str(row))


def training_texts(files: list[Path], fmt: str):
    """The records as plain text: what a BPE trained here on fine-tuning data learns from."""
    enc = ExampleEncoder(_NoTokenizer())
    for row, where, _ in iter_records(files, fmt):
        yield enc.text(fmt, row, where)


class _NoTokenizer:
    eos_id = None


def write_examples(files: list[Path], fmt: str, tok, out: str, dtype, shard_tokens: int, progress: bool) -> dict:
    """Token shards + a loss mask shard per token shard + examples.bin (uint64 boundaries: example
    i is tokens [b[i], b[i + 1])) + index.json under `out`."""
    import fsspec

    enc = ExampleEncoder(tok, getattr(tok, "hf", None))
    fs, root = fsspec.core.url_to_fs(out)
    fs.makedirs(root, exist_ok=True)
    writer = _ShardWriter(fs, root, dtype, shard_tokens, masked=True)
    bar = _bar(sum(f.stat().st_size for f in files), progress)
    lengths, source_chars = array("q"), 0  # tokens, then loss tokens, of each example
    with fs.open(f"{root}/{EXAMPLES}", "wb") as bounds:
        bounds.write(np.zeros(1, "<u8").tobytes())
        batch: list = []
        for record in iter_records(files, fmt):
            batch.append(record)
            if len(batch) == _RECORDS_PER_BATCH:
                source_chars += _encode_records(enc, fmt, batch, writer, bounds, lengths, bar)
                batch = []
        source_chars += _encode_records(enc, fmt, batch, writer, bounds, lengths, bar)
    writer.close()
    if bar is not None:
        bar.close()
    if not lengths:
        raise ConfigError(f"data prepare: the inputs hold no {fmt} records.")
    sizes, loss = np.frombuffer(lengths, dtype=np.int64)[0::2], np.frombuffer(lengths, dtype=np.int64)[1::2]
    extra = {"num_documents": len(sizes), "source_chars": source_chars, "data_format": fmt,
             "chat_template": enc.template_name if fmt == "chat" else None, "loss_tokens": int(loss.sum()),
             "examples": {"file": EXAMPLES, "count": len(sizes), "max_tokens": int(sizes.max()),
                          "median_tokens": int(np.median(sizes))}}
    if fmt == "chat" and enc.template:
        with fs.open(f"{root}/{CHAT_TEMPLATE}", "w") as f:
            f.write(enc.template)
        extra["chat_template_file"] = CHAT_TEMPLATE
    return write_index(fs, root, tok, writer, extra)


EXAMPLES = "examples.bin"
CHAT_TEMPLATE = "chat_template.jinja"


def _encode_records(enc: ExampleEncoder, fmt: str, batch: list, writer, bounds, lengths: list, bar) -> int:
    if not batch:
        return 0
    for ids, mask in enc.encode(fmt, [r for r, _, _ in batch], [w for _, w, _ in batch]):
        writer.write(np.asarray(ids, dtype=writer.dtype), np.asarray(mask, dtype=np.uint8))
        bounds.write(np.array([writer.total], "<u8").tobytes())
        lengths.extend((len(ids), sum(mask)))
    chars = sum(n for _, _, n in batch)
    if bar is not None:
        bar.update(chars)
    return chars


# -- reading shards ------------------------------------------------------------------------

def _parse_index(data: bytes, uri: str):
    """The JSON of index.json, or a ConfigError saying why it is not one."""
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # ValueError: UnicodeDecodeError, JSONDecodeError, a 5,000-digit int
        why = ("not UTF-8" if isinstance(e, UnicodeDecodeError) else "nested too deeply" if isinstance(e, RecursionError)
               else f"not JSON: {str(e)[:200]}" if isinstance(e, json.JSONDecodeError) else "a number too long to read")
        raise ConfigError(f"data.path: {uri}/{INDEX} is not a token index workbench wrote ({why}). Make the shards "
                          "again with workbench data prepare.") from None


def _check_index(index, uri: str) -> None:
    """A token index is data of known shape: token ids as uint16/uint32 (never `object`, which numpy
    would read as pointers), counts as ints, shard and tokenizer files as plain names in its folder."""
    def plain(name) -> bool:
        return isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name and not name.startswith(".")

    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 48

    shards, examples = index.get("shards"), index.get("examples")
    masked = examples is not None
    problems = [
        f"dtype {str(index.get('dtype'))[:40]!r} (uint16 or uint32)" * (index.get("dtype") not in ("uint16", "uint32")),
        f"vocab_size {str(index.get('vocab_size'))[:40]!r}" * (not count(index.get("vocab_size"))),
        f"eos_id {str(index.get('eos_id'))[:40]!r}" * (index.get("eos_id") is not None and not count(index.get("eos_id"))),
        f"shards (a list of {{file, tokens}}, at most {MAX_SHARDS:,})" * (
            not isinstance(shards, list) or len(shards) > MAX_SHARDS or not all(
            isinstance(x, dict) and plain(x.get("file")) and count(x.get("tokens")) for x in shards)),
        "tokenizer_file" * (index.get("tokenizer_file") is not None and not plain(index.get("tokenizer_file"))),
        "examples ({file, count})" * (masked and not (isinstance(examples, dict) and plain(examples.get("file"))
                                                      and count(examples.get("count")))),
        "shards' masks (every shard names its mask file, or none does)" * (isinstance(shards, list) and any(
            isinstance(x, dict) and (("mask" in x) != masked or masked and not plain(x.get("mask"))) for x in shards)),
    ]
    problems = [p for p in problems if p]
    if problems:
        raise ConfigError(f"data.path: {uri}/{INDEX} is not a token index workbench wrote: bad {'; '.join(problems)}. "
                          "Make the shards again with workbench data prepare.")


class TokenShards:
    """The token stream under `uri`, read by window: np.memmap on local disks, byte-range reads
    on object stores. Nothing is loaded until a window is asked for.

    Raises:
        ConfigError: no index, or not a workbench token index.
    """

    def __init__(self, uri: str):
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        self.uri = uri
        try:
            self.fs, self.root = fsspec.core.url_to_fs(uri)
        except Exception as e:  # an unknown protocol, its package not installed, a chained URL that fails to open
            raise ConfigError(f"data.path: cannot open {uri!r}: {str(e)[:300]}. Give a local folder or an fsspec "
                              "URI (s3://, gs://, az://) whose package is installed.") from None
        self.local = isinstance(self.fs, LocalFileSystem)
        self.index = _parse_index(self._read_index(), uri)
        if not isinstance(self.index, dict) or self.index.get("format") != FORMAT:
            raise ConfigError(f"data.path: {uri}/{INDEX} is not a workbench token index (format "
                              f"{str(getattr(self.index, 'get', dict().get)('format'))[:40]!r}, expected {FORMAT!r}).")
        _check_index(self.index, uri)
        self.dtype = np.dtype(self.index["dtype"]).newbyteorder("<")
        self.vocab_size = int(self.index["vocab_size"])
        self.masked = "examples" in self.index  # fine-tuning shards: a loss mask and example boundaries
        self.offsets = [0]
        for shard in self.index["shards"]:
            self._check_size(shard["file"], shard["tokens"], self.dtype.itemsize)
            if self.masked:
                self._check_size(shard["mask"], shard["tokens"], 1)
            self.offsets.append(self.offsets[-1] + shard["tokens"])
        self._maps: dict[tuple[str, int], np.ndarray] = {}
        self.num_examples = 0
        if self.masked:
            self.num_examples = self.index["examples"]["count"]
            self._check_size(self.index["examples"]["file"], self.num_examples + 1, 8, "example bounds")
            ends = (self._bounds(0), self._bounds(self.num_examples))
            if ends != (0, len(self)):
                raise ConfigError(f"data.path: {uri}/{self.index['examples']['file']} bounds the examples by {ends}, "
                                  f"not (0, {len(self)}) tokens. Make the shards again.")

    def _read_index(self) -> bytes:
        """index.json's bytes, at most MAX_INDEX_BYTES: a regular file on a local disk (a pipe or
        device would hang or never end), any failure of an object store's client a ConfigError."""
        from workbench.spec_input import read_bounded

        path = f"{self.root}/{INDEX}"
        missing = ConfigError(f"data.path: no {INDEX} under {self.uri!r}. Make token shards first: "
                              f"workbench data prepare FILES --out {self.uri}")
        if self.local:
            try:
                exists = Path(path).exists()
            except OSError:  # a name too long, or a file where a folder should be
                exists = False
            if not exists:
                raise missing
            return read_bounded(Path(path), "data.path: the token index", MAX_INDEX_BYTES)
        try:
            with self.fs.open(path, "rb") as f:
                data = f.read(MAX_INDEX_BYTES + 1)
        except FileNotFoundError:
            raise missing from None
        except Exception as e:  # the store's client: credentials, network, permissions
            raise ConfigError(f"data.path: cannot read {self.uri}/{INDEX}: {type(e).__name__}: {str(e)[:300]}. "
                              "Check the URI and the store's credentials.") from None
        if len(data) > MAX_INDEX_BYTES:
            raise ConfigError(f"data.path: {self.uri}/{INDEX} is over {MAX_INDEX_BYTES >> 20} MiB: not a token index "
                              "workbench wrote. Make the shards again.")
        return data

    def _check_size(self, name: str, n: int, itemsize: int, unit: str = "tokens") -> None:
        size = self.fs.size(f"{self.root}/{name}")
        if n * itemsize > (size or 0):
            raise ConfigError(f"data.path: {self.uri}/{INDEX} says {name} holds {n:,} {unit}, but the file has "
                              f"{size or 0:,} bytes ({itemsize} a value). Make the shards again.")

    def __len__(self) -> int:
        return self.offsets[-1]

    def read(self, start: int, n: int, what: str = "file") -> np.ndarray:
        """Tokens [start, start + n) of the stream (across shard boundaries); what="mask": their
        loss mask (uint8, 1 = trains) from the mask shards of fine-tuning data."""
        out, pos, end = [], start, start + n
        if start < 0 or end > len(self):
            raise IndexError(f"tokens [{start}, {end}) are outside the stream of {len(self)} tokens")
        dtype = self.dtype if what == "file" else np.dtype(np.uint8)
        while pos < end:
            i = bisect.bisect_right(self.offsets, pos) - 1
            lo, hi = pos - self.offsets[i], min(end, self.offsets[i + 1]) - self.offsets[i]
            out.append(self._slice(self.index["shards"][i][what], dtype, lo, hi))
            pos = self.offsets[i] + hi
        return out[0] if len(out) == 1 else np.concatenate(out)

    def read_mask(self, start: int, n: int) -> np.ndarray:
        return self.read(start, n, "mask")

    def example(self, i: int) -> tuple[int, int]:
        """[start, end) of fine-tuning example i in the token stream."""
        start, end = self._bounds(i), self._bounds(i + 1)
        if not 0 <= start <= end <= len(self):
            raise ConfigError(f"data.path: {self.uri}/{self.index['examples']['file']} bounds example {i} by "
                              f"[{start}, {end}), outside the stream of {len(self):,} tokens. Make the shards again.")
        return start, end

    def _bounds(self, i: int) -> int:
        return int(self._slice(self.index["examples"]["file"], np.dtype("<u8"), i, i + 1)[0])

    def _slice(self, name: str, dtype: np.dtype, lo: int, hi: int) -> np.ndarray:
        path = f"{self.root}/{name}"
        if self.local:
            key = (name, dtype.itemsize)
            if key not in self._maps:
                self._maps[key] = np.memmap(path, dtype=dtype, mode="r")
            return self._maps[key][lo:hi]
        size = dtype.itemsize
        return np.frombuffer(self.fs.cat_file(path, start=lo * size, end=hi * size), dtype=dtype)

    def tokenizer(self):
        """The tokenizer the shards were made with."""
        from workbench.tokenizer import MAX_TOKENIZER_CHARS, ByteTokenizer, tokenizer_from_str

        if self.index.get("tokenizer_file") is None:
            return ByteTokenizer()
        with self.fs.open(f"{self.root}/{self.index['tokenizer_file']}", "r") as f:
            text = f.read(MAX_TOKENIZER_CHARS + 1)
        if len(text) > MAX_TOKENIZER_CHARS:
            raise ConfigError(f"data.path: {self.uri}/{self.index['tokenizer_file']} is over {MAX_TOKENIZER_CHARS >> 20} "
                              "Mi characters: not a tokenizer.json workbench wrote. Make the shards again.")
        return tokenizer_from_str(text, self.index.get("tokenizer", "json"))



def open_token_data(path: str | None, vocab: int, seq_len: int, val_fraction: float, packing: bool) -> TokenShards:
    """The shards of data.source=tokens, checked against the model before anything trains: they
    exist, their tokenizer fits model.vocab, and the training and held-out parts each hold a sample
    (one example each for fine-tuning shards read by example, seq_len+2 tokens otherwise).

    Raises:
        ConfigError: no path, no index, a larger vocabulary, or too little data for the split.
    """
    if not path:
        raise ConfigError("data.source=tokens needs data.path: the directory or URI of the token shards "
                          "(make them with `workbench data prepare FILES --out DIR`).")
    shards = TokenShards(path)
    if shards.vocab_size > vocab:
        raise ConfigError(f"data.path {path}: the shards' tokenizer has {shards.vocab_size} tokens but "
                          f"model.vocab={vocab}. Set model.vocab >= {shards.vocab_size}.")
    if shards.masked and not packing:
        total = shards.num_examples
        val = int(total * val_fraction)
        if total - val < 1 or (val_fraction > 0 and val < 1):
            raise ConfigError(
                f"data.path: {path} has {total} examples: {total - val} for training and {val} held out "
                f"(val_fraction={val_fraction}); each part needs at least one. Use more examples or another "
                "val_fraction.")
    else:
        check_regions(len(shards), "tokens", path, seq_len, val_fraction)
    return shards


def check_regions(total: int, unit: str, where: str, seq_len: int, val_fraction: float) -> None:
    """ConfigError unless `total` tokens (or bytes) leave seq_len+2 for training and, when any are
    held out (val_fraction), seq_len+2 for evaluation."""
    n = seq_len + 2
    val = int(total * val_fraction)
    if total - val < n or 0 < val < n:
        raise ConfigError(
            f"data.path: {where} has {total} {unit}: {total - val} for training and {val} held out "
            f"(val_fraction={val_fraction}), but each part needs at least seq_len+2 = {n}. "
            "Use more data, a shorter seq_len or another val_fraction.")
