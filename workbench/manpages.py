"""Question/answer pairs from the man pages installed on this machine (gzip'd roff under
/usr/share/man): text nobody here wrote, for the fine-tuning demo (notebooks/finetune.ipynb).

Each page's NAME line ("ls \\- list directory contents") and the first sentences of its
DESCRIPTION become a chat record: the user asks what the command does, the assistant answers
with its summary and description. The roff is read as data: requests and escapes are stripped by
the small parser below (macros are never expanded or run).
"""
from __future__ import annotations

import gzip
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

MAN_ROOT = Path("/usr/share/man")
MAX_PAGE_BYTES = 1 << 20  # a page is read up to this much of its uncompressed text
_SECTION = re.compile(r'^\.(?:SH|Sh)\s+"?([^"]*)"?\s*$')
_BREAK = {"PP", "P", "LP", "TP", "IP", "HP", "Pp", "Lp", "sp", "br", "RS", "RE", "Bl", "El", "It", "Bd", "Ed", "nf", "fi"}
_FONT = {"B", "I", "R", "BR", "RB", "BI", "IB", "IR", "RI", "SM", "SB", "Nm", "Ar", "Fl", "Cm", "Pa", "Em", "Sy", "Dv",
         "Ev", "Va", "Li", "Ql", "Xr", "Ic", "Ad", "Tn", "Ux"}
_GLYPHS = {"em": "\u2014", "en": "\u2013", "hy": "-", "lq": "\u201c", "rq": "\u201d", "oq": "\u2018", "cq": "\u2019",
           "aq": "'", "dq": '"', "bu": "\u2022", "co": "\u00a9", "rg": "\u00ae", "tm": "\u2122", "mi": "-",
           "pl": "+", "mu": "\u00d7", "<=": "\u2264", ">=": "\u2265", "ti": "~", "ha": "^", "ga": "`", "rs": "\\"}
_ESCAPES = [
    (re.compile(r'\\".*$'), ""),  # comment to end of line
    (re.compile(r"\\f(?:\[[^\]]*\]|\(..|.)"), ""),  # font changes
    (re.compile(r"\\s[+-]?\d+"), ""),  # size changes
    (re.compile(r"\\\*(?:\[[^\]]*\]|\(..|.)"), ""),  # predefined strings (unknown here)
    (re.compile(r"\\[nw](?:\[[^\]]*\]|\(..|.)"), ""),  # registers, widths
    (re.compile(r"\\[kz]."), ""),
    (re.compile(r"\\[&/,:%c|^)0]"), ""),  # zero-width and spacing escapes
    (re.compile(r"\\[ ~]"), " "),
    (re.compile(r"\\[-e]"), lambda m: "-" if m.group(0) == "\\-" else "\\"),
]


def _glyph(m: re.Match) -> str:
    name = m.group(1) or m.group(2)
    return _GLYPHS.get(name, "")


def strip_inline(line: str) -> str:
    """A roff text line without its escapes (fonts, sizes, glyph names, comments)."""
    line = re.sub(r"\\\((..)|\\\[([^\]]*)\]", _glyph, line)
    for pattern, repl in _ESCAPES:
        line = pattern.sub(repl, line)
    return line.replace("\\", "")


def _macro_args(rest: str) -> str:
    parts = re.findall(r'"([^"]*)"|(\S+)', rest)
    return " ".join(a or b for a, b in parts)


def sections(roff: str) -> dict[str, str]:
    """Section name (upper case) -> its plain text, paragraphs separated by blank lines."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for raw in roff.splitlines():
        m = _SECTION.match(raw)
        if m:
            current = out.setdefault(m.group(1).strip().upper(), [])
            continue
        if current is None:
            continue
        if raw.startswith((".", "'")):
            request, _, rest = raw[1:].strip().partition(" ")
            if request in _BREAK:
                current.append("")
                if request in ("TP", "IP") and rest:
                    current.append(strip_inline(_macro_args(rest)))
            elif request in _FONT:
                current.append(strip_inline(_macro_args(rest)))
            elif request == "Nd":
                current.append("- " + strip_inline(rest))
            continue  # any other request (macros, conditionals, registers) is not text
        current.append(strip_inline(raw))
    return {name: re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() for name, lines in out.items()}


def _paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]


def _sentences(text: str, limit: int) -> str:
    """Whole sentences of `text` up to about `limit` characters (at least the first)."""
    out = ""
    for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text):
        if out and len(out) + len(s) + 1 > limit:
            break
        out = f"{out} {s}".strip()
    return out


def read_page(path: Path) -> str | None:
    """The page's roff text, or None for a redirect (.so), an unreadable or empty file."""
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as f:
            data = f.read(MAX_PAGE_BYTES)
    except (OSError, EOFError, zlib.error):
        return None
    text = data.decode("utf-8", errors="replace")
    return None if not text.strip() or text.lstrip().startswith(".so ") else text


def qa_record(path: Path, max_answer_chars: int = 240) -> dict | None:
    """One chat record from a page, or None when it has no usable NAME line or DESCRIPTION."""
    roff = read_page(path)
    if roff is None:
        return None
    parts = sections(roff)
    name = " ".join(parts.get("NAME", "").split())
    m = re.match(r"^(.+?)\s+[-\u2013\u2014]+\s+(.+)$", name)
    description = next(iter(_paragraphs(parts.get("DESCRIPTION", ""))), "")
    if not m or len(description) < 20:
        return None
    command = m.group(1).split(",")[0].strip()
    summary = m.group(2).strip().rstrip(".")
    if not re.fullmatch(r"[\w.+\-\[]+", command) or len(summary) > 120:
        return None
    answer = f"{command} - {summary}. {_sentences(description, max_answer_chars)}"
    return {"messages": [{"role": "user", "content": f"What does the {command} command do?"},
                         {"role": "assistant", "content": answer}]}


SKIP_PREFIXES = ("gcloud",)  # the Google Cloud SDK's ~16,000 generated pages: not Debian's, and one command each


def man_pages(section: str = "1", root: Path = MAN_ROOT, skip: tuple[str, ...] = SKIP_PREFIXES) -> list[Path]:
    """The English pages of one section, in name order, but those whose names start with `skip`."""
    folder = root / f"man{section}"
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if not p.name.startswith(skip) and p.is_file())


def qa_records(paths: list[Path], limit: int | None = None, max_answer_chars: int = 240) -> Iterator[dict]:
    """Chat records of the pages that have a NAME line and a DESCRIPTION, one per command; an
    answer is the summary and the description's sentences up to about max_answer_chars."""
    seen, n = set(), 0
    for path in paths:
        record = qa_record(path, max_answer_chars)
        if record is None:
            continue
        question = record["messages"][0]["content"]
        if question in seen:
            continue
        seen.add(question)
        yield record
        n += 1
        if limit is not None and n >= limit:
            return


def description_text(paths: list[Path]) -> Iterator[str]:
    """Pages as plain-text documents, their NAME line and DESCRIPTION (a pretraining corpus)."""
    for path in paths:
        roff = read_page(path)
        if roff is not None:
            parts = sections(roff)
            text = "\n\n".join(_paragraphs(parts.get("DESCRIPTION", "")))
            if text:
                yield f"{' '.join(parts.get('NAME', '').split())}\n\n{text}".strip()
