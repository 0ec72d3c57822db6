"""A small reader of bash launch scripts: the words of each command after the script's own variables.

Megatron-LM and Megatron-DeepSpeed scripts collect their flags in variables (``GPT_ARGS="..."``,
``options="..."``, ``megatron_options="${megatron_options} ..."``, arrays ``ARGS=(...)``) and expand
them on the launch line. This reads, in order: assignments (strings, arrays, ``$((...))`` integer
arithmetic, ``${VAR:-default}``), ``if`` blocks whose test compares resolved values, and commands,
with bash's quoting and word splitting. What it cannot know (a command's output ``$(...)``, the
environment, the script's arguments, a test on files) is kept as the literal ``$NAME`` and the
name is reported with the reason, never guessed. Nothing is executed.
"""
from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_ASSIGN = re.compile(rf"^({_NAME})(\+?)=")
_HEREDOC = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")
_BLOCK_OPEN = {"for", "while", "until", "case", "select"}
_BLOCK_CLOSE = {"done", "esac"}


class Unresolved:
    """A value this reader cannot know, with the reason."""

    def __init__(self, why: str):
        self.why = why


@dataclass
class Command:
    """One command's words after expansion, and the variables it used that could not be resolved."""

    words: list[str]
    unresolved: dict[str, str] = field(default_factory=dict)  # name -> why
    skipped: dict[str, str] = field(default_factory=dict)  # name -> the `if` whose assignment to it was not applied


@dataclass
class Script:
    commands: list[Command]


def read_script(text: str) -> Script:
    """The commands of a bash script, each with its words expanded from the script's variables."""
    reader = _Reader()
    for stmt in _statements(_drop_heredocs(text)):
        reader.run(stmt)
    return Script(reader.commands)


def _drop_heredocs(text: str) -> str:
    """Here-documents (``cat <<EOT > ds_config.json ... EOT``) are file contents, not commands."""
    out, end = [], None
    for line in text.splitlines():
        if end is not None:
            if line.strip() == end:
                end = None
            continue
        m = _HEREDOC.search(line)
        if m and "'" not in line[:m.start()].replace("\\'", ""):
            end = m.group(2)
        out.append(line)
    return "\n".join(out)


def _statements(text: str) -> list[str]:
    """Split on newlines, ``;``, ``&&``, ``||``, ``|``, ``&`` outside quotes, parentheses and backslash-newlines."""
    out, cur, i, depth, quote = [], [], 0, 0, ""
    n = len(text)
    while i < n:
        c = text[i]
        if quote == "'":
            cur.append(c)
            if c == "'":
                quote = ""
        elif c == "\\" and i + 1 < n:
            if text[i + 1] == "\n":
                cur.append(" ")
            else:
                cur.append(text[i:i + 2])
            i += 2
            continue
        elif c == "$" and text.startswith("$(", i):  # a command substitution is one unit, quotes and all
            end = _closing(text, i + 1)
            cur.append(text[i:end + 1])
            i = end + 1
            continue
        elif quote == '"':
            cur.append(c)
            if c == '"':
                quote = ""
        elif c in "'\"`":
            quote = c if c != "`" else ""
            cur.append(c)
        elif c == "#" and (not cur or cur[-1][-1:].isspace() or cur[-1] in ";(") and depth == 0:
            while i < n and text[i] != "\n":
                i += 1
            continue
        elif c == "(":
            depth += 1
            cur.append(c)
        elif c == ")":
            depth = max(0, depth - 1)
            cur.append(c)
        elif c == "&" and (text[i - 1:i] in "<>" or text[i + 1:i + 2] == ">"):
            cur.append(c)  # a redirection (2>&1, &>>), not a separator
        elif depth == 0 and (c in "\n;|&"):
            out.append("".join(cur))
            cur = []
            while i + 1 < n and text[i + 1] in "|&" and c in "|&":
                i += 1
        else:
            cur.append(c)
        i += 1
    if quote:
        raise ValueError(f"no closing quotation {quote}")
    out.append("".join(cur))
    return [s.strip() for s in out if s.strip()]


def _raw_words(stmt: str) -> list[str]:
    """Words of a statement with their quotes kept (expansion comes later)."""
    words, cur, i, depth, quote = [], "", 0, 0, ""
    while i < len(stmt):
        c = stmt[i]
        if c == "$" and stmt.startswith("$(", i) and quote != "'":
            end = _closing(stmt, i + 1)
            cur += stmt[i:end + 1]
            i = end + 1
            continue
        if quote:
            cur += c
            if c == "\\" and quote == '"' and i + 1 < len(stmt):
                cur += stmt[i + 1]
                i += 1
            elif c == quote:
                quote = ""
        elif c == "\\" and i + 1 < len(stmt):
            cur += stmt[i:i + 2]
            i += 1
        elif c in "'\"`":
            quote = c
            cur += c
        elif c == "(":
            depth += 1
            cur += c
        elif c == ")":
            depth = max(0, depth - 1)
            cur += c
        elif c.isspace() and depth == 0:
            if cur:
                words.append(cur)
            cur = ""
        elif c == "#" and not cur and depth == 0:
            break
        else:
            cur += c
        i += 1
    if cur:
        words.append(cur)
    return words


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Mod: operator.mod,
        ast.Pow: operator.pow, ast.FloorDiv: operator.floordiv}


