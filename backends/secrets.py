"""What a code bundle never carries: credential files and folders by name, and credentials by
content, found by detect-secrets' plugins (AWS, Azure, GitHub, GitLab, OpenAI, Slack, Stripe,
private keys, JWTs, basic auth, passwords by keyword, high-entropy strings, ...) plus ours for
Hugging Face and Google OAuth, credentials in URLs, bare keys in notebooks and secrets in settings
files (backends/secret_plugins.py).

Every shipped file is scanned whole, whatever its size, as a stream: lines longer than
MAX_LINE_CHARS are cut into overlapping pieces, bytes that are not UTF-8 are read as Latin-1 so
that a key inside a binary file is still seen. detect-secrets costs ~0.4 ms a line, so each block
is first searched with the plugins' own regular expressions and only lines where one matches go
through detect-secrets' line pipeline (its filters included, e.g. `# pragma: allowlist secret`).
The slowest expressions (the keyword list's, Cloudant's, IBM's, SoftLayer's: alternations with no
literal start) run only on the lines holding a word they cannot match without ("key", "pass", ...):
1.7 -> 0.52 s a MiB of binary data and 1.3 -> 0.55 s a MiB of text on this 2-core host.
"""
from __future__ import annotations

import bisect
import fnmatch
import itertools
import re
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from workbench.errors import ConfigError

# Files that are credentials whatever they hold (matched on the name), and folders that hold them.
CREDENTIAL_NAMES = [
    ".env", ".env.*", ".env-*", ".env_*", "*.env", "*.env.*", ".envrc", "*.pem", "*.key", "*.p12", "*.pfx", "*.jks", "*.keystore", "*.ppk",
    "id_rsa*", "id_dsa*", "id_ed25519*", "id_ecdsa*", ".netrc", "_netrc", ".pypirc", ".npmrc", ".yarnrc.yml",
    ".pgpass", ".git-credentials", ".dockercfg", "credentials", "credentials.json", "*credentials*.json",
    "credentials.toml", "*service-account*.json", "*service_account*.json", "application_default_credentials.json",
    "client_secret*.json", "token.json", "kaggle.json", "kubeconfig", "*.kubeconfig", ".htpasswd", ".s3cfg", ".boto",
    ".databrickscfg", ".vault-token", ".*_history", "*.tfstate", "*.tfstate.backup", "*.tfvars", "secrets.yaml",
    "secrets.yml", "secrets.toml",
]  # matched case-insensitively
CREDENTIAL_DIRS = {".aws", ".azure", ".gcloud", ".ssh", ".gnupg", ".docker", ".kube", ".kaggle", ".config/gcloud",
                   ".config/gh", ".huggingface", ".cache/huggingface"}
MAX_LINE_CHARS = 64 * 1024  # longer lines are scanned in pieces of this size ...
OVERLAP_CHARS = 512  # ... each repeating the previous piece's last characters: no key is cut in two
_BLOCK_BYTES = 1 << 20
_SKIPPED_PLUGINS = {"IPPublicDetector"}  # a public IP address is not a credential


@dataclass(frozen=True)
class Finding:
    """A credential in a file that was to be shipped: where and what kind (never the value)."""

    path: str
    line: int
    kind: str

    def __str__(self) -> str:
        return f"{self.path}, line {self.line}: {self.kind}"


def credential_name(relpath: str) -> str | None:
    """Why the file at `relpath` (relative, '/'-separated) is a credential by its name alone, or None."""
    parts = relpath.lower().split("/")
    for i in range(len(parts) - 1):
        if parts[i] in CREDENTIAL_DIRS or "/".join(parts[i:i + 2]) in CREDENTIAL_DIRS:
            return f"credential folder {parts[i]}/"
    if any(fnmatch.fnmatchcase(parts[-1], p) for p in CREDENTIAL_NAMES):
        return "credential file (by its name)"
    return None


def _settings_config() -> dict:
    from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class

    plugins = [{"name": cls.__name__} for cls in get_mapping_from_secret_type_to_class().values()
               if cls.__module__.startswith("detect_secrets.plugins.") and cls.__name__ not in _SKIPPED_PLUGINS]
    path = Path(__file__).with_name("secret_plugins.py")
    plugins += [{"name": name, "path": path.as_uri()}
                for name in ("HuggingFaceTokenDetector", "GoogleOAuthSecretDetector", "GoogleCredentialsFileDetector",
                             "EnvAssignmentDetector", "VendorTokenDetector", "UrlCredentialDetector",
                             "NotebookKeyDetector", "ConfigAssignmentDetector")]
    return {"plugins_used": plugins}


