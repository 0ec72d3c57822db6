"""detect-secrets plugins for the credentials its 1.5 release has no detector for (loaded by
backends/secrets.py as custom plugins): Hugging Face tokens, Google OAuth secrets, Google
credential JSON files, and keys with no vendor prefix where they hide: in URLs, as bare words in a
notebook's cells and outputs, and assigned in settings files."""
import re

from detect_secrets.plugins.base import RegexBasedDetector


class HuggingFaceTokenDetector(RegexBasedDetector):
    """Hugging Face user access tokens (hf_ + 34 letters) and organization API tokens (api_org_)."""

    secret_type = "Hugging Face Token"  # pragma: allowlist secret
    denylist = [re.compile(r"(?<![A-Za-z0-9_])(?:hf_[A-Za-z]{34,}|api_org_[A-Za-z]{34,})(?![A-Za-z0-9])")]


class GoogleOAuthSecretDetector(RegexBasedDetector):
    """Google OAuth client secrets (GOCSPX-...) and refresh tokens (1//...), as in client_secret_*.json
    and the authorized_user token.json that gcloud and google-auth write."""

    secret_type = "Google OAuth Secret"  # pragma: allowlist secret
    denylist = [re.compile(r"GOCSPX-[A-Za-z0-9_-]{28}"), re.compile(r"(?<![A-Za-z0-9/])1//0[A-Za-z0-9_-]{40,}")]


class GoogleCredentialsFileDetector(RegexBasedDetector):
    """Google credential JSON by its type field (a service-account key, gcloud's authorized_user
    token.json, a workload-identity config), whatever the file is called."""

    secret_type = "Google Credentials JSON"  # pragma: allowlist secret
    denylist = [re.compile(r'"type"\s*:\s*"(service_account|authorized_user|external_account)"')]


class EnvAssignmentDetector(RegexBasedDetector):
    """A credential assigned to an environment-style name in any file (shell scripts, .env-like
    files, Dockerfiles, CI configs): `export AWS_SECRET_ACCESS_KEY=...`, `WANDB_API_KEY=...`.
    detect-secrets' keyword detector wants quotes in files it cannot type (.sh among them); a value
    here has a digit, no quotes, `$`, brackets or `%` (a reference, a call, a template), and ends the word."""

    secret_type = "Secret in an environment assignment"  # pragma: allowlist secret
    denylist = [re.compile(
        r"(?:^|[\s;])(?:export\s+|ENV\s+|set\s+)?[A-Z0-9_]*(?:SECRET|PASSWORD|PASSWD|TOKEN|API_?KEY|ACCESS_?KEY|"
        r"PRIVATE_?KEY|CLIENT_?SECRET)[A-Z0-9_]*\s*[=:]\s*[\"']?((?=[^\s\"'$(){}\[\]<>%]*\d)[^\s\"'$(){}\[\]<>%]{8,})"
        r"(?=[\s\"';]|$)", re.MULTILINE)]


class VendorTokenDetector(RegexBasedDetector):
    """Tokens with a fixed prefix that detect-secrets 1.5 does not know: HashiCorp Vault, Databricks."""

    secret_type = "Vendor Token"  # pragma: allowlist secret
    denylist = [re.compile(r"(?<![A-Za-z0-9])hvs\.[A-Za-z0-9_-]{24,}"), re.compile(r"(?<![A-Za-z0-9])dapi[a-f0-9]{32}")]


# What a bare key is made of (base64, base64url, hex, Entra's `~`), and the least a value inside a
# URL or an assignment must hold to count as a credential there, not a placeholder or a name.
_KEY_CHARS = r"A-Za-z0-9+/=_~.\-"
_KEY_WORD = re.compile(rf"[{_KEY_CHARS}]+")
MIN_VALUE_CHARS = 16


def _literal_key(value: str, min_chars: int = MIN_VALUE_CHARS) -> bool:
    """A value shaped like a key: key characters only (no `{`, `$`, `%`, `<`: a template or a
    reference), at least `min_chars` of them, and a digit unless it is twice as long."""
    return (len(value) >= min_chars and _KEY_WORD.fullmatch(value) is not None
            and (any(c.isdigit() for c in value) or len(value) >= 2 * min_chars))


