"""detect-secrets plugins for the credentials its 1.5 release has no detector for (loaded by
backends/secrets.py as custom plugins): Hugging Face tokens, Google OAuth secrets and Google
credential JSON files."""
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
