"""pi (``pi``), all four wire formats. Source: ``harnesses.md`` §7.

One provider "polar" in ``~/.pi/agent/models.json``; its ``api`` picks the wire format. The base
URL is whatever the SDK behind each api mode expects: the OpenAI SDK appends ``/chat/completions``
or ``/responses`` to ``.../v1``, the Anthropic SDK appends ``/v1/messages`` to the root, and pi's
Google client sets apiVersion "" so the version segment must be in the base URL. pi has no approval
system, so no unattended flag is needed.
"""

from __future__ import annotations

from polar_env.harnesses.spec import KEY_ENV, ApiConfig, HarnessSpec, Install, as_json
from polar_env.records import ProviderAPI

# (api, pi's name for it, base URL, main-turn paths)
MODES: tuple[tuple[ProviderAPI, str, str, tuple[str, ...]], ...] = (
    (ProviderAPI.OPENAI_CHAT, "openai-completions", "{base_url}/v1", ("/v1/chat/completions",)),
    (ProviderAPI.OPENAI_RESPONSES, "openai-responses", "{base_url}/v1", ("/v1/responses",)),
    (ProviderAPI.ANTHROPIC, "anthropic-messages", "{base_url}", ("/v1/messages",)),
    (ProviderAPI.GEMINI, "google-generative-ai", "{base_url}/v1beta", ("/v1beta/models/{model}:streamGenerateContent",)),
)


def _mode(pi_api: str, base: str, paths: tuple[str, ...]) -> ApiConfig:
    model: dict[str, object] = {"id": "{model}"}
    if pi_api.startswith("openai-"):
        # Otherwise the system prompt goes out as role "developer".
        model["compat"] = {"supportsDeveloperRole": False}
    provider = {"baseUrl": base, "api": pi_api, "apiKey": KEY_ENV, "models": [model]}
    return ApiConfig(
        env={KEY_ENV: "{key}"},
        files={".pi/agent/models.json": as_json({"providers": {"polar": provider}})},
        paths=paths,
    )


SPEC = HarnessSpec(
    name="pi",
    cli="pi",
    install=Install("npm", "@mariozechner/pi-coding-agent", "0.73.1", binary="pi", dir="pi"),
    apis={api: _mode(pi_api, base, paths) for api, pi_api, base, paths in MODES},
    default_api=ProviderAPI.OPENAI_CHAT,
    argv=("pi", "-p", "{prompt}", "--provider", "polar", "--model", "{model}", "--no-session"),
    quiet_env={
        "HOME": "{home}",
        "PI_CODING_AGENT_DIR": "{home}/.pi/agent",
        "PI_OFFLINE": "1",
        "PI_TELEMETRY": "0",
        "PI_SKIP_VERSION_CHECK": "1",
    },
    description="pi coding agent: one CLI, four provider wire formats (pick with api=...).",
)
