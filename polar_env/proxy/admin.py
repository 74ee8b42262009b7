"""The admin token: the credential for the control plane (session creation, session reads and
closes, pause/resume/status). It is always on: an agent in a sandbox must never be able to read
another rollout, close it, or pause the gateway.

Where it comes from: ``--admin-token`` (used as given, nothing written), else ``<store>/admin_token``
(a previous run's), else a fresh random token written there with mode 0600, so the trainer on the
same machine can read it and nothing else can. In-process users get ``app[CONFIG].admin_token``.

Gateway nodes (``polar-env rollout`` / ``serve``) keep their admin token in memory, and write a
read-only metrics token to ``<store>/<node>/metrics_token`` (0600, on the node's host): it opens
``GET /metrics`` and nothing else, so an operator's Prometheus can scrape a node without holding a
credential that can close sessions. Sandboxes never see the store.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from polar_env.errors import ConfigError
from polar_env.journal.protocols import key_digest

TOKEN_FILE = "admin_token"
METRICS_TOKEN_FILE = "metrics_token"  # a node's read-only scrape credential, next to its journals


def new_admin_token(kind: str = "admin") -> str:
    return f"polar-{kind}-{secrets.token_urlsafe(32)}"


def load_or_create_admin_token(store_root: Path, token: str | None, name: str = TOKEN_FILE,
                               kind: str = "admin") -> tuple[str, Path | None]:
    """(token, file it lives in or None when given explicitly); see the module docstring.
    ``name``/``kind``: another credential kept the same way (the metrics token)."""
    if token:
        return token, None
    path = store_root / name
    try:
        existing = path.read_text().strip()
    except FileNotFoundError:
        existing = ""
    except OSError as exc:
        raise ConfigError(f"cannot read the admin token file {path}: {exc.strerror or exc}") from exc
    if existing:
        return existing, path
    token = new_admin_token(kind)
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
