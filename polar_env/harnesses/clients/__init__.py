"""How to run each unmodified harness CLI headless against a polar_env gateway, as plain data.

One :class:`ClientSpec` per (harness, wire API) pair. A spec is a template: ``render`` fills in

- ``{base_url}``: the gateway root, e.g. ``http://127.0.0.1:8400`` (no ``/v1``; each spec appends
  the path suffix its SDK expects),
- ``{key}``: the session secret the gateway assigned (sent as ``x-api-key``, ``Authorization:
  Bearer`` or ``x-goog-api-key`` depending on the harness),
- ``{model}``: the model id the harness should ask for (the gateway maps any name onto the served
  model),
- ``{home}``: an absolute, private, empty directory used as ``$HOME`` (all config lands under it),
- ``{prompt}``: the task prompt.

``files`` maps a path *relative to {home}* to the file's content; the caller writes them before
starting the CLI. ``env`` is an overlay for a base environment that must still provide ``PATH``
(with ``node`` on it); it always sets ``HOME``. Run the CLI with a working directory of your choice
(every spec trusts / skips repo checks for it) and stdin at ``/dev/null`` (Codex reads extra input
from a non-TTY stdin until EOF).

The argv element ``{prompt_words}`` expands to ``prompt.split()`` (opencode wraps a single argv
prompt that contains spaces in literal quotes, so it gets the words as separate arguments).

Every spec was checked end to end (tool round trip, exit 0) against a fake provider in a
loopback-only network namespace, with the CLI versions pinned in ``scripts/install_harnesses.sh``;
the request bodies seen are in ``tests/fixtures/providers/captured/<harness>-<api>/``. Sources:
``harnesses.md`` §2–§7.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from polar_env.records import ProviderAPI

__all__ = ["CLIENTS", "KEY_ENV", "PROMPT_WORDS", "VERSIONS", "ClientSpec", "get", "render"]

KEY_ENV = "POLAR_API_KEY"
"""Env var holding the session key, for harnesses whose config names a variable rather than a value
(Codex ``env_key``, opencode ``{env:...}``, pi ``apiKey``)."""

PROMPT_WORDS = "{prompt_words}"

VERSIONS: Mapping[str, str] = MappingProxyType({
    # npm versions the specs were validated with (kept in step with scripts/install_harnesses.sh).
    "claude": "@anthropic-ai/claude-code@2.1.197",
    "codex": "@openai/codex@0.171.0",
    "gemini": "@google/gemini-cli@0.61.0",
    "qwen": "@qwen-code/qwen-code@0.15.10",
    "opencode": "opencode-ai@1.18.33",
    "pi": "@mariozechner/pi-coding-agent@0.73.1",
})


@dataclass(frozen=True, slots=True)
class ClientSpec:
    """One harness CLI pointed at one gateway wire format. All strings are templates."""

    name: str  # harness: claude, codex, gemini, qwen, opencode, pi
    api: ProviderAPI
    binary: str  # executable name under <prefix>/<name>/node_modules/.bin/
    argv: tuple[str, ...]  # argv[0] is the binary; "{prompt}" / "{prompt_words}" elements
    env: Mapping[str, str] = field(default_factory=dict)
    files: Mapping[str, str] = field(default_factory=dict)  # path relative to {home} -> content
    paths: tuple[str, ...] = ()  # request paths the harness's main turns hit (documentation/tests)

    @property
    def id(self) -> str:
        return f"{self.name}-{self.api.value}"


def _json(data: object) -> str:
    return json.dumps(data, indent=2) + "\n"


_PLACEHOLDERS = ("base_url", "key", "model", "home", "prompt")


def _fill(template: str, values: Mapping[str, str], *, quoted: bool) -> str:
    for name in _PLACEHOLDERS:
        value = values[name]
        # Inside JSON / TOML basic strings the value must be escaped; json.dumps does both.
        template = template.replace("{" + name + "}", json.dumps(value)[1:-1] if quoted else value)
    return template


def render(spec: ClientSpec, base_url: str, key: str, model: str, home: str,
           prompt: str) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """Fill a spec: ``(argv, env overlay, {path relative to home: content})``."""
    values = {"base_url": base_url.rstrip("/"), "key": key, "model": model, "home": home, "prompt": prompt}
    argv: list[str] = []
    for arg in spec.argv:
        if arg == PROMPT_WORDS:
            argv.extend(prompt.split())
        else:
            argv.append(_fill(arg, values, quoted=False))
    env = {k: _fill(v, values, quoted=False) for k, v in spec.env.items()}
    files = {path: _fill(text, values, quoted=path.endswith((".json", ".toml"))) for path, text in spec.files.items()}
    return argv, env, files


# -- Claude Code (harnesses.md §2) --------------------------------------------------------------

_CLAUDE = ClientSpec(
    name="claude",
    api=ProviderAPI.ANTHROPIC,
    binary="claude",
    argv=("claude", "-p", "{prompt}", "--dangerously-skip-permissions"),
    env={
        "HOME": "{home}",
        "ANTHROPIC_BASE_URL": "{base_url}",  # the SDK appends /v1/messages
        "ANTHROPIC_API_KEY": "{key}",  # sent as x-api-key
        "ANTHROPIC_MODEL": "{model}",
        "ANTHROPIC_SMALL_FAST_MODEL": "{model}",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": "{model}",
        # Drops the title-generation side request (and other non-essential traffic).
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        # Removes the per-request "x-anthropic-billing-header" first system block.
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        # As root the CLI refuses --dangerously-skip-permissions without it.
        "IS_SANDBOX": "1",
    },
    paths=("/v1/messages",),
)

# -- Codex CLI (§3): a custom model_providers entry; the built-in provider tries a WebSocket first
# and then posts without Authorization. wire_api = "chat" is rejected at config load. --------------

_CODEX_TOML = """\
model = "{model}"
model_provider = "polar"
check_for_update_on_startup = false
web_search = "disabled"