def _arith(expr: str) -> int:
    """bash integer arithmetic on numbers: + - * / % ** and parentheses (division truncates), in
    bash's signed 64-bit integers: every result wraps, so `2**2**2**2**3` is a number, not a hang."""
    def wrap(v: int) -> int:
        v &= (1 << 64) - 1
        return v - (1 << 64) if v >> 63 else v

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return wrap(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return wrap(-ev(node.operand)) if isinstance(node.op, ast.USub) else ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in (ast.Div, ast.Mod, ast.Pow):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow):
                if b < 0:
                    raise ValueError(expr)  # bash: "exponent less than 0"
                return wrap(pow(a, b, 1 << 64))
            if b == 0:
                raise ValueError(expr)  # bash: "division by 0"
            q = abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)  # truncating, as C
            return wrap(q) if isinstance(node.op, ast.Div) else wrap(a - q * b)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return wrap(_OPS[type(node.op)](ev(node.left), ev(node.right)))
        raise ValueError(expr)
    try:
        return ev(ast.parse(expr.strip(), mode="eval"))
    except (SyntaxError, RecursionError, MemoryError):
        raise ValueError(expr) from None


class _Reader:
    def __init__(self) -> None:
        self.vars: dict[str, str | list[str] | Unresolved] = {}
        self.refs: dict[str, dict[str, str]] = {}  # var -> unresolved names inside its value
        self.skipped: dict[str, str] = {}  # var -> the condition under which an assignment was not applied
        self.deps: dict[str, set[str]] = {}  # var -> the variables its value was built from
        self.frames: list[list] = []  # [active: True/False/None (unknown), a branch taken]
        self.commands: list[Command] = []

    # -- control flow ----------------------------------------------------------------------------
    def active(self) -> bool | None:
        if any(f[0] is False for f in self.frames):
            return False
        return None if any(f[0] is None for f in self.frames) else True

    def run(self, stmt: str) -> None:
        words = _raw_words(stmt)
        if not words:
            return
        head = words[0]
        if head in ("then", "do", "else", "{") and len(words) > 1 and head != "else":
            return self.run(stmt[len(head):].strip())
        if head == "if":
            cond = self.test(words[1:]) if self.active() is not False else False
            self.frames.append([cond, cond is True, " ".join(words[1:])])
        elif head == "elif" and self.frames:
            frame = self.frames[-1]
            if frame[1]:
                frame[0] = False
            else:
                cond = self.test(words[1:])
                frame[0], frame[1], frame[2] = cond, cond is True, " ".join(words[1:])
        elif head == "else" and self.frames:
            frame = self.frames[-1]
            frame[0] = False if frame[1] else (None if frame[0] is None else True)
            if len(words) > 1:
                self.run(stmt[4:].strip())
        elif head == "fi" and self.frames:
            self.frames.pop()
        elif head in _BLOCK_OPEN or (len(words) > 1 and words[-1] == "{") or head == "function":
            self.frames.append([None, False, " ".join(words)])  # loops and functions are not run
        elif head in _BLOCK_CLOSE or head == "}":
            if self.frames:
                self.frames.pop()
        elif head in ("then", "do"):
            return
        else:
            self.simple(words)

    def test(self, words: list[str]) -> bool | None:
        """`[ a = b ]`, `[[ $n -gt 1 ]]`, `[ -z "$x" ]`, `!`; None when it cannot be known."""
        words = [w for w in words if w not in ("[", "]", "[[", "]]", ";", "then")]
        negate = bool(words) and words[0] == "!"
        if negate:
            words = words[1:]
        refs: dict[str, str] = {}
        vals = [(self.expand(w, refs, split=False) or [""])[0] for w in words]
        if refs:
            return None
        result: bool | None = None
        if len(vals) == 3 and vals[1] in ("=", "==", "!="):
            result = (vals[0] == vals[2]) == (vals[1] != "!=")
        elif len(vals) == 3 and vals[1] in ("-eq", "-ne", "-gt", "-ge", "-lt", "-le"):
            try:
                a, b = int(vals[0]), int(vals[2])
            except ValueError:
                return None
            result = {"-eq": a == b, "-ne": a != b, "-gt": a > b, "-ge": a >= b, "-lt": a < b, "-le": a <= b}[vals[1]]
        elif len(vals) == 2 and vals[0] in ("-z", "-n"):
            result = (vals[1] == "") == (vals[0] == "-z")
        if result is None:
            return None
        return not result if negate else result

    # -- statements -------------------------------------------------------------------------------
    def simple(self, words: list[str]) -> None:
        active = self.active()
        if words[0] in ("export", "local", "declare", "readonly", "typeset"):
            words = [w for w in words[1:] if not w.startswith("-")]
            only_assign = True
        else:
            only_assign = False
        assigned = 0
        for w in words:
            m = _ASSIGN.match(w)
            if not m:
                break
            assigned += 1
            name, append, value = m.group(1), m.group(2), w[m.end():]
            if active is not True:
                if active is None:
                    self.skipped[name] = self.frames[-1][2] if self.frames else ""
                continue
            self.assign(name, value, bool(append))
        if assigned == len(words) or only_assign or active is not True:
            return
        refs: dict[str, str] = {}
        out: list[str] = []
        rest = words[assigned:]
        k = 0
        while k < len(rest):
            w = rest[k]
            if re.fullmatch(r"\d*(>>?|<|&>>?)&?", w):  # a redirection and its target
                k += 2
                continue
            if not re.match(r"\d*(>>?|<|&>>?)", w):
                out += self.expand(w, refs, split=True)
            k += 1
        used, todo = set(), _names(" ".join(rest))
        while todo:
            name = todo.pop()
            if name not in used:
                used.add(name)
                todo |= self.deps.get(name, set())
        self.commands.append(Command(out, refs, {n: c for n, c in self.skipped.items() if n in used}))

    def assign(self, name: str, value: str, append: bool) -> None:
        refs: dict[str, str] = {}
        if value.startswith("(") and value.endswith(")"):
            items: list[str] = []
            for line in value[1:-1].splitlines():
                for w in _raw_words(line):
                    items += self.expand(w, refs, split=True)
            old = self.vars.get(name)
            new: str | list[str] | Unresolved = (old if isinstance(old, list) and append else []) + items
        else:
            pieces = self.expand(value, refs, split=False)
            text = pieces[0] if pieces else ""
            whole = re.fullmatch(r"\$\{?(" + _NAME + r"|@|\*|\d)\}?", text)
            if whole and whole.group(1) in refs:  # the value is one unknown: keep why it is unknown
                new = Unresolved(refs[whole.group(1)])
                refs = {}
            elif text.startswith("$((") or text.startswith("$(") or text.startswith("`"):
                new = Unresolved(refs.get("", "the output of a command"))
                refs.pop("", None)
            else:
                old = self.vars.get(name)
                new = (old if isinstance(old, str) and append else "") + text
        self.vars[name] = new
        names, before = _names(value), self.deps.get(name, set())
        self.deps[name] = names | (before if append or name in names else set())
        self.refs[name] = {k: v for k, v in refs.items() if k}
        self.skipped.pop(name, None)

    # -- expansion --------------------------------------------------------------------------------
    def lookup(self, name: str, refs: dict[str, str]) -> str | list[str] | None:
        if name in ("@", "*") or name.isdigit():
            refs[name] = "the script's arguments"
            return None
        value = self.vars.get(name)
        if value is None:
            refs[name] = "not set in the script (the environment's)"
            return None
        if isinstance(value, Unresolved):
            refs[name] = value.why
            return None
        refs.update(self.refs.get(name, {}))
        return value

    def expand(self, raw: str, refs: dict[str, str], split: bool) -> list[str]:
        """Expand one raw word: quotes removed, $VARS substituted; unquoted expansions split when `split`."""
        out = _Words(split)
        i, quote = 0, ""
        while i < len(raw):
            c = raw[i]
            if quote == "'" or (c == "'" and not quote) or c == '"' or (c == "\\" and i + 1 < len(raw)):
                i, quote = _quoting(raw, i, quote, out)
            elif c in "$`":
                i = self._expansion(raw, i, quote, refs, out)
            else:
                out.plain(c)
                i += 1
        return out.done()

    def _expansion(self, raw: str, i: int, quote: str, refs: dict[str, str], out: _Words) -> int:
        """Expand the $((...)), $(...), `...` or $VAR at raw[i] into `out`; returns the index after it."""
        c = raw[i]
        if raw.startswith("$((", i):
            end = _closing(raw, i + 1)
            out.emit(self.arith(raw[i + 3:end - 1], refs, raw[i:end + 1]), not quote)
            return end + 1
        if c == "`" or raw.startswith("$(", i):
            end = _closing(raw, i + 1) if c == "$" else raw.find("`", i + 1)
            end = len(raw) - 1 if end < 0 else end
            refs[""] = "the output of a command"
            out.emit(raw[i:end + 1], False)
            return end + 1
        return self._variable(raw, i, quote, refs, out)

    def _variable(self, raw: str, i: int, quote: str, refs: dict[str, str], out: _Words) -> int:
        """Expand the $NAME, ${NAME}, ${NAME:-default} or ${A[i]} at raw[i]; a lone $ stays as it is."""
        m = re.match(r"\$\{(#?)(" + _NAME + r"|@|\*|\d+)(\[[@*0-9]+\])?(?::?([-=+?])([^}]*))?\}|\$(" + _NAME
                     + r"|@|\*|\d)", raw[i:])
        if not m:
            out.cur += "$"
            return i + 1
        name = m.group(2) or m.group(6)
        local: dict[str, str] = {}
        value = self.lookup(name, local)
        if value is None and m.group(4) in ("-", "="):
            value = (self.expand(m.group(5) or "", refs, split=False)[:1] or [""])[0]
            local = {}
        refs.update(local)
        if value is None:
            out.emit("${" + name + "}", False)
        elif isinstance(value, list):
            out.array(value, (m.group(3) or "[@]")[1:-1], quote)
        else:
            out.emit(str(value), not quote)
        return i + len(m.group(0))

    def arith(self, expr: str, refs: dict[str, str], literal: str) -> str:
        local: dict[str, str] = {}

        def sub(m: re.Match) -> str:
            name = m.group(1) or m.group(2) or m.group(3)
            value = self.lookup(name, local)
            return "0" if value is None or isinstance(value, list) else str(value)

        if "$(" in expr or "`" in expr:
            refs[""] = "the output of a command"
            return literal
        text = re.sub(r"\$\{(" + _NAME + r")\}|\$(" + _NAME + r")|\b(" + _NAME + r")\b", sub, expr)
        if not local and "$(" not in expr:
            try:
                return str(_arith(text))
            except (ValueError, SyntaxError, ZeroDivisionError, TypeError, RecursionError):
                pass
        why = "; ".join(f"${k}: {v}" for k, v in local.items() if k) or "arithmetic this reader cannot evaluate"
        refs[""] = f"arithmetic on {why}" if local else why
        return literal


