"""How to run each unmodified harness CLI headless against a polar_env gateway, one spec per
(harness, wire API) pair, derived from the presets in ``polar_env.harnesses`` (the data lives in
one module per harness there).

A :class:`ClientSpec` is a template: ``render`` fills in ``{base_url}`` (the gateway root, no
``/v1``), ``{key}`` (the session secret), ``{model}``, ``{home}`` (an absolute, private, empty
directory used as ``$HOME``) and ``{prompt}``; the argv element ``{prompt_words}`` expands to
``prompt.split()``. ``files`` maps a path relative to ``{home}`` to its content; the caller writes
them before starting the CLI. ``env`` is an overlay for a base environment that must still provide
``PATH`` (with ``node`` on it for the npm CLIs); it always sets ``HOME``. Run the CLI with stdin at
``/dev/null`` (Codex reads extra input from a non-TTY stdin until EOF).

Specs are keyed by the CLI's short name (``claude``, ``codex``, ``gemini``, ``qwen``, ``opencode``,
``pi``, ``mini``); ids are ``<short name>-<api>`` (``pi-openai_chat``). Every spec was checked end to
end with ``python -m polar_env.testing.harness_check``; the request bodies seen are in
``tests/fixtures/providers/captured/<harness>-<api>/``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from polar_env.harnesses import HARNESSES
from polar_env.harnesses.spec import KEY_ENV, PROMPT_WORDS, ClientSpec, render
from polar_env.records import ProviderAPI

__all__ = ["CLIENTS", "KEY_ENV", "PROMPT_WORDS", "VERSIONS", "ClientSpec", "get", "render"]

CLIENTS: Mapping[tuple[str, ProviderAPI], ClientSpec] = MappingProxyType({
    (c.name, c.api): c for h in HARNESSES.values() for c in h.clients()
})

VERSIONS: Mapping[str, str] = MappingProxyType({h.cli: h.install.requirement for h in HARNESSES.values()})
"""Short name → the pinned requirement the specs were validated with."""


def get(name: str, api: ProviderAPI | str | None = None) -> ClientSpec:
    """The spec for a harness (short or table name); ``api`` is required only for pi (which speaks all four)."""
    name = HARNESSES[name].cli if name in HARNESSES else name
    matches = [s for (n, a), s in CLIENTS.items() if n == name and (api is None or a == ProviderAPI(api))]
    if len(matches) != 1:
        known = ", ".join(s.id for s in CLIENTS.values())
        raise KeyError(f"no unique client spec for {name!r} api={api!r} (known: {known})")
    return matches[0]