[model_providers.polar]
name = "polar"
base_url = "{base_url}/v1"
env_key = "POLAR_KEY_ENV"
wire_api = "responses"

[analytics]
enabled = false

[feedback]
enabled = false
""".replace("POLAR_KEY_ENV", KEY_ENV)

_CODEX = ClientSpec(
    name="codex",
    api=ProviderAPI.OPENAI_RESPONSES,
    binary="codex",
    argv=("codex", "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
          "--ephemeral", "{prompt}"),
    env={"HOME": "{home}", "CODEX_HOME": "{home}/.codex", KEY_ENV: "{key}"},
    files={".codex/config.toml": _CODEX_TOML},
    paths=("/v1/responses",),
)

# -- Gemini CLI (§4): -m avoids the router's classifier request and its own model names. ---------

_GEMINI = ClientSpec(
    name="gemini",
    api=ProviderAPI.GEMINI,
    binary="gemini",
    argv=("gemini", "-m", "{model}", "-p", "{prompt}", "--yolo"),
    env={
        "HOME": "{home}",
        "GOOGLE_GEMINI_BASE_URL": "{base_url}",  # the SDK appends /v1beta/models/...
        "GEMINI_API_KEY": "{key}",  # sent as x-goog-api-key
        "GEMINI_CLI_TRUST_WORKSPACE": "true",  # an untrusted cwd exits 55 and downgrades --yolo
    },
    files={".gemini/settings.json": _json({
        "security": {"auth": {"selectedType": "gemini-api-key"}},
        "telemetry": {"enabled": False},
        "privacy": {"usageStatisticsEnabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
    })},
    paths=("/v1beta/models/{model}:streamGenerateContent",),
)

# -- Qwen Code (§5) -------------------------------------------------------------------------------

_QWEN = ClientSpec(
    name="qwen",
    api=ProviderAPI.OPENAI_CHAT,
    binary="qwen",
    argv=("qwen", "{prompt}", "--yolo", "--auth-type", "openai"),
    env={
        "HOME": "{home}",
        "OPENAI_BASE_URL": "{base_url}/v1",
        "OPENAI_API_KEY": "{key}",
        "OPENAI_MODEL": "{model}",
    },
    files={".qwen/settings.json": _json({
        "security": {"auth": {"selectedType": "openai"}},
        "telemetry": {"enabled": False},
        "privacy": {"usageStatisticsEnabled": False},
        "general": {"enableAutoUpdate": False},
        # Otherwise a background "managed memory extraction" request follows every answer.
        "memory": {"enableManagedAutoMemory": False},
    })},
    paths=("/v1/chat/completions",),
)

# -- opencode (§6): small_model points at the served model (it still sends a title request). ------

_OPENCODE = ClientSpec(
    name="opencode",
    api=ProviderAPI.OPENAI_CHAT,
    binary="opencode",
    argv=("opencode", "run", PROMPT_WORDS),
    env={
        "HOME": "{home}",
        "XDG_CONFIG_HOME": "{home}/.config",
        "XDG_DATA_HOME": "{home}/.local/share",
        "XDG_CACHE_HOME": "{home}/.cache",
        "XDG_STATE_HOME": "{home}/.local/state",
        KEY_ENV: "{key}",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_SHARE": "1",
    },
    files={".config/opencode/opencode.json": _json({
        "provider": {"polar": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "polar",
            "options": {"baseURL": "{base_url}/v1", "apiKey": "{env:" + KEY_ENV + "}"},
            "models": {"{model}": {"limit": {"context": 65536, "output": 8192}}},
        }},
        "model": "polar/{model}",
        "small_model": "polar/{model}",
        "permission": {"*": "allow"},
        "autoupdate": False,
        "share": "disabled",
    })},
    paths=("/v1/chat/completions",),
)

# -- pi (§7): one provider "polar" in ~/.pi/agent/models.json; `api` picks the wire format. The
# base URL is whatever the SDK behind each api mode expects: the OpenAI SDK appends
# /chat/completions or /responses to ".../v1", the Anthropic SDK appends /v1/messages to the root,
# and pi's Google client sets apiVersion "" so the version segment must be in the base URL. -------

_PI_MODES: tuple[tuple[ProviderAPI, str, str, tuple[str, ...]], ...] = (
    (ProviderAPI.OPENAI_CHAT, "openai-completions", "{base_url}/v1", ("/v1/chat/completions",)),
    (ProviderAPI.OPENAI_RESPONSES, "openai-responses", "{base_url}/v1", ("/v1/responses",)),
    (ProviderAPI.ANTHROPIC, "anthropic-messages", "{base_url}", ("/v1/messages",)),
    (ProviderAPI.GEMINI, "google-generative-ai", "{base_url}/v1beta",
     ("/v1beta/models/{model}:streamGenerateContent",)),
)


def _pi(api: ProviderAPI, pi_api: str, base: str, paths: tuple[str, ...]) -> ClientSpec:
    model: dict[str, object] = {"id": "{model}"}
    if pi_api.startswith("openai-"):
        # Otherwise the system prompt goes out as role "developer".
        model["compat"] = {"supportsDeveloperRole": False}
    provider = {"baseUrl": base, "api": pi_api, "apiKey": KEY_ENV, "models": [model]}
    return ClientSpec(
        name="pi",
        api=api,
        binary="pi",
        argv=("pi", "-p", "{prompt}", "--provider", "polar", "--model", "{model}", "--no-session"),
        env={
            "HOME": "{home}",
            "PI_CODING_AGENT_DIR": "{home}/.pi/agent",
            KEY_ENV: "{key}",
            "PI_OFFLINE": "1",
            "PI_TELEMETRY": "0",
            "PI_SKIP_VERSION_CHECK": "1",
        },
        files={".pi/agent/models.json": _json({"providers": {"polar": provider}})},
        paths=paths,
    )


CLIENTS: Mapping[tuple[str, ProviderAPI], ClientSpec] = MappingProxyType({
    (s.name, s.api): s
    for s in (_CLAUDE, _CODEX, _GEMINI, _QWEN, _OPENCODE, *(_pi(*mode) for mode in _PI_MODES))
})


def get(name: str, api: ProviderAPI | str | None = None) -> ClientSpec:
    """The spec for a harness; ``api`` is required only for pi (which speaks all four)."""
    matches = [s for (n, a), s in CLIENTS.items() if n == name and (api is None or a == ProviderAPI(api))]
    if len(matches) != 1:
        known = ", ".join(s.id for s in CLIENTS.values())
        raise KeyError(f"no unique client spec for {name!r} api={api!r} (known: {known})")
    return matches[0]