# A pattern that needs one of these groups at its top level only matches a line holding one of the
# literals (lower-cased): it runs on those lines alone. Keyed by the group's exact text, so a
# detect-secrets release that words them otherwise is searched everywhere, as before.
_REQUIRED_GROUPS = {
    "(?:key|pwd|pw|password|pass|token)": ("key", "pw", "pass", "token"),  # Cloudant
    "(?:key|pwd|password|pass|token)": ("key", "pw", "pass", "token"),  # IBM Cloud IAM, SoftLayer
    "(?:secret[-_]?(?:access)?[-_]?key)": ("key",),  # IBM COS HMAC
}
_DENYLIST_LITERALS = ("key", "pass", "pwd", "secret", "contrase")  # every entry of keyword.DENYLIST holds one

Gate = tuple[str, ...] | re.Pattern | None  # literals a line must hold, a block-wide regex, or nothing


def _candidate_patterns(plugins) -> list[tuple[Gate, list[re.Pattern]]] | None:
    """Every regular expression the plugins search lines with, recompiled per line (MULTILINE), as
    (gate, patterns): the patterns run only where the gate lets them (the lines holding one of its
    literals, or the blocks its regex matches); None when a plugin has no such list (then every line
    is a candidate)."""
    from detect_secrets.plugins import keyword
    from detect_secrets.plugins.high_entropy_strings import HighEntropyStringsPlugin

    def per_line(patterns) -> list[re.Pattern]:
        unique = {(p.pattern, p.flags): p for p in patterns}
        return [re.compile(p.pattern, p.flags | re.MULTILINE) for p in unique.values()]

    plain, keywords = [], []
    for plugin in plugins:
        if isinstance(plugin, keyword.KeywordDetector):
            tables = [keyword.QUOTES_REQUIRED_DENYLIST_REGEX_TO_GROUP, *keyword.REGEX_BY_FILETYPE.values()]
            keywords += [p for table in tables for p in table]
        elif isinstance(plugin, HighEntropyStringsPlugin):
            plain.append(plugin.regex)
        elif hasattr(plugin, "denylist"):
            plain += list(plugin.denylist)
        else:
            return None
    by_gate: dict[Gate, list] = {}
    for p in plain:
        by_gate.setdefault(_required_literals(p.pattern), []).append(p)
    if keywords:
        simple = all(re.fullmatch(r"[a-zñ]+", e.replace("_?", "")) and any(lit in e.replace("_?", "")
                                                                         for lit in _DENYLIST_LITERALS)
                     for e in keyword.DENYLIST)  # plain words (an optional "_" at most): each match holds its literal
        gate = _DENYLIST_LITERALS if simple else re.compile("|".join(keyword.DENYLIST), re.IGNORECASE)
        by_gate.setdefault(gate, []).extend(keywords)
    return [(gate, per_line(patterns)) for gate, patterns in by_gate.items()]


def _required_literals(pattern: str) -> tuple[str, ...] | None:
    """The literals of a `_REQUIRED_GROUPS` group the pattern needs (at its top level, not optional)."""
    for group, literals in _REQUIRED_GROUPS.items():
        at = pattern.find(group)
        if at < 0 or pattern[at + len(group):at + len(group) + 1] in ("?", "*", "{"):
            continue
        before = re.sub(r"\\.", "", pattern[:at])  # (escaped parentheses are not groups)
        if before.count("(") != before.count(")"):
            continue  # inside a group
        while (closed := re.sub(r"\([^()]*\)", "", before)) != before:  # the groups before it, innermost first
            before = closed
        if "|" not in before:  # no top-level alternative without it
            return literals
    return None


