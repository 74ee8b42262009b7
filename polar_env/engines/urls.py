"""Engine URLs as the settings give them and as clients join paths onto them (the package
re-exports both; its own modules import them from here)."""

from __future__ import annotations

from polar_env.errors import ConfigError


def engine_base_url(url: str) -> str:
    """An engine's base URL as clients join paths onto it. People copy the OpenAI-style base
    (``http://host:8000/v1``) that harnesses want; the clients add ``/v1/...`` themselves, so a
    trailing ``/v1`` would make every call a 404. Refuses what is not an http(s) URL."""
    base = url.strip().rstrip("/")
    if not base.startswith(("http://", "https://")) or len(base.split("://", 1)[1]) == 0:
        raise ConfigError(f"engine URL {url!r} is not an http(s) URL; give one like http://127.0.0.1:8000")
    return base.removesuffix("/v1")


def engine_urls_of(url: str | list[str] | None) -> list[str]:
    """The URLs in an engine ``url`` setting: a list (NeMo RL's ``policy_base_url``) or a
    comma-separated string, each stripped; empty entries dropped."""
    items = url if isinstance(url, list) else (url or "").split(",")
    return [u.strip() for u in items if isinstance(u, str) and u.strip()]
