"""opencode (``opencode``), OpenAI Chat Completions via ``@ai-sdk/openai-compatible``.
Source: ``harnesses.md`` §6.

The prompt goes as separate argv words: a single argv prompt containing spaces arrives wrapped in
literal double quotes. ``small_model`` points at the served model, so the title request it still
sends lands on the gateway too.
"""

from __future__ import annotations

from polar_env.harnesses.spec import KEY_ENV, PROMPT_WORDS, ApiConfig, HarnessSpec, Install, RequestMatch, SideRequest, as_json
from polar_env.records import ProviderAPI

CONFIG = {
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
}

SPEC = HarnessSpec(
    name="opencode",
    cli="opencode",
    install=Install("npm", "opencode-ai", "1.18.33", binary="opencode", dir="opencode"),
    apis={ProviderAPI.OPENAI_CHAT: ApiConfig(
        env={KEY_ENV: "{key}"},
        files={".config/opencode/opencode.json": as_json(CONFIG)},
        paths=("/v1/chat/completions",),
    )},
    default_api=ProviderAPI.OPENAI_CHAT,
    argv=("opencode", "run", PROMPT_WORDS),
    quiet_env={
        "HOME": "{home}",
        "XDG_CONFIG_HOME": "{home}/.config",
        "XDG_DATA_HOME": "{home}/.local/share",
        "XDG_CACHE_HOME": "{home}/.cache",
        "XDG_STATE_HOME": "{home}/.local/state",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_SHARE": "1",
    },
    side_requests=(
        SideRequest("title generation on small_model, no tools, before the main turn", None, name="title",
                    match=RequestMatch(ProviderAPI.OPENAI_CHAT, system=("You are a title generator",), tools=False)),
    ),
    description="opencode (two Bun binaries in the npm package); approvals off via permission '*': allow. "
                "It sends its own x-session-id header; the gateway's session key stays authoritative.",
)