class _Words:
    """The words one raw word expands to, built a character or an expansion at a time."""

    def __init__(self, split: bool):
        self.split = split  # unquoted expansions split at whitespace
        self.words: list[str] = []
        self.cur = ""
        self.has = False  # the current word exists even if empty ("" or '')

    def plain(self, c: str) -> None:
        self.cur += c
        self.has = self.has or not c.isspace()

    def _next_word(self) -> None:
        self.words.append(self.cur)
        self.cur, self.has = "", False

    def emit(self, text: str, splittable: bool) -> None:
        if not (self.split and splittable):
            self.cur += text
            self.has = self.has or bool(text)
            return
        for k, part in enumerate(re.split(r"\s+", text)):
            if k > 0:
                if self.cur or self.has:
                    self.words.append(self.cur)
                self.cur, self.has = "", False
            self.cur += part
            self.has = self.has or bool(part)

    def array(self, value: list[str], index: str, quote: str) -> None:
        """An array's item (index a number), or its items: one word each when splitting ("${A[@]}"
        and ${A[@]}), else joined by spaces."""
        if index.isdigit():
            self.emit(value[int(index)] if int(index) < len(value) else "", not quote)
        elif not self.split:
            self.emit(" ".join(value), False)
        else:
            for k, item in enumerate(value):
                if k > 0:
                    self._next_word()
                self.cur += item
                self.has = True

    def done(self) -> list[str]:
        if self.cur or self.has:
            self.words.append(self.cur)
        return self.words


def _quoting(raw: str, i: int, quote: str, out: _Words) -> tuple[int, str]:
    """One step of quoting at raw[i]: a character inside '...', a quote opening or closing, or a
    backslash escape. Returns (the next index, the quote now open)."""
    c = raw[i]
    if quote == "'":
        if c == "'":
            return i + 1, ""
        out.cur += c
        return i + 1, quote
    if c == "'":  # opening: not inside "..." (there it is a plain character)
        out.has = True
        return i + 1, "'"
    if c == '"':
        out.has = True
        return i + 1, "" if quote == '"' else '"'
    nxt = raw[i + 1]  # a backslash and the character it escapes
    out.cur += nxt if (not quote or nxt in '$`"\\') else c + nxt
    return i + 2, quote


def _names(raw: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"\$\{?#?(" + _NAME + ")", raw)}


def _closing(text: str, start: int) -> int:
    """Index of the parenthesis closing the one at `start` (quotes respected)."""
    depth, quote = 0, ""
    for j in range(start, len(text)):
        c = text[j]
        if quote:
            if c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return j
    return len(text) - 1
