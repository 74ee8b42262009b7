"""PROVIDERS: the only place a provider wire format is registered (see ``base`` for the contract)."""

from __future__ import annotations

from polar_env.proxy.providers import anthropic, gemini, openai_chat, openai_responses
from polar_env.proxy.providers.base import Provider
from polar_env.records import ProviderAPI

PROVIDERS: dict[ProviderAPI, Provider] = {
    anthropic.API: anthropic,  # type: ignore[dict-item]
    gemini.API: gemini,
    openai_chat.API: openai_chat,  # type: ignore[dict-item]
    openai_responses.API: openai_responses,  # type: ignore[dict-item]
}