class UrlCredentialDetector(RegexBasedDetector):
    """A credential inside a URL in any file (requirements.txt, code, notebooks, configs), by the rule
    the spec's URL fields follow (workbench/validate.py `url_credentials`): a password or a token as
    the user part (`git+https://<PAT>@dev.azure.com/...`), or a query parameter named like a
    credential (Azure SAS `sig=`, `X-Amz-Signature=`, `X-Goog-Signature=`, `token=`). In files the
    value must also look like a key (`_literal_key`), so `ssh://git@host`, `?key={key}` and pip's
    `${GITHUB_TOKEN}@` pass."""

    secret_type = "Credential in a URL"  # pragma: allowlist secret
    # A URL holding '@' or '=' (its scheme starts at a word boundary: no quadratic rescans of long words).
    denylist = [re.compile(r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]{0,30}+://[^\s\"'<>`\\@=]*+[@=][^\s\"'<>`\\]*")]

    def analyze_string(self, string: str):
        from workbench.validate import url_credentials

        for match in self.denylist[0].finditer(string):
            try:
                found = url_credentials(match.group())
            except ValueError:
                continue
            yield from (value for _, _, value in found if _literal_key(value))


class NotebookKeyDetector(RegexBasedDetector):
    """A bare key in a notebook's text: a JSON string of a cell's source or output, such as the
    stream output of `print(os.environ['WANDB_API_KEY'])` (`"0123...\\n"`) or of `!cat ~/.netrc`
    (`"  password 0123...\\n"`). detect-secrets' entropy detectors only see a key in quotes of its
    own; here each word of such a string is measured against their limits (hex 3.0, base64 4.5 bits
    a character). A commit hash looks the same: clear the output or allow-list the notebook."""

    secret_type = "Bare key in a notebook cell"  # pragma: allowlist secret
    # A word of 20+ key characters that ends a JSON string ("...\n" or "..." at the end of the line).
    denylist = [re.compile(rf"(?<![{_KEY_CHARS}])[{_KEY_CHARS}]{{20,}}+(?=\\n\"|\",?\s*$)", re.MULTILINE)]

    def analyze_line(self, filename: str, line: str, line_number: int = 0, context=None, **kwargs):
        if not filename.lower().endswith(".ipynb"):
            return set()
        return super().analyze_line(filename, line, line_number, context, **kwargs)

    def analyze_string(self, string: str):
        import json

        item = string.strip().removesuffix(",")
        if not (item.startswith('"') and item.endswith('"')):  # a list item; `"image/png": "..."` is data
            return
        try:
            text = json.loads(item)
        except ValueError:
            return
        for word in text.split():
            if len(word) >= 20 and _KEY_WORD.fullmatch(word) and not word.startswith(("/", "~", ".")) and \
                    any(c.isdigit() for c in word) and _entropy(word) > (3.0 if _is_hex(word) else 4.5):
                yield word


def _is_hex(word: str) -> bool:
    return re.fullmatch(r"[0-9a-fA-F]+", word) is not None


def _entropy(word: str) -> float:
    """Shannon entropy in bits a character (detect-secrets' measure)."""
    import math

    return -sum(word.count(c) / len(word) * math.log2(word.count(c) / len(word)) for c in set(word))


# Files whose lines are `name = value` settings (env files, ini, shell, YAML, TOML, AWS's config).
_CONFIG_SUFFIXES = (".env", ".ini", ".cfg", ".conf", ".cnf", ".properties", ".toml", ".yaml", ".yml", ".sh", ".bash",
                    ".zsh", ".txt")
_TOKENIZER_NAMES = ("pad_token", "eos_token", "bos_token", "unk_token", "sep_token", "cls_token", "mask_token")
_PLACEHOLDERS = re.compile(r"(?i)x+|\*+|\.+|change_?me|replace_?me|your[_-].*|none|null|true|false|redacted|"
                           r"placeholder|example|dummy|password|secret|token")


class ConfigAssignmentDetector(RegexBasedDetector):
    """A credential assigned in a settings file, whatever the case of its name and with no digit
    needed: `database_password=...` in `.env-staging`, `DB_PASSWORD=correcthorsebatterystaple`,
    `aws_session_token = IQoJ...` in an AWS config, `client_secret: ...` in YAML. The name ends in
    a credential word; the value is the rest of the line, 8 characters or more with a digit (12 or
    more without: `property` is a word), not a reference (`$`, `%(`, braces, a call), a path, a URL
    or a placeholder (`changeme`, `xxxxxxxx`)."""

    secret_type = "Secret in a settings file"  # pragma: allowlist secret
    denylist = [re.compile(
        r"(?im)^[ \t]*(?:export[ \t]+|set[ \t]+|ENV[ \t]+)?((?:[A-Za-z0-9]+[_.-])*(?:password|passwd|secret|token|"
        r"api_?key|access_?key|secret_?key|private_?key|auth_?key))[ \t]*[=:][ \t]*([\"']?)"
        r"([^\s\"'$(){}\[\]<>%`]{8,})\2[ \t]*(?:#.*)?$")]

    def analyze_line(self, filename: str, line: str, line_number: int = 0, context=None, **kwargs):
        name = re.split(r"[/!]", filename.lower())[-1]
        if not (name.startswith(".env") or "." not in name.lstrip(".") or name.endswith(_CONFIG_SUFFIXES)):
            return set()
        return super().analyze_line(filename, line, line_number, context, **kwargs)

    def analyze_string(self, string: str):
        for match in self.denylist[0].finditer(string):
            key, value = match.group(1).lower(), match.group(3)
            if key.endswith(_TOKENIZER_NAMES) or value.startswith(("/", "~", ".")) or "://" in value \
                    or _PLACEHOLDERS.fullmatch(value) or len(value) < 12 and not any(c.isdigit() for c in value):
                continue
            yield value