class Scanner:
    """Scans files for credentials under one detect-secrets configuration (a context manager: the
    library's settings are global while it is open). Clean files are remembered by path, size and
    modification time for the life of the process."""

    _clean: set[tuple[str, int, int]] = set()

    def __enter__(self) -> Scanner:
        from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
        from detect_secrets.settings import get_plugins, get_settings, transient_settings

        self._settings = transient_settings(_settings_config())
        self._settings.__enter__()
        # This heuristic drops every line that calls a function, which hides an OpenAI client built
        # with its key inline from every detector; keyword matches need quotes in code anyway.
        get_settings().disable_filters("detect_secrets.filters.heuristic.is_indirect_reference")  # pragma: allowlist secret
        get_mapping_from_secret_type_to_class.cache_clear()  # cached before our plugins were configured
        self.patterns = _candidate_patterns(get_plugins())
        return self

    def __exit__(self, *exc) -> None:
        from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class

        self._settings.__exit__(*exc)
        get_mapping_from_secret_type_to_class.cache_clear()

    def scan_file(self, path: Path, relpath: str) -> Finding | None:
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        if key in self._clean:
            return None
        with open(path, "rb") as f:
            found = self.scan_stream(f, relpath)
        if found is None:
            self._clean.add(key)
        return found

    def scan_bytes(self, data: bytes, relpath: str) -> Finding | None:
        import io

        return self.scan_stream(io.BytesIO(data), relpath)

    def scan_stream(self, f, relpath: str) -> Finding | None:
        """The first credential in a binary stream, read block by block (never whole); the members
        of a compressed file or archive (gzip, bzip2, xz, zip, tar) are scanned as files of their own."""
        from detect_secrets.core.scan import _process_line_based_plugins

        try:
            for name, member in _members(f, relpath, budget=[MAX_EXPANDED_BYTES]):
                for lines in _blocks(member):
                    if name.lower().endswith(".ipynb"):  # a saved figure is base64 that detect-secrets' entropy rule flags
                        lines = [(n, t) for n, t in lines if not _NOTEBOOK_IMAGE.match(t)]
                    for lineno, text in self._candidates(lines):
                        for secret in _process_line_based_plugins([(lineno, text)], filename=name):
                            return Finding(name, lineno, secret.type)
        except _TooLarge:
            return Finding(relpath, 1, f"an archive that expands past {MAX_EXPANDED_BYTES >> 30} GiB, so it cannot be "
                                       "scanned whole")
        except (OSError, EOFError, ValueError, zipfile.BadZipFile, tarfile.TarError) as e:  # what it holds is unknown
            return Finding(relpath, 1, f"a compressed file or archive that does not open ({type(e).__name__})")
        return None

    def _candidates(self, lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
        """The lines of a block where one of the plugins' expressions matches: each group of them
        searched over the lines its gate lets through, as one text."""
        if self.patterns is None:
            return lines
        text = "\n".join(t for _, t in lines)
        starts = list(itertools.accumulate((len(t) + 1 for _, t in lines[:-1]), initial=0))
        low = text.lower()
        if len(low) != len(text):  # (a character whose lower case is longer: positions would not line up)
            low = ""
        hit: set[int] = set()
        for gate, patterns in self.patterns:
            if isinstance(gate, tuple) and low:
                rows = sorted(_lines_holding(low, gate, starts))
                if not rows:
                    continue
                sub = "\n".join(lines[i][1] for i in rows)
                sub_starts = list(itertools.accumulate((len(lines[i][1]) + 1 for i in rows[:-1]), initial=0))
                found = _matched_lines(sub, sub_starts, patterns)
                hit.update(rows[i] for i in found)
                continue
            if isinstance(gate, re.Pattern) and not gate.search(text):
                continue
            hit |= _matched_lines(text, starts, patterns)
        return [lines[i] for i in sorted(hit)]


# A notebook output's image, as Jupyter saves it: one base64 JSON string on the line of its MIME type.
_NOTEBOOK_IMAGE = re.compile(r'\s*"image/(?:png|jpeg|gif|webp|bmp)": "[A-Za-z0-9+/=]*(?:\\n)?",?\s*$')


def _lines_holding(low: str, literals: tuple[str, ...], starts: list[int]) -> set[int]:
    """Indices of the lines (starting at `starts`) of a lower-cased text that hold one of `literals`."""
    rows: set[int] = set()
    for lit in literals:
        at = low.find(lit)
        while at >= 0:
            row = bisect.bisect_right(starts, at) - 1
            rows.add(row)
            at = low.find(lit, starts[row + 1] if row + 1 < len(starts) else len(low))  # the next line on
    return rows


def _matched_lines(text: str, starts: list[int], patterns: list[re.Pattern]) -> set[int]:
    hit: set[int] = set()
    for p in patterns:
        for m in p.finditer(text):
            first, last = bisect.bisect_right(starts, m.start()) - 1, bisect.bisect_right(starts, m.end()) - 1
            hit.update(range(first, last + 1))
    return hit


MAX_EXPANDED_BYTES = 1 << 30  # what the archives of one file may expand to (a bomb is refused, not scanned)
_MAGIC = ((b"\x1f\x8b", "gz"), (b"BZh", "bz2"), (b"\xfd7zXZ\x00", "xz"), (b"PK\x03\x04", "zip"))


class _TooLarge(Exception):
    pass


class _Counted:
    """A read-only stream that counts what is read from it against a shared budget."""

    def __init__(self, f, budget: list[int]):
        self.f, self.budget = f, budget

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n if n is not None and n >= 0 else _BLOCK_BYTES)
        self.budget[0] -= len(data)
        if self.budget[0] < 0:
            raise _TooLarge
        return data


def _kind(f) -> str | None:
    head = f.read(512)
    f.seek(0)
    kind = next((k for magic, k in _MAGIC if head.startswith(magic)), None)
    return kind or ("tar" if head[257:262] == b"ustar" else None)


