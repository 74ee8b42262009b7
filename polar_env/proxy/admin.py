"""The admin token: the credential for the control plane (session creation, session reads and
closes, pause/resume/status). It is always on: an agent in a sandbox must never be able to read
another rollout, close it, or pause the gateway.

Where it comes from: ``--admin-token`` (used as given, nothing written), else ``<store>/admin_token``
(a previous run's), else a fresh random token written there with mode 0600, so the trainer on the
same machine can read it and nothing else can. In-process users get ``app[CONFIG].admin_token``.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from polar_env.errors import ConfigError
from polar_env.journal.store import key_digest

TOKEN_FILE = "admin_token"


def new_admin_token() -> str:
    return f"polar-admin-{secrets.token_urlsafe(32)}"


def load_or_create_admin_token(store_root: Path, token: str | None) -> tuple[str, Path | None]:
    """(token, file it lives in or None when given explicitly); see the module docstring."""
    if token:
        return token, None
    path = store_root / TOKEN_FILE
    try:
        existing = path.read_text().strip()
    except FileNotFoundError:
        existing = ""
    except OSError as exc:
        raise ConfigError(f"cannot read the admin token file {path}: {exc.strerror or exc}") from exc
    if existing:
        return existing, path
    token = new_admin_token()
    try:
        store_root.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, (token + "\n").encode())
        finally:
            os.close(fd)
    except OSError as exc:
        raise ConfigError(f"cannot write the admin token file {path}: {exc.strerror or exc}") from exc
    return token, path


def bearer_token(authorization: str) -> str:
    return authorization[7:].strip() if authorization[:7].lower() == "bearer " else ""


def token_matches(given: str, expected: str) -> bool:
    """Constant-time comparison (over digests, so lengths do not leak either)."""
    return bool(given) and hmac.compare_digest(key_digest(given), key_digest(expected))
