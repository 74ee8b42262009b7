"""Qwen Code (``qwen``), OpenAI Chat Completions. Source: ``harnesses.md`` §5."""

from __future__ import annotations

from polar_env.harnesses.spec import ApiConfig, HarnessSpec, Install, RequestMatch, SideRequest, as_json
from polar_env.records import ProviderAPI

SETTINGS = {
    "security": {"auth": {"selectedType": "openai"}},
    "telemetry": {"enabled": False},
    "privacy": {"usageStatisticsEnabled": False},
    "general": {"enableAutoUpdate": False},
    # Otherwise a background "managed memory extraction" request follows every answer.
    "memory": {"enableManagedAutoMemory": False},
}

SPEC = HarnessSpec(
    name="qwen_code",
    cli="qwen",
    install=Install("npm", "@qwen-code/qwen-code", "0.15.10", binary="qwen", dir="qwen"),
    apis={ProviderAPI.OPENAI_CHAT: ApiConfig(
        env={
            "OPENAI_BASE_URL": "{base_url}/v1",
            "OPENAI_API_KEY": "{key}",
            "OPENAI_MODEL": "{model}",
        },
        files={".qwen/settings.json": as_json(SETTINGS)},
        paths=("/v1/chat/completions",),
    )},
    default_api=ProviderAPI.OPENAI_CHAT,
    argv=("qwen", "{prompt}", "--yolo", "--auth-type", "openai"),
    unattended_flags=("--yolo",),
    quiet_env={"HOME": "{home}"},  # telemetry, usage statistics, auto-update: off in settings.json
    side_requests=(
        SideRequest("managed-memory extraction chat request after each answer (a forked sub-agent with tools)",
                    "memory.enableManagedAutoMemory=false (this preset)", name="memory",
                    match=RequestMatch(ProviderAPI.OPENAI_CHAT, system=("memory extraction subagent",))),
    ),
    description="Qwen Code CLI (a Gemini CLI fork speaking OpenAI chat).",
)
