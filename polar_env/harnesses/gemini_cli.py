"""Gemini CLI (``gemini``), Gemini generateContent only. Source: ``harnesses.md`` §4.

``-m`` is always passed: without it the router sends a classifier request and picks its own model
names. ``GEMINI_CLI_TRUST_WORKSPACE`` avoids exit 55 in an untrusted cwd (which also downgrades
``--yolo``).
"""

from __future__ import annotations

from polar_env.harnesses.spec import ApiConfig, HarnessSpec, Install, RequestMatch, SideRequest, as_json
from polar_env.records import ProviderAPI

SETTINGS = {
    "security": {"auth": {"selectedType": "gemini-api-key"}},
    "telemetry": {"enabled": False},
    "privacy": {"usageStatisticsEnabled": False},
    "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
}

SPEC = HarnessSpec(
    name="gemini_cli",
    cli="gemini",
    install=Install("npm", "@google/gemini-cli", "0.61.0", binary="gemini", dir="gemini"),
    apis={ProviderAPI.GEMINI: ApiConfig(
        env={
            "GOOGLE_GEMINI_BASE_URL": "{base_url}",  # the SDK appends /v1beta/models/...
            "GEMINI_API_KEY": "{key}",  # sent as x-goog-api-key
        },
        files={".gemini/settings.json": as_json(SETTINGS)},
        paths=("/v1beta/models/{model}:streamGenerateContent",),
    )},
    default_api=ProviderAPI.GEMINI,
    argv=("gemini", "-m", "{model}", "-p", "{prompt}", "--yolo"),
    unattended_flags=("--yolo",),
    quiet_env={"HOME": "{home}", "GEMINI_CLI_TRUST_WORKSPACE": "true"},
    side_requests=(
        SideRequest("router classifier :generateContent with a JSON schema (uppercase types)",
                    "-m <model> (this preset)", "answer valid JSON if it arrives; not trained with the task's reward",
                    name="classifier",
                    match=RequestMatch(ProviderAPI.GEMINI, system=("Task Routing AI",), json_output=True)),
    ),
    description="Google's Gemini CLI.",
)