def _members(f, name: str, budget: list[int], depth: int = 0):
    """(name, stream) of the file itself, or of each member of the archive it is (two levels deep)."""
    import bz2
    import gzip
    import lzma

    kind = _kind(f) if depth < 2 and f.seekable() else None
    if kind is None:
        yield name, (_Counted(f, budget) if depth else f)
    elif kind in ("gz", "bz2", "xz"):
        inner = gzip.GzipFile(fileobj=f) if kind == "gz" else bz2.BZ2File(f) if kind == "bz2" else lzma.LZMAFile(f)
        base = name.rsplit("/", 1)[-1]
        with inner:
            yield from _members(inner, f"{name}!{re.sub(r'[.](gz|tgz|bz2|xz)$', '', base) or base}", budget, depth + 1)
    elif kind == "zip":
        with zipfile.ZipFile(f) as z:
            for info in z.infolist():
                if not info.is_dir():
                    with z.open(info) as member:
                        yield from _members(member, f"{name}!{info.filename}", budget, depth + 1)
    else:
        with tarfile.open(fileobj=f, mode="r:") as tar:
            for info in tar:
                member = tar.extractfile(info) if info.isfile() else None
                if member is not None:
                    yield from _members(member, f"{name}!{info.name}", budget, depth + 1)


def _blocks(f):
    """Lists of (line number, text) of a binary stream, ~1 MiB a list; long lines come in
    overlapping pieces."""
    number, buf, decode = 1, "", _decoder()
    while True:
        block = f.read(_BLOCK_BYTES)
        buf += decode(block, not block)
        lines = buf.split("\n")
        buf = lines.pop() if block else ""
        out = []
        for line in lines:
            out += _pieces(number, line)
            number += 1
        while len(buf) > MAX_LINE_CHARS:  # a line longer than a piece that is still being read
            out.append((number, buf[:MAX_LINE_CHARS]))
            buf = buf[MAX_LINE_CHARS - OVERLAP_CHARS:]
        if out:
            yield out
        if not block:
            return


def _pieces(number: int, line: str) -> list[tuple[int, str]]:
    return [(number, line[start:start + MAX_LINE_CHARS])
            for start in range(0, max(1, len(line) - OVERLAP_CHARS), MAX_LINE_CHARS - OVERLAP_CHARS)]


def _decoder():
    """A decoder for the stream's text: UTF-16/32 by its byte-order mark or by NULs between ASCII
    letters, else UTF-8, else Latin-1 (every byte a character) from the first block that is not."""
    import codecs

    state: dict = {}

    def decode(block: bytes, final: bool) -> str:
        if "codec" not in state:
            state["codec"] = _encoding(block)
            state["decoder"] = codecs.getincrementaldecoder(state["codec"])(errors="replace"
                                                                            if state["codec"] != "utf-8" else "strict")
        if state["codec"] == "latin-1":
            return block.decode("latin-1")
        try:
            return state["decoder"].decode(block, final)
        except UnicodeDecodeError:
            state["codec"] = "latin-1"
            return block.decode("latin-1")

    return decode


def _encoding(head: bytes) -> str:
    for bom, codec in ((b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"), (b"\xff\xfe", "utf-16"),
                       (b"\xfe\xff", "utf-16")):
        if head.startswith(bom):
            return codec
    sample = head[:4096]
    if len(sample) >= 16:
        odd, even = sample[1::2].count(0) / (len(sample) // 2), sample[0::2].count(0) / (len(sample) // 2)
        if odd > 0.4 and even < 0.05:
            return "utf-16-le"
        if even > 0.4 and odd < 0.05:
            return "utf-16-be"
    return "utf-8"


def refuse(findings: list[Finding], root: Path) -> ConfigError:
    """The dispatch's refusal: each file, line and kind (never the value), and the two fixes."""
    listed = "; ".join(map(str, findings[:10])) + (f"; and {len(findings) - 10} more" if len(findings) > 10 else "")
    return ConfigError(
        f"code bundle: {len(findings)} file(s) to ship hold what looks like a credential ({listed}). A cloud job "
        "gets its own identity from the cloud and never needs your keys. Remove the credential (read it from the "
        "environment or the cloud's secret store), add the file to .gitignore, or, if it is a false positive, list "
        f"its path (relative to {root}) in backend.secrets_allowlist, or mark the line '# pragma: allowlist secret'.")


def scan_paths(files: dict[str, Path], generated: dict[str, bytes], allow: set[str]) -> list[Finding]:
    """Findings in the bundle's files (arcname -> path) and generated files (arcname -> bytes),
    except the allow-listed arcnames."""
    findings = []
    with Scanner() as scanner:
        for name in sorted(files):
            if name not in allow and (found := scanner.scan_file(files[name], name)):
                findings.append(found)
        for name in sorted(generated):
            if name not in allow and (found := scanner.scan_bytes(generated[name], name)):
                findings.append(found)
    return findings
