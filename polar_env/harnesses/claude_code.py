"""Claude Code (``claude``), Anthropic Messages only. Source: ``harnesses.md`` §2."""

from __future__ import annotations

from polar_env.harnesses.spec import ApiConfig, HarnessSpec, Install, RequestMatch, SideRequest
from polar_env.records import ProviderAPI

SPEC = HarnessSpec(
    name="claude_code",
    cli="claude",
    install=Install("npm", "@anthropic-ai/claude-code", "2.1.197", binary="claude", dir="claude"),
    apis={ProviderAPI.ANTHROPIC: ApiConfig(
        env={
            "ANTHROPIC_BASE_URL": "{base_url}",  # the SDK appends /v1/messages
            "ANTHROPIC_API_KEY": "{key}",  # sent as x-api-key
            "ANTHROPIC_MODEL": "{model}",
            "ANTHROPIC_SMALL_FAST_MODEL": "{model}",
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": "{model}",
        },
        paths=("/v1/messages",),
    )},
    default_api=ProviderAPI.ANTHROPIC,
    argv=("claude", "-p", "{prompt}", "--dangerously-skip-permissions"),
    unattended_flags=("--dangerously-skip-permissions",),
    quiet_env={
        "HOME": "{home}",
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
    side_requests=(
        SideRequest("HEAD / preconnect", None, "answer 200"),
        SideRequest("title generation: no tools, output_config.format json_schema",
                    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1", name="title",
                    match=RequestMatch(ProviderAPI.ANTHROPIC, system=("title",), tools=False, json_output=True)),
    ),
    description="Anthropic's Claude Code CLI (native binary shipped in the npm package).",
)
