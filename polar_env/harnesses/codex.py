"""Codex CLI (``codex``), OpenAI Responses only. Source: ``harnesses.md`` §3.

A custom ``model_providers`` entry is required: with the built-in provider Codex first tries a
WebSocket upgrade and then posts without ``Authorization``; ``wire_api = "chat"`` is rejected at
config load, so the gateway must serve ``/v1/responses``.
"""

from __future__ import annotations

from polar_env.harnesses.spec import KEY_ENV, ApiConfig, HarnessSpec, Install, SideRequest
from polar_env.records import ProviderAPI

CONFIG_TOML = f"""\
model = "{{model}}"
model_provider = "polar"
check_for_update_on_startup = false
web_search = "disabled"

[model_providers.polar]
name = "polar"
base_url = "{{base_url}}/v1"
env_key = "{KEY_ENV}"
wire_api = "responses"

[analytics]
enabled = false

[feedback]
enabled = false
"""

SPEC = HarnessSpec(
    name="codex",
    cli="codex",
    install=Install("npm", "@openai/codex", "0.171.0", binary="codex", dir="codex"),
    apis={ProviderAPI.OPENAI_RESPONSES: ApiConfig(
        env={"CODEX_HOME": "{home}/.codex", KEY_ENV: "{key}"},
        files={".codex/config.toml": CONFIG_TOML},
        paths=("/v1/responses",),
    )},
    default_api=ProviderAPI.OPENAI_RESPONSES,
    argv=("codex", "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
          "--ephemeral", "{prompt}"),
    unattended_flags=("--dangerously-bypass-approvals-and-sandbox",),
    quiet_env={"HOME": "{home}"},  # update check, analytics, feedback and web search: off in config.toml
    side_requests=(
        SideRequest("WebSocket GET /v1/responses (built-in openai provider only)",
                    "a custom model_providers entry (this preset)", "reply 426"),
    ),
    description="OpenAI's Codex CLI (Rust binary shipped in the npm package). Run it with stdin at "
                "/dev/null: it reads extra input from a non-TTY stdin until EOF.",
)
